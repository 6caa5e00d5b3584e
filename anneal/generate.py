"""Sample text from an exported model directory (``anneal export``), to eyeball progress."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from anneal.errors import UserError


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
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        model = model.float()  # bf16 matmuls are slow on most CPUs
    return model.to(device).eval(), tok


@torch.no_grad()
def sample(
    model_dir: Path,
    *,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
) -> str:
    """The prompt followed by up to ``max_new_tokens`` sampled tokens (stops at EOS).
    ``temperature`` 0 is greedy; ``top_k`` 0 samples from the whole vocabulary."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be at least 1.")
    if temperature < 0:
        raise UserError(f"--temperature {temperature}: must be 0 (greedy) or positive.")
    if top_k < 0:
        raise UserError(f"--top-k {top_k}: must be 0 (off) or positive.")
    model, tok = load(model_dir)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    if ids.numel() == 0:
        raise UserError("--prompt is empty: give at least one character of text.")
    limit = model.config.max_position_embeddings
    ids = ids[:, -(limit - 1) :].to(model.device)
    max_new_tokens = min(max_new_tokens, limit - ids.shape[1])
    torch.manual_seed(seed)
    kwargs = {"do_sample": False}
    if temperature > 0:
        kwargs = {"do_sample": True, "temperature": temperature, "top_k": top_k or None}
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
