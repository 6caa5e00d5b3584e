"""Sample text from an exported model directory (``anneal export``), to eyeball progress.

The sampling values are checked before the model is loaded. A prompt that does not fit the
model's context (``max_position_embeddings``) with room for one new token is refused, not cut:
a continuation of the prompt's last part alone would read as a continuation of the whole. When
prompt plus ``max_new_tokens`` overflow the context, generation stops where the context is full,
and a warning says so. Only safetensors weights are loaded (what export writes): a directory
from elsewhere holding only pickled weights is refused rather than unpickled.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch

from anneal.data.tokenizer_hf import first_line, remote_code_refused
from anneal.errors import UserError

log = logging.getLogger(__name__)


def load(model_dir: Path):
    """(model, tokenizer) of an export directory; UserError if it is not one."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file() or not (model_dir / "tokenizer.json").is_file():
        raise UserError(
            f"{model_dir}: not an exported model directory (needs config.json and "
            f"tokenizer.json). Write one with `anneal export RUN --out {model_dir}`."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:  # never the directory's own code: transformers would ask at a terminal, then run it
        tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), use_safetensors=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise remote_code_refused(str(model_dir), e) or UserError(
            f"{model_dir}: transformers cannot load it as a model with its tokenizer "
            f"({first_line(e)}). "
            f"Give a directory written by `anneal export` (safetensors weights, config.json, "
            f"tokenizer.json), or export the run again."
        ) from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        model = model.float()  # bf16 matmuls are slow on most CPUs
    return model.to(device).eval(), tok


def check_sampling(
    *, max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int
) -> None:
    """UserError naming the flag when a sampling value is out of its range."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be at least 1.")
    if not math.isfinite(temperature) or temperature < 0:
        raise UserError(
            f"--temperature {temperature:g}: must be a finite number, 0 (greedy) or positive "
            f"(0.8 is the default; above about 2 the text is noise)."
        )
    if top_k < 0:
        raise UserError(f"--top-k {top_k}: must be 0 (off) or positive.")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise UserError(
            f"--top-p {top_p:g}: must be in (0, 1]: the share of probability mass sampled from "
            f"(1 is off, 0.9 a common choice)."
        )
    if not -(2**63) <= seed < 2**64:
        raise UserError(f"--seed {seed}: must fit in 64 bits, e.g. 0.")


@torch.no_grad()
def sample(
    model_dir: Path,
    *,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 1.0,
    seed: int = 0,
) -> str:
    """The prompt followed by up to ``max_new_tokens`` sampled tokens (stops at EOS, or where
    the context is full). ``temperature`` 0 is greedy; ``top_k`` 0 samples from the whole
    vocabulary; ``top_p`` 1 keeps all of the probability mass."""
    check_sampling(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
    )
    model, tok = load(model_dir)
    try:
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    except (TypeError, ValueError, UnicodeError) as e:
        raise UserError(
            f"--prompt: the tokenizer cannot encode it ({e}). Give plain text."
        ) from None
    if ids.numel() == 0:
        raise UserError("--prompt is empty: give at least one character of text.")
    limit = model.config.max_position_embeddings
    if ids.shape[1] >= limit:
        raise UserError(
            f"--prompt: {ids.shape[1]} tokens, and the model reads at most {limit} "
            f"(max_position_embeddings in {Path(model_dir) / 'config.json'}), with room for at "
            f"least one new token. Shorten the prompt to at most {limit - 1} tokens (keep its "
            f"end: the continuation follows it)."
        )
    room = limit - ids.shape[1]
    if max_new_tokens > room:
        log.warning(
            "--max-new-tokens %d: the prompt is %d tokens and the context %d, so at most %d "
            "new tokens fit; generation stops there",
            max_new_tokens,
            ids.shape[1],
            limit,
            room,
        )
        max_new_tokens = room
    ids = ids.to(model.device)
    torch.manual_seed(seed)
    kwargs = {"do_sample": False}
    if temperature > 0:
        kwargs = {"do_sample": True, "temperature": temperature, "top_k": top_k or None}
        if top_p < 1:
            kwargs["top_p"] = top_p
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        **kwargs,
    )
    new = out[0, ids.shape[1] :].tolist()
    if tok.eos_token_id in new:
        new = new[: new.index(tok.eos_token_id)]
    return prompt + tok.decode(new, skip_special_tokens=True)
