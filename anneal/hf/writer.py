"""Writing a Hugging Face model directory: safetensors shards streamed one tensor at a time
(a header computed from the shapes, then each tensor's bytes), the model and generation configs,
and the run's tokenizer files. Peak memory is about one tensor (1.5 of it for bf16), whatever
the model size; exported weights never pass through pickle.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import struct
import time
from pathlib import Path

import torch

from anneal.errors import UserError
from anneal.hardware import peak_memory_bytes, process_memory_bytes
from anneal.hf.zero import TensorSource, ZeroCheckpoint
from anneal.model import hf_model_config, model_class

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
)


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes; also KB/MB/GiB/MiB... and plain integers (bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"--shard-size {text}: give a size such as 5GB, 500MB or 2GiB.")
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
    units |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    size = int(float(m.group(1)) * units[(m.group(2) or "").lower()])
    if size <= 0:
        raise UserError(f"--shard-size {text}: must be positive.")
    return size


def _plan_shards(sources: list[TensorSource], itemsize: int, shard_bytes: int):
    shards, current, size = [], [], 0
    for s in sources:
        n = s.numel() * itemsize
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(s)
        size += n
    if current:
        shards.append(current)
    return shards


def _write_shard(path: Path, sources: list[TensorSource], dtype: torch.dtype, on_tensor) -> None:
    itemsize = dtype.itemsize
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for s in sources:
        n = s.numel() * itemsize
        header[s.name] = {
            "dtype": _ST_DTYPE[dtype],
            "shape": list(s.shape),
            "data_offsets": [at, at + n],
        }
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for s in sources:
            t = s.load()
            if t.dtype != dtype:
                t = t.to(dtype)
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
            on_tensor(s)
            del t


def write_safetensors(sources, out: Path, *, dtype: torch.dtype, shard_bytes: int, on_tensor=None):
    """HF's layout: one ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``. Returns the file names written."""
    shards = _plan_shards(sources, dtype.itemsize, shard_bytes)
    on_tensor = on_tensor or (lambda s: None)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        _write_shard(out / name, shard, dtype, on_tensor)
        weight_map |= {s.name: name for s in shard}
    if len(shards) > 1:
        total = sum(s.numel() for s in sources) * dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


# --- memory ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _peak_rss():
    """Yields a dict that holds, on exit, ``rss_before_bytes`` (the resident set at entry) and
    ``peak_rss_bytes`` (the peak resident set within, restarted at entry:
    ``anneal.hardware.peak_memory_bytes``)."""
    result = {"rss_before_bytes": process_memory_bytes(), "peak_rss_bytes": None}
    peak_memory_bytes(reset=True)
    yield result
    result["peak_rss_bytes"] = peak_memory_bytes()


# --- the conversion --------------------------------------------------------------------------


def convert(
    ckpt: ZeroCheckpoint,
    out: Path,
    *,
    preset,
    dtype: str,
    shard_bytes: int,
    tok_dir: Path,
    manifest: dict,
) -> dict:
    """Checkpoint -> safetensors + configs + tokenizer in ``out``, measuring peak memory."""
    torch_dtype = DTYPES[dtype]
    start = time.perf_counter()
    largest = max(s.numel() for s in ckpt.sources) * 4
    with _peak_rss() as memory:
        files = write_safetensors(ckpt.sources, out, dtype=torch_dtype, shard_bytes=shard_bytes)
    n_params = sum(s.numel() for s in ckpt.sources)
    convert_s = time.perf_counter() - start
    eos_id = write_configs(out, preset, tok_dir, torch_dtype)
    return {
        "checkpoint": str(ckpt.tag_dir),
        "step": manifest.get("step"),
        "tokens": manifest.get("tokens"),
        "zero_stage": ckpt.zero_stage,
        "world_size": ckpt.world_size,
        "dtype": dtype,
        "files": files,
        "params": n_params,
        "model_bytes_fp32": n_params * 4,
        "largest_tensor_bytes_fp32": largest,
        **memory,
        "convert_s": round(convert_s, 3),
        "eos_token_id": eos_id,
    }


def write_configs(out: Path, preset, tok_dir: Path, torch_dtype) -> int | None:
    from transformers import GenerationConfig

    from anneal.data import tokenizer

    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, out / name)
    eos_id = tokenizer.load(tok_dir).eos_id
    config = hf_model_config(preset)  # a continued checkpoint's own architecture
    config.eos_token_id = eos_id  # generation stops at the documents' separator
    config.architectures = [model_class(config).__name__]
    config.use_cache = True
    if getattr(config, "output_router_logits", False):  # a sparse model: its loss the LM's
        config.output_router_logits = False  # as Qwen3-30B-A3B's release ships it
    config.dtype = torch_dtype
    config.save_pretrained(str(out))
    GenerationConfig(
        eos_token_id=eos_id, pad_token_id=eos_id, do_sample=True, temperature=0.8, top_k=50
    ).save_pretrained(str(out))
    return eos_id


# --- verification ----------------------------------------------------------------------------
