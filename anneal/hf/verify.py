"""Verification of an export: ``AutoModelForCausalLM`` and ``AutoTokenizer`` load the
directory; the tokenizer encodes a fixed text like the run's; and the logits on a fixed batch
match those of the training model (``anneal.model.build_model``) holding the weights that
``anneal.hf.zero.reference_state_dict`` consolidates from the same checkpoint, as DeepSpeed's
``zero_to_fp32`` does (with tensor parallelism, each rank's slices merged where the model's
tp_plan cut them): an independent path to the lazy reader's. The comparison runs in fp32 on
both sides, the reference's weights rounded through the export dtype first, so any difference
is a layout bug and not bf16 rounding (which is reported apart).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from anneal.errors import UserError
from anneal.hf.autoep import reference_to_hf
from anneal.hf.tp_merge import reference_tp_state_dict
from anneal.hf.writer import DTYPES
from anneal.hf.zero import reference_state_dict
from anneal.model import build_model
from anneal.resilience import checkpoint

# Logits of the exported model vs the reference (both in fp32, identical weights): any
# difference beyond float noise is a bug. Relative to max(1, largest |logit|).
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-4}
VERIFY_TEXT = 'def greet(name):\n    """Say hello."""\n    return f"Hello, {name}!"\n'


class ExportMismatch(RuntimeError):
    """The exported model does not reproduce the checkpoint: a bug, never the user's doing."""


def verify_batch(tokenizer, vocab_size: int, seq_len: int) -> torch.Tensor:
    """Two rows: a fixed text through the exported tokenizer, and fixed random ids."""
    t = min(seq_len, 64)
    ids = tokenizer(VERIFY_TEXT * 8, add_special_tokens=False)["input_ids"][:t]
    ids += [0] * (t - len(ids))
    g = torch.Generator().manual_seed(0)
    return torch.stack([torch.tensor(ids), torch.randint(0, vocab_size, (t,), generator=g)])


@torch.no_grad()
def verify_export(
    out: Path,
    *,
    tag_dir: Path,
    zero_stage: int,
    preset,
    dtype: str,
    data_tokenizer: Path,
    tensor_parallel: int = 1,
) -> dict:
    """Load ``out`` with transformers and compare with the checkpoint; ExportMismatch if not.
    ``tensor_parallel``: the degree it was saved at; the reference merges the ranks' slices
    where the model's tp_plan cut them (``anneal.hf.tp_merge.reference_tp_state_dict``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anneal.data import tokenizer

    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(out), trust_remote_code=False)
    ours = tokenizer.load(data_tokenizer).encode_batch([VERIFY_TEXT])[0]
    theirs = tok(VERIFY_TEXT, add_special_tokens=False)["input_ids"]
    if ours != theirs:  # the files are copies of the data directory's: they disagree there
        raise UserError(
            f"{data_tokenizer}: AutoTokenizer on its tokenizer.json (as exported) "
            f"encodes the check text differently from the run's tokenizer, "
            f"{tokenizer.ids_file(data_tokenizer).name} there ({theirs[:8]}... vs {ours[:8]}...): "
            f"the directory's tokenizer files disagree. `anneal data verify {data_tokenizer}` "
            f"names a file changed since prepare: put it back, or prepare the data again; if "
            f"it finds none, the tokenizer could not be converted exactly: report it. Nothing "
            f"was exported."
        )
    hf = AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, trust_remote_code=False
    ).eval()
    manifest = checkpoint.read_manifest(tag_dir) or {}
    ref = build_model(preset).eval()
    if tensor_parallel > 1:
        sd = reference_tp_state_dict(tag_dir, zero_stage, tensor_parallel, ref)
    else:
        sd = reference_to_hf(tag_dir, reference_state_dict(tag_dir, zero_stage))
    rounded = {k: v.to(DTYPES[dtype]).float() for k, v in sd.items()}
    batch = verify_batch(tok, preset.vocab_size, preset.seq_len)
    try:
        ref.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ExportMismatch(f"{tag_dir}: the reference reader's weights do not fit: {e}") from e
    exact_logits = ref(input_ids=batch).logits.float()
    ref.load_state_dict(rounded, strict=True)
    ref_logits = ref(input_ids=batch).logits.float()
    logits = hf(input_ids=batch).logits.float()
    diff = (logits - ref_logits).abs().max().item()
    scale = max(1.0, ref_logits.abs().max().item())
    tol = TOLERANCE[dtype] * scale
    result = {
        "max_abs_logit_diff": diff,
        "tolerance": tol,
        "dtype_rounding_diff": (logits - exact_logits).abs().max().item(),
        "max_abs_logit": ref_logits.abs().max().item(),
        "batch_shape": list(batch.shape),
        "verify_s": round(time.perf_counter() - start, 3),
        "step": manifest.get("step"),
    }
    if not math.isfinite(diff) or diff > tol:
        raise ExportMismatch(
            f"{out}: the exported model's logits differ from the checkpoint's by {diff:.3g} "
            f"(tolerance {tol:.3g} for {dtype}). The export is wrong; do not ship it. "
            f"Details: {json.dumps(result)}"
        )
    return result
