"""Hugging Face in: a model directory to continue pretraining from (``model.init_from``,
``--init-from DIR``), read and checked when the launch is resolved, before any engine is built
or any weight is read.

``pretrained_preset`` turns ``DIR/config.json`` into the run's model (``ModelPreset.hf_config``:
the architecture through transformers' Auto classes, RoPE settings and
``max_position_embeddings`` kept; the recipe's preset shape is not used) and records where the
weights come from (``ModelPreset.init_from``: the directory and the sha256 of its config, weight
files and tokenizer; sha256 is what the Hub lists for each file). Refused with one paragraph
each: an architecture transformers does not know or that Anneal has not verified, a quantized
checkpoint, a dtype that cannot be cast to a float, missing or truncated weight files, a
vocabulary with more ids than the embedding has rows, and (``check_tokenizer``) data tokenized
with another tokenizer. ``anneal.hf.load_weights`` then copies the tensors into the model.

The config step (``anneal.config``) and the engine (``anneal.train``) import this module and
``load_weights`` only; neither imports anything of the export (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct
from pathlib import Path

from anneal import model as modellib
from anneal.errors import UserError
from anneal.files import confined, sha256_file

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2")
"""``model_type`` values verified end to end (tests/test_init_from.py)."""
SAFETENSORS = ("model.safetensors.index.json", "model.safetensors")
PICKLED = ("pytorch_model.bin.index.json", "pytorch_model.bin")
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
"""safetensors dtypes that cast to the training dtype; anything else (integers, packed or
float8 formats) is a quantized checkpoint."""
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _error(directory: Path, text: str) -> UserError:
    return UserError(f"--init-from {directory}: {text}", every_rank=True)


def read_config(directory: Path) -> dict:
    """``DIR/config.json`` as a dict, its architecture known to transformers and verified
    here, not quantized, and its dtype one that casts."""
    path = directory / "config.json"
    if not directory.is_dir():
        raise _error(
            directory,
            "no such directory. Give a local directory as save_pretrained "
            "writes it (config.json and model.safetensors).",
        )
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise _error(
            directory,
            "holds no config.json, so its architecture is unknown. Give "
            "the directory save_pretrained wrote (config.json beside the weights).",
        ) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _error(
            directory,
            f"config.json cannot be read as JSON ({e}). Restore it from where the model came from.",
        ) from None
    if not isinstance(doc, dict):
        raise _error(directory, "config.json is not a JSON object. Restore it.")
    _check_architecture(directory, doc)
    _check_dtype(directory, doc)
    return doc


def _check_architecture(directory: Path, doc: dict) -> None:
    from transformers import CONFIG_MAPPING

    model_type = doc.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise _error(
            directory,
            f"config.json names model_type {str(model_type)[:40]!r}, an architecture this "
            f"transformers does not know, so the model cannot be built. Continued pretraining "
            f"supports {', '.join(SUPPORTED)}: give a checkpoint of one of these (or upgrade "
            f"transformers if the checkpoint is newer than it).",
        )
    if model_type not in SUPPORTED:
        raise _error(
            directory,
            f"model_type {model_type!r} is known to transformers but not verified with Anneal "
            f"(its loss against transformers, ZeRO layouts and export are checked for "
            f"{', '.join(SUPPORTED)} only). Give a checkpoint of one of these.",
        )
    if doc.get("quantization_config") is not None:
        raise _error(
            directory,
            "config.json has a quantization_config: the weights are quantized (GPTQ, AWQ, "
            "bitsandbytes, ...) and cannot be trained as they are. Give the full-precision "
            "release (bf16, fp16 or fp32 weights).",
        )


def _check_dtype(directory: Path, doc: dict) -> None:
    import torch

    for key in ("dtype", "torch_dtype"):
        value = doc.get(key)
        if value is None or value == "auto":
            continue
        dtype = getattr(torch, str(value), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise _error(
                directory,
                f"config.json gives {key} {str(value)[:40]!r}, which is no floating-point "
                f"torch dtype the weights could be cast from (bfloat16, float16, float32). "
                f"Correct {key} in config.json, or give the full-precision release.",
            )


# --- the weight files ------------------------------------------------------------------------


def weight_files(directory: Path) -> list[Path]:
    """The weight files, as save_pretrained names them: safetensors (one file, or shards named
    by ``model.safetensors.index.json``), else ``pytorch_model.bin`` the same way."""
    for index_name, single in (SAFETENSORS, PICKLED):
        index = directory / index_name
        if index.is_file():
            return _indexed(directory, index)
        if (directory / single).is_file():
            return [directory / single]
    raise _error(
        directory,
        "holds no weights (model.safetensors, model-0000x-of-0000n.safetensors with "
        "model.safetensors.index.json, or pytorch_model.bin). Copy the weight files of the "
        "release into it, or give the directory save_pretrained wrote.",
    )


def _indexed(directory: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _error(
            directory,
            f"{index.name} is not an index save_pretrained writes ({e!r:.80})."
            " Restore it from where the model came from.",
        ) from None
    files = [confined(directory, n, where=f"{index}, weight_map") for n in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise _error(
            directory,
            f"{index.name} names {len(missing)} weight file(s) that are not there "
            f"({', '.join(missing[:3])}): a download that stopped. Copy the missing files.",
        )
    return files


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors of a safetensors file: name -> dtype, shape and the absolute byte range of
    its data (``start``, ``end``). Refused when the header is not one (a damaged file), when
    the file is shorter than the header says (a truncated copy) or when a dtype is not a float
    (a quantized checkpoint)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        try:
            header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
            tensors = {k: _entry(v, 8 + n) for k, v in header.items() if k != "__metadata__"}
        except (
            UnicodeDecodeError,
            ValueError,
            RecursionError,
            TypeError,
            KeyError,
            AttributeError,
        ):
            raise _error(
                path.parent,
                f"{path.name} is not a safetensors file (its header cannot be read): "
                f"truncated or damaged. Copy it again.",
            ) from None
    end = max((v["end"] for v in tensors.values()), default=0)
    if size < end:
        raise _error(
            path.parent,
            f"{path.name} holds {size:,} bytes and its header promises {end:,}: a truncated "
            f"copy. Copy it again.",
        )
    odd = sorted({v["dtype"] for v in tensors.values()} - set(FLOAT_DTYPES))
    if odd:
        raise _error(
            path.parent,
            f"{path.name} holds tensors of dtype {', '.join(odd)}, which cannot be cast to the "
            f"training dtype (a quantized checkpoint). Give the bf16, fp16 or fp32 release.",
        )
    return tensors


def _entry(v: dict, data_start: int) -> dict:
    """One header entry, its offsets made absolute; ValueError when it is inconsistent."""
    shape = [int(d) for d in v["shape"]]
    lo, hi = (int(x) for x in v["data_offsets"])
    width = FLOAT_DTYPES.get(v["dtype"])
    if (
        min(shape, default=0) < 0
        or not 0 <= lo <= hi
        or (width and hi - lo != width * math.prod(shape))
    ):
        raise ValueError("inconsistent tensor entry")
    return {
        "dtype": str(v["dtype"]),
        "shape": shape,
        "start": data_start + lo,
        "end": data_start + hi,
    }


def check_weight_files(directory: Path, files: list[Path]) -> None:
    """Each file whole and readable without running code: safetensors headers and sizes;
    ``.bin`` pickles read by torch's weights-only loader (``anneal.resilience.safeload``;
    tensors memory-mapped, not read)."""
    from anneal.resilience import safeload

    for path in files:
        if path.suffix == ".safetensors":
            safetensors_header(path)
            continue
        try:
            safeload.load(path, map_location="cpu", mmap=True)
        except UserError as e:
            raise _error(
                directory,
                f"{path.name}: {e} Prefer the release's .safetensors files, which hold no code.",
            ) from None


# --- the preset ------------------------------------------------------------------------------


def pretrained_preset(directory: Path, *, data_vocab: int, model) -> modellib.ModelPreset:
    """The run's model from ``DIR/config.json`` (``model`` is the run's ``ModelConfig``: its
    ``seq_len`` sets the training context, 0 keeps the checkpoint's ``max_position_embeddings``;
    a shape override is refused), with where its weights come from."""
    directory = Path(directory)
    doc = read_config(directory)
    set_shape = [k for k in _SHAPE_KEYS if getattr(model, k)]
    if set_shape:
        raise _error(
            directory,
            f"model.{set_shape[0]} is set, but the shape of a pretrained model is its "
            f"config.json's. Drop --set model.{set_shape[0]} (model.seq_len may change).",
        )
    files = weight_files(directory)
    check_weight_files(directory, files)
    preset = modellib.preset_from_dict(
        {**doc, "rope_theta": _rope_theta(doc)},
        source=f"--init-from {directory}/config.json",
        hint="The file is not a decoder's config as save_pretrained writes it.",
        name=str(doc["model_type"]),
    )
    rows = preset.vocab_size
    if data_vocab > rows:
        raise _error(
            directory,
            f"the data's tokenizer has {data_vocab:,} ids and the model's embedding "
            f"{rows:,} rows, so ids {rows:,} and up have no embedding. Prepare the data with "
            f"the model's own tokenizer: anneal data prepare --tokenizer {directory}.",
        )
    seq_len = model.seq_len or preset.seq_len
    _describe(directory, doc, preset, seq_len, recipe_preset=model.preset)
    init_from = {
        "path": str(directory.resolve()),
        "config_sha256": sha256_file(directory / "config.json"),
        "files": {p.name: sha256_file(p) for p in files},
        "tokenizer_sha256": _tokenizer_sha256(directory),
    }
    return dataclasses.replace(
        preset, seq_len=seq_len, hf_config=doc, init_from=init_from, nominal_params=None
    )


def _tokenizer_sha256(directory: Path) -> str | None:
    """``anneal.data.tokenizer.tokenizer_sha256`` of the directory, None without a tokenizer
    (``check_tokenizer`` refuses that once the data is known)."""
    from anneal.data.tokenizer import tokenizer_sha256

    if not any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        return None
    return tokenizer_sha256(directory)


def _rope_theta(doc: dict) -> float:
    rope = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    theta = doc.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None)
    return float(theta) if isinstance(theta, int | float) else 10000.0


def _describe(directory: Path, doc: dict, preset, seq_len: int, *, recipe_preset: str) -> None:
    original = preset.seq_len
    log.info(
        "model from --init-from %s: %s, hidden %d, %d layers, vocab %d, context %d; the "
        "recipe's preset %r is not used",
        directory,
        doc["model_type"],
        preset.hidden_size,
        preset.num_hidden_layers,
        preset.vocab_size,
        original,
        recipe_preset,
    )
    if seq_len > original:
        rope = doc.get("rope_parameters") or doc.get("rope_scaling")
        log.warning(
            "model.seq_len %d is longer than the checkpoint's max_position_embeddings %d: "
            "positions past %d were never trained, and RoPE is used as config.json sets it "
            "(theta %g, %s), not rescaled. To extend the context, set rope scaling in %s "
            "(e.g. rope_type yarn or a larger rope_theta, as Code Llama and Llama 3.1 did) "
            "and train on long documents.",
            seq_len,
            original,
            original,
            preset.rope_theta,
            rope or "no scaling",
            directory / "config.json",
        )


# --- the tokenizer ---------------------------------------------------------------------------


def check_tokenizer(preset: modellib.ModelPreset, *, meta: dict, data_dir: Path) -> None:
    """The data must be tokenized with the model's own tokenizer: the data's
    ``tokenizer_sha256`` is that of the tokenizer files in the model directory, or of what
    ``anneal data prepare --tokenizer DIR`` installs from them. UserError before any weight is
    read."""
    from anneal.data.tokenizer import tokenizer_sha256
    from anneal.data.tokenizer_hf import installed_sha256

    directory = Path(preset.init_from["path"])
    fix = (
        f"Prepare the data with the model's tokenizer: anneal data prepare --tokenizer {directory}"
    )
    if not any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise _error(
            directory,
            f"holds no tokenizer (tokenizer.json or tokenizer.model), so --data {data_dir} "
            f"cannot be checked against the ids the model learned. Copy the release's "
            f"tokenizer files into it; then {fix[0].lower()}{fix[1:]}.",
        )
    want = meta.get("tokenizer_sha256")
    if want == tokenizer_sha256(directory) or want == installed_sha256(directory):
        return
    raise _error(
        directory,
        f"its tokenizer is not the one --data {data_dir} was prepared with (that data's "
        f"tokenizer has {meta.get('vocab_size')} ids, sha256 {str(want)[:12]}...): the "
        f"same token ids would mean other text to the model. {fix} --out NEW.",
    )
