"""Hugging Face export of a ZeRO checkpoint (any stage), one tensor at a time, verified.

DeepSpeed's ``zero_to_fp32`` loads every rank's optimizer file (fp32 master weights plus both
Adam moments) before it writes anything: about 3x the fp32 model in memory, a terabyte for an
80B model (DeepSpeed PR #4025). Here the checkpoint files are opened, never loaded: their pickled
index is read with an unpickler that builds no tensors and imports nothing but a short list of
harmless names (``_LazyUnpickler``), and each parameter is then read with ``readinto`` straight
from the byte ranges that hold it (its ``ceil(n / world)`` slice on every rank under ZeRO-3; the
span of the concatenated rank partitions under ZeRO-1/2). Shards are written in the safetensors
format by streaming each tensor after a header computed from the shapes, so peak memory is about
one tensor (1.5 of it for bf16), whatever the model size. Exported weights never pass through
pickle.

The export then verifies itself: ``AutoModelForCausalLM`` and ``AutoTokenizer`` load the
directory; the tokenizer encodes a fixed text like the run's; and the logits on a fixed batch
match those of the training model (``anneal.model.build_model``) holding the weights that
DeepSpeed's own ``zero_to_fp32`` consolidates from the same checkpoint, an independent path.
That comparison runs in fp32 on both sides, the reference's weights rounded through the export
dtype first, so any difference is a layout bug and not bf16 rounding (which is reported apart).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pickle
import re
import secrets
import shutil
import struct
import time
import warnings
import zipfile
from pathlib import Path

import torch

from anneal import checkpoint, safeload
from anneal import model as modellib
from anneal.errors import UserError
from anneal.files import claim_output, replace_dir

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
# Logits of the exported model vs the reference (both in fp32, identical weights): any
# difference beyond float noise is a bug. Relative to max(1, largest |logit|).
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-4}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
)
VERIFY_TEXT = 'def greet(name):\n    """Say hello."""\n    return f"Hello, {name}!"\n'


# --- reading torch zip checkpoints without loading them --------------------------------------


@dataclasses.dataclass
class _LazyStorage:
    archive: _Archive
    key: str
    dtype: torch.dtype


@dataclasses.dataclass
class LazyTensor:
    """A tensor in a checkpoint file: where its bytes are, not the bytes."""

    storage: _LazyStorage
    offset: int
    """Storage offset in elements."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def read_into(self, out: torch.Tensor, start: int = 0) -> None:
        """Copy elements ``[start, start + out.numel())`` of this (contiguous, flattened)
        tensor into ``out`` (1-D, same dtype) with one read from the file."""
        if self.numel() > 1 and tuple(self.stride) != _contiguous_stride(self.shape):
            raise _unreadable(self.storage.archive.path, "it holds a non-contiguous tensor")
        assert out.dtype == self.dtype and out.dim() == 1 and start + out.numel() <= self.numel()
        itemsize = self.dtype.itemsize
        self.storage.archive.read_into(
            self.storage.key, (self.offset + start) * itemsize, out.view(torch.uint8)
        )

    def load(self) -> torch.Tensor:
        out = torch.empty(self.numel(), dtype=self.dtype)
        self.read_into(out)
        return out.view(self.shape)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


class _Opaque:
    """Stands in for any object the index holds that export does not need (numpy RNG state,
    argparse namespaces, ...): nothing of it is imported or run."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def _rebuild_tensor(storage, storage_offset, size, stride, *_):
    return LazyTensor(storage, storage_offset, tuple(size), tuple(stride))


def _rebuild_parameter(data, *_):
    return data


def _rebuild_from_type(func, _new_type, args, _state):
    return func(*args)


_SAFE_BUILTINS = {"set", "frozenset", "slice", "tuple", "list", "dict", "int", "float", "complex"}


class _LazyUnpickler(pickle.Unpickler):
    def __init__(self, file, archive: _Archive):
        super().__init__(file)
        self.archive = archive

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild_tensor
        if module == "torch._utils" and name.startswith("_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type
        if module == "torch" and (
            name.endswith("Storage")
            or name == "Size"
            or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        if module == "builtins" and name in _SAFE_BUILTINS:
            import builtins

            return getattr(builtins, name)
        if module.startswith("deepspeed.") and name.endswith("Enum"):  # e.g. ZeroStageEnum
            import enum
            import importlib

            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and issubclass(obj, enum.Enum):
                return obj
        return _Opaque

    def persistent_load(self, pid):
        typename, storage_type, key, _location, _numel = pid
        if typename != "storage" or not isinstance(storage_type, type):
            raise _unreadable(self.archive.path, f"an unknown persistent record {typename!r}")
        if storage_type is torch.UntypedStorage:
            dtype = torch.uint8
        else:
            with warnings.catch_warnings():  # TypedStorage classes are deprecated, still pickled
                warnings.simplefilter("ignore")
                dtype = storage_type.dtype
        return _LazyStorage(self.archive, str(key), dtype)


def _unreadable(path: Path, why: str) -> UserError:
    return UserError(
        f"{path}: {why}, so anneal export cannot read it: not a checkpoint that DeepSpeed wrote "
        f"for Anneal, or one changed after its manifest was written. Export another tag "
        f"(--tag), or copy the checkpoint again from where it was saved."
    )


class _Archive:
    """A ``torch.save`` zip file: its index unpickled lazily, its tensors read by offset."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (OSError, zipfile.BadZipFile) as e:
            raise _unreadable(self.path, f"not a torch zip file ({e})") from None
        names = self._zip.namelist()
        pkl = next((n for n in names if n.endswith("/data.pkl")), None)
        if pkl is None:
            raise _unreadable(self.path, "not a torch zip checkpoint (no data.pkl)")
        self.prefix = pkl[: -len("data.pkl")]
        self._offsets: dict[str, tuple[int, int]] = {}
        self._file = open(self.path, "rb")  # noqa: SIM115 - closed in close()

    def index(self):
        with self._zip.open(self.prefix + "data.pkl") as f:
            return _LazyUnpickler(f, self).load()

    def _data_offset(self, key: str) -> tuple[int, int]:
        if key not in self._offsets:
            try:
                info = self._zip.getinfo(f"{self.prefix}data/{key}")
            except KeyError:
                raise _unreadable(self.path, f"its index names a missing record {key!r}") from None
            if info.compress_type != zipfile.ZIP_STORED:
                raise _unreadable(self.path, "its tensor data is compressed")
            self._file.seek(info.header_offset)
            header = self._file.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            self._offsets[key] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
        return self._offsets[key]

    def read_into(self, key: str, byte_offset: int, out: torch.Tensor) -> None:
        start, size = self._data_offset(key)
        n = out.numel()
        if byte_offset + n > size:
            raise _unreadable(self.path, "a tensor runs past its storage record")
        self._file.seek(start + byte_offset)
        view = memoryview(out.numpy()).cast("B")
        got = self._file.readinto(view)
        if got != n:
            raise _unreadable(self.path, f"truncated ({got} of {n} bytes)")

    def close(self) -> None:
        self._file.close()
        self._zip.close()


# --- the ZeRO layouts --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Piece:
    tensor: LazyTensor
    start: int
    count: int


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """One parameter of the checkpoint: its name, shape and where its fp32 values are."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[_Piece, ...]
    """Read in order, concatenated: the parameter's flattened values (plus trailing padding)."""

    def numel(self) -> int:
        return math.prod(self.shape)

    def load(self) -> torch.Tensor:
        total = sum(p.count for p in self.pieces)
        buf = torch.empty(total, dtype=self.dtype)
        at = 0
        for p in self.pieces:
            p.tensor.read_into(buf[at : at + p.count], p.start)
            at += p.count
        return buf[: self.numel()].view(self.shape)


def _slices(flat: list[LazyTensor], start: int, count: int) -> list[_Piece]:
    """Elements ``[start, start + count)`` of the concatenation of ``flat`` as pieces."""
    pieces, base = [], 0
    for t in flat:
        n = t.numel()
        lo, hi = max(start, base), min(start + count, base + n)
        if lo < hi:
            pieces.append(_Piece(t, lo - base, hi - lo))
        base += n
    if sum(p.count for p in pieces) != count:
        raise _Layout("its flat groups are shorter than its parameter shapes")
    return pieces


_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


@dataclasses.dataclass
class ZeroCheckpoint:
    """The parameters of one checkpoint tag directory, readable one at a time."""

    tag_dir: Path
    zero_stage: int
    world_size: int
    sources: list[TensorSource]
    archives: list[_Archive]

    def close(self) -> None:
        for a in self.archives:
            a.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Layout(Exception):
    """The index of a checkpoint file is not laid out as DeepSpeed writes it."""


# What indexing a file that is not laid out as expected raises (a dict where a list was, ...).
_NOT_A_CHECKPOINT = (
    _Layout,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    ValueError,
    EOFError,
    pickle.UnpicklingError,
)


def checkpoint_files(tag_dir: Path) -> tuple[list[Path], list[Path]]:
    """The files export reads: the model states (one per rank under ZeRO-3) and the optimizer
    states of each rank, in rank order."""
    model_files = sorted(Path(tag_dir).glob("*model_states.pt"))
    optim_files = sorted(
        (f for f in Path(tag_dir).glob("*_optim_states.pt") if _RANK_FILE.search(f.name)),
        key=lambda f: int(_RANK_FILE.search(f.name).group(1)),
    )
    return model_files, optim_files


def open_checkpoint(tag_dir: Path) -> ZeroCheckpoint:
    """Index a DeepSpeed checkpoint tag directory without loading its tensors."""
    tag_dir = Path(tag_dir)
    model_files, optim_files = checkpoint_files(tag_dir)
    if not model_files:
        raise UserError(f"{tag_dir}: no DeepSpeed model_states file; not a checkpoint.")
    archives: list[_Archive] = []
    try:
        for f in [model_files[0], *optim_files]:
            archives.append(_Archive(f))
        stage, world, sources = _index(tag_dir, archives[0].index(), archives[1:])
    except _NOT_A_CHECKPOINT as e:
        for a in archives:
            a.close()
        raise UserError(
            f"{tag_dir}: its files are not laid out as a DeepSpeed ZeRO checkpoint ({e}); "
            f"anneal export reads the checkpoints that Anneal's training writes. Export "
            f"another tag (--tag), or copy the checkpoint again from where it was saved."
        ) from None
    except BaseException:
        for a in archives:
            a.close()
        raise
    return ZeroCheckpoint(tag_dir, stage, world, sources, archives)


def _index(tag_dir: Path, model_state, optim_archives: list[_Archive]):
    """(ZeRO stage, ranks, parameter sources) from the unpickled (lazy) indexes."""
    shapes = model_state.get("param_shapes")
    if isinstance(shapes, dict):
        shapes = [shapes]
    optims = [a.index()["optimizer_state_dict"] for a in optim_archives]
    stage = int(optims[0].get("zero_stage", 0)) if optims else 0
    if model_state.get("frozen_param_shapes"):
        raise UserError(
            f"{tag_dir}: the model has frozen parameters (frozen_param_shapes), which anneal "
            f"export does not convert; Anneal's training trains every parameter. Convert it "
            f"with DeepSpeed's own zero_to_fp32.py, and only if you trust where it came from."
        )
    sources: list[TensorSource] = []
    if stage in (1, 2, 3):
        count = optims[0]["partition_count"]
        world = max(count) if isinstance(count, list) else int(count)
        if world != len(optims):
            raise _Layout(f"{len(optims)} optimizer state file(s) for {world} ranks")
    if stage == 3:
        flats = [list(o["fp32_flat_groups"]) for o in optims]
        offset = 0
        for group in shapes:
            for name, shape in group.items():
                n = math.prod(shape)
                part = math.ceil(n / world)
                pieces = [p for r in range(world) for p in _slices(flats[r], offset, part)]
                sources.append(TensorSource(name, tuple(shape), flats[0][0].dtype, tuple(pieces)))
                offset += part
        if offset != sum(t.numel() for t in flats[0]):
            raise _Layout(f"its parameters take {offset} of {sum(t.numel() for t in flats[0])}")
    elif stage in (1, 2):
        paddings = optims[0].get("param_alignment_paddings")
        for g, group in enumerate(shapes):
            parts = [o["single_partition_of_fp32_groups"][g] for o in optims]
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                n = math.prod(shape)
                pieces = _slices(parts, offset, n)
                sources.append(TensorSource(name, tuple(shape), parts[0].dtype, tuple(pieces)))
                offset += n + (paddings[g][i] if paddings is not None else 0)
    elif stage == 0:  # no ZeRO: the module's own weights (bf16 runs: bf16 values)
        world = 1
        for name, t in model_state["module"].items():
            if isinstance(t, LazyTensor) and name not in model_state.get("buffer_names", []):
                sources.append(TensorSource(name, t.shape, t.dtype, (_Piece(t, 0, t.numel()),)))
    else:
        raise _Layout(f"ZeRO stage {stage}")
    module = model_state.get("module") or {}
    for name in model_state.get("buffer_names", []):
        t = module.get(name)
        if isinstance(t, LazyTensor):
            sources.append(TensorSource(name, t.shape, t.dtype, (_Piece(t, 0, t.numel()),)))
    by_name = {s.name: s for s in sources}
    for alias, target in (model_state.get("shared_params") or {}).items():
        if target not in by_name:
            raise _Layout(f"shared parameter {alias} names a missing {target}")
        sources.append(dataclasses.replace(by_name[target], name=alias))
    for s in sources:
        kinds = {p.tensor.dtype if isinstance(p.tensor, LazyTensor) else None for p in s.pieces}
        if kinds != {s.dtype}:
            raise _Layout(f"{s.name}'s pieces are not all {s.dtype} tensors")
    return stage, world, sources


# --- safetensors, streamed -------------------------------------------------------------------


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


def _proc_status(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Linux: reset VmHWM (the peak resident set) to the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# --- the run directory -----------------------------------------------------------------------
# A run directory and its checkpoints are read as input from elsewhere: --tag and every name in
# a manifest are confined (checkpoint.read_manifest), every file's bytes are checked against the
# manifest and every pickle scanned before anything of it is unpickled, and --out is claimed by
# the rule of anneal.files (docs/security.md).

_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MARKER = "anneal_export.json"


def _tags(ckpt_dir: Path) -> str:
    """The intact tags of ``ckpt_dir``, for a message (one whose manifest is refused is left
    out)."""
    names = []
    for p in sorted(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []:
        try:
            if p.is_dir() and not p.name.startswith(".") and checkpoint.is_intact(p):
                names.append(p.name)
        except UserError:
            pass
    return ", ".join(names) or "none"


def _select_checkpoint(run_dir: Path, tag: str | None) -> Path:
    ckpt_dir = run_dir / "checkpoints"
    if tag is None:  # a manifest that names a file outside its directory stops the search
        intact = checkpoint.intact_checkpoints(ckpt_dir)
        if not intact:
            raise UserError(
                f"{run_dir}: no intact checkpoint in {ckpt_dir} (a run writes one every "
                f"--save-every steps and at its last step). Train it first, or point at another "
                f"run directory."
            )
        return intact[-1]
    have = _tags(ckpt_dir)
    tag_dir = ckpt_dir / str(tag)
    if not _TAG.fullmatch(str(tag)):
        raise UserError(
            f"--tag {tag}: a tag is the name of one checkpoint directory of this run, such as "
            f"step00000300 (letters, digits, '.', '_', '-'; no '/' or '..'). Intact tags in "
            f"{ckpt_dir}: {have}."
        )
    if tag_dir.is_symlink() or not tag_dir.is_dir():
        raise UserError(
            f"--tag {tag}: no such checkpoint in {ckpt_dir}. Intact tags there: {have}."
        )
    if not checkpoint.is_intact(tag_dir):  # confines the manifest's names, or refuses
        raise UserError(
            f"--tag {tag}: not intact ({tag_dir / checkpoint.MANIFEST} missing or not a "
            f"manifest Anneal writes, or a file of the wrong size: a save that was "
            f"interrupted). Export another tag: {have}."
        )
    return tag_dir


def _run_config(run_dir: Path) -> dict:
    path = run_dir / "config.json"
    if not path.is_file():
        raise UserError(
            f"{run_dir}: no config.json; not an Anneal run directory (give the --out of a run)."
        )
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(
            f"{path}: not readable as JSON ({e}). A run writes it when it starts; give the "
            f"run directory whose config.json is intact, or restore this one."
        ) from None
    if not (isinstance(doc, dict) and isinstance(doc.get("model"), dict)):
        raise UserError(
            f"{path}: not a run's config.json (no 'model' section). Give the --out of a run."
        )
    return doc


_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "seq_len", "vocab_size")  # fmt: skip


def preset_from_config(doc: dict, path: Path | str = "config.json") -> modellib.ModelPreset:
    """The model of a run's ``config.json``; UserError naming the key when a size is not a
    positive integer or the heads do not divide."""
    fields = {f.name: f for f in dataclasses.fields(modellib.ModelPreset)}
    model = {k: v for k, v in doc["model"].items() if k in fields}
    model.setdefault("name", "run")
    model.setdefault("nominal_params", None)
    for key in _SIZES:
        v = model.get(key, fields[key].default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise UserError(
                f"{path}: model.{key} is {v!r}, not a positive integer. Give the config.json "
                f"of the run that wrote the checkpoint (a run writes it when it starts)."
            )
    heads, kv = model["num_attention_heads"], model["num_key_value_heads"]
    if model["hidden_size"] % heads or heads % kv:
        raise UserError(
            f"{path}: model.hidden_size {model['hidden_size']}, num_attention_heads {heads} and "
            f"num_key_value_heads {kv} do not divide. Give the run's own config.json."
        )
    return modellib.ModelPreset(**model)


def _tokenizer_dir(run_dir: Path, doc: dict, manifest: dict, tokenizer: Path | None) -> Path:
    from anneal.data.tokenizer import tokenizer_sha256

    data = doc.get("run", {}).get("data", {}) if isinstance(doc.get("run"), dict) else {}
    recorded = data.get("path") if isinstance(data, dict) else None
    if tokenizer is None and not isinstance(recorded, str):
        raise UserError(
            f"{run_dir / 'config.json'}: names no run.data.path, so the run's tokenizer is "
            f"unknown. Pass --tokenizer DIR (the prepared data directory the run trained on)."
        )
    source = Path(tokenizer) if tokenizer else Path(recorded)
    if not source.is_absolute() and not source.exists():
        source = run_dir / source
    if not (source / "tokenizer.json").is_file():
        raise UserError(
            f"{source}: no tokenizer.json, so the export cannot ship the run's tokenizer. "
            f"The run's data directory moved? Pass --tokenizer DIR (the prepared data "
            f"directory the run trained on)."
        )
    want = manifest.get("tokenizer_sha256")
    if want and tokenizer_sha256(source) != want:
        raise UserError(
            f"{source}: its tokenizer is not the one the checkpoint was trained with "
            f"({str(want)[:12]}...). Pass --tokenizer with the run's own prepared data "
            f"directory."
        )
    return source


def is_export(path: Path) -> bool:
    """A directory that ``anneal export`` wrote (its marker file), which --force may replace."""
    try:
        doc = json.loads((Path(path) / MARKER).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and "checkpoint" in doc


def _claim_out(out: Path, *, run_dir: Path, inputs: list[Path], force: bool, every: bool) -> None:
    """The rule of ``anneal.files.claim_output``, with the run's checkpoints/ and config.json
    and the tokenizer as inputs; inside the run directory only ``RUN/hf`` and below, the
    conventional place of its exports (``export_every_save``, ``train.export_every_save``).
    ``every``: ``out`` holds one export per tag and is added to, never replaced."""
    real_out, real_run = Path(os.path.realpath(out)), Path(os.path.realpath(run_dir))
    if real_out.is_relative_to(real_run) and not real_out.is_relative_to(real_run / "hf"):
        raise UserError(
            f"--out {out}: that is the run directory {run_dir} or lies inside it, and a run's "
            f"files are its own: an export goes under {run_dir / 'hf'} (e.g. "
            f"{run_dir / 'hf' / 'final'}) or outside the run."
        )
    inputs = [run_dir / "checkpoints", run_dir / "config.json", *inputs]
    if every:
        claim_output(out, in_place=True, what="exports", inputs=inputs)
    else:
        what = "model exported by anneal export"
        claim_output(out, force=force, made_by_us=is_export, what=what, inputs=inputs)


def check_checkpoint(tag_dir: Path, manifest: dict) -> None:
    """Before anything of ``tag_dir`` is unpickled: every file export reads is listed in the
    manifest, every listed file has the size and xxh3 hash recorded there (same-size bit rot
    included), and no pickle in it names a global outside ``anneal.safeload``'s allow-list."""
    model_files, optim_files = checkpoint_files(tag_dir)
    listed = set(manifest["files"])
    unlisted = [f.name for f in model_files + optim_files if f.name not in listed]
    if unlisted:
        raise UserError(
            f"{tag_dir}: {', '.join(unlisted)} not listed in its manifest.json, so its bytes "
            f"cannot be checked, and the checkpoint is not exported. Export another tag "
            f"(--tag), or copy the checkpoint again from where it was saved."
        )
    if not all(isinstance(e, dict) and checkpoint.HASH in e for e in manifest["files"].values()):
        log.warning("%s: its manifest holds no hashes (an older save); sizes checked only", tag_dir)
    bad = checkpoint.damaged_files(tag_dir)
    if bad:
        raise UserError(
            f"{tag_dir}: {len(bad)} file(s) differ from the sizes and xxh3 hashes in its "
            f"manifest.json ({', '.join(bad)}): bit rot, a torn copy or a change after the "
            f"save. Nothing was exported. Export an older tag (--tag; intact by size: "
            f"{_tags(tag_dir.parent)}), or copy the checkpoint again."
        )
    safeload.scan_checkpoint(tag_dir)


def _check_shapes(ckpt: ZeroCheckpoint, preset, config_path: Path) -> None:
    expected = _expected_shapes(preset)  # imports transformers before memory is measured
    got = {s.name: s.shape for s in ckpt.sources}
    if got != expected:
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        differ = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])[:3]
        raise UserError(
            f"{ckpt.tag_dir}: its parameters do not match the model in {config_path} (missing "
            f"{missing}, unexpected {extra}, other shapes {differ}): the checkpoint is another "
            f"run's, or config.json was edited. Export from the run directory that wrote it."
        )


def _partial_dir(out: Path) -> Path:
    """Where an export is written and verified before it replaces ``out``: a failed or
    interrupted export never leaves a half-written model under the name asked for. The name
    is new (process id and a random part), so nothing already there is touched; a killed
    export leaves its ``.NAME.partial-*`` beside ``out``, to be removed by hand."""
    partial = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        partial.mkdir(parents=True)
    except OSError as e:
        raise UserError(
            f"--out {out}: cannot create a directory beside it ({e.strerror or e}). Choose a "
            f"directory you can write to."
        ) from None
    return partial


def export(
    run_dir: Path,
    *,
    out: Path,
    tag: str | None = None,
    dtype: str = "bf16",
    shard_size: str = "5GB",
    force: bool = False,
    tokenizer: Path | None = None,
    verify: bool = True,
) -> dict:
    """Write a Hugging Face model directory from a run's checkpoint; return a report
    (checkpoint, files, bytes, peak memory of the conversion, verification numbers).

    Everything is checked before anything is written: the run's config.json, ``tag`` (one
    checkpoint of this run), the manifest (confined names), ``out`` (``_claim_out``), the
    checkpoint's bytes against its manifest and its pickles by ``anneal.safeload``. With
    ``force``, only an earlier export (its ``anneal_export.json``) or an empty directory is
    replaced, once the new one is verified."""
    run_dir, out = Path(run_dir), Path(out)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}.")
    shard_bytes = parse_size(shard_size)
    doc = _run_config(run_dir)
    preset = preset_from_config(doc, run_dir / "config.json")
    tag_dir = _select_checkpoint(run_dir, tag)
    manifest = checkpoint.read_manifest(tag_dir)
    tok_dir = _tokenizer_dir(run_dir, doc, manifest, tokenizer)
    _claim_out(out, run_dir=run_dir, inputs=[tok_dir], force=force, every=False)
    check_checkpoint(tag_dir, manifest)
    with open_checkpoint(tag_dir) as ckpt:
        _check_shapes(ckpt, preset, run_dir / "config.json")
        partial = _partial_dir(out)
        try:
            report = _convert(ckpt, partial, preset=preset, dtype=dtype, shard_bytes=shard_bytes,
                              tok_dir=tok_dir, manifest=manifest)  # fmt: skip
            report = {"run_dir": str(run_dir), **report, "out": str(out)}
            if verify:
                report["verify"] = verify_export(
                    partial, tag_dir=tag_dir, zero_stage=report["zero_stage"], preset=preset,
                    dtype=dtype, data_tokenizer=tok_dir,
                )  # fmt: skip
        except ExportMismatch as e:
            raise ExportMismatch(f"{e} The failed export is kept in {partial}.") from e
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    (partial / MARKER).write_text(json.dumps(report, indent=2) + "\n")
    replace_dir(partial, out)
    return report


def _convert(ckpt: ZeroCheckpoint, out: Path, *, preset, dtype: str, shard_bytes: int,
             tok_dir: Path, manifest: dict) -> dict:  # fmt: skip
    """Checkpoint -> safetensors + configs + tokenizer in ``out``, measuring peak memory."""
    torch_dtype = DTYPES[dtype]
    start = time.perf_counter()
    rss_before = _proc_status("VmRSS")
    peak_tracked = _reset_peak_rss()
    largest = max(s.numel() for s in ckpt.sources) * 4
    files = write_safetensors(ckpt.sources, out, dtype=torch_dtype, shard_bytes=shard_bytes)
    n_params = sum(s.numel() for s in ckpt.sources)
    peak = _proc_status("VmHWM") if peak_tracked else None
    convert_s = time.perf_counter() - start
    eos_id = _write_configs(out, preset, tok_dir, torch_dtype)
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
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": peak,
        "convert_s": round(convert_s, 3),
        "eos_token_id": eos_id,
    }


def _expected_shapes(preset) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = modellib.build_model(preset)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _write_configs(out: Path, preset, tok_dir: Path, torch_dtype) -> int | None:
    from transformers import GenerationConfig

    from anneal.data import tokenizer as toklib

    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, out / name)
    eos_id = toklib.load(tok_dir).eos_id
    config = modellib.llama_config(preset)
    config.eos_token_id = eos_id  # generation stops at the documents' separator
    config.architectures = ["LlamaForCausalLM"]
    config.use_cache = True
    config.dtype = torch_dtype
    config.save_pretrained(str(out))
    GenerationConfig(
        eos_token_id=eos_id, pad_token_id=eos_id, do_sample=True, temperature=0.8, top_k=50
    ).save_pretrained(str(out))
    return eos_id


# --- verification ----------------------------------------------------------------------------


class ExportMismatch(RuntimeError):
    """The exported model does not reproduce the checkpoint: a bug, never the user's doing."""


def _load_weights_only(path: Path) -> dict:
    """``torch.load(weights_only=True)``: tensors and the few types of ``anneal.safeload``'s
    allow-list are built, any other global is refused before it is imported."""
    try:
        with torch.serialization.safe_globals(safeload.safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{path}: torch.load(weights_only=True) refuses it ({first}); loading it otherwise "
            f"could run code, so it is not loaded. Export a checkpoint from a source you trust."
        ) from None


def _reference_state_dict(tag_dir: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in fp32, consolidated as DeepSpeed's ``zero_to_fp32`` does but
    read with ``torch.load(weights_only=True)``: an independent path to the lazy reader's, and
    one that never unpickles anything but tensors and plain types.

    ZeRO-1/2: each param group's fp32 partitions (``single_partition_of_fp32_groups``), one per
    rank, concatenated and cut in order of ``param_shapes`` with its alignment paddings. ZeRO-3:
    each rank's ``fp32_flat_groups`` concatenated; a parameter of ``n`` elements takes
    ``ceil(n / ranks)`` of every rank's, in order. No ZeRO: the module's own weights."""
    model_files, optim_files = checkpoint_files(tag_dir)
    model_state = _load_weights_only(model_files[0])
    module = model_state.get("module") or {}
    if zero_stage == 0:
        return {k: v.float() for k, v in module.items() if torch.is_tensor(v)}
    sd = {k: module[k].float() for k in model_state.get("buffer_names", []) if k in module}
    optims = [_load_weights_only(f)["optimizer_state_dict"] for f in optim_files]
    shapes = model_state["param_shapes"]
    shapes = [shapes] if isinstance(shapes, dict) else shapes
    world = len(optims)
    if zero_stage == 3:
        flat = [torch.cat([g.flatten() for g in o["fp32_flat_groups"]]) for o in optims]
        offset = 0
        for name, shape in ((n, s) for group in shapes for n, s in group.items()):
            n, part = math.prod(shape), math.ceil(math.prod(shape) / world)
            rows = torch.cat([f[offset : offset + part] for f in flat])
            sd[name] = rows[:n].view(tuple(shape)).float()
            offset += part
    else:
        paddings = optims[0].get("param_alignment_paddings")
        for g, group in enumerate(shapes):
            full = torch.cat([o["single_partition_of_fp32_groups"][g] for o in optims])
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                n = math.prod(shape)
                sd[name] = full[offset : offset + n].view(tuple(shape)).float()
                offset += n + (paddings[g][i] if paddings is not None else 0)
    for alias, target in (model_state.get("shared_params") or {}).items():
        if target in sd:
            sd[alias] = sd[target]
    return sd


def verify_batch(tokenizer, vocab_size: int, seq_len: int) -> torch.Tensor:
    """Two rows: a fixed text through the exported tokenizer, and fixed random ids."""
    t = min(seq_len, 64)
    ids = tokenizer(VERIFY_TEXT * 8, add_special_tokens=False)["input_ids"][:t]
    ids += [0] * (t - len(ids))
    g = torch.Generator().manual_seed(0)
    return torch.stack([torch.tensor(ids), torch.randint(0, vocab_size, (t,), generator=g)])


@torch.no_grad()
def verify_export(
    out: Path, *, tag_dir: Path, zero_stage: int, preset, dtype: str, data_tokenizer: Path
) -> dict:
    """Load ``out`` with transformers and compare with the checkpoint; ExportMismatch if not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anneal.data import tokenizer as toklib

    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(out))
    ours = toklib.load(data_tokenizer).encode_batch([VERIFY_TEXT])[0]
    theirs = tok(VERIFY_TEXT, add_special_tokens=False)["input_ids"]
    if ours != theirs:
        raise ExportMismatch(
            f"{out}: AutoTokenizer encodes the check text differently from the run's tokenizer "
            f"({theirs[:8]}... vs {ours[:8]}...)"
        )
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    manifest = checkpoint.read_manifest(tag_dir) or {}
    sd = _reference_state_dict(tag_dir, zero_stage)
    rounded = {k: v.to(DTYPES[dtype]).float() for k, v in sd.items()}
    ref = modellib.build_model(preset).eval()
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


def export_every_save(run_dir: Path, *, out: Path, force: bool = False, **kwargs) -> list[dict]:
    """Export every intact checkpoint of a run to ``out/<tag>``; tags already exported there
    (an ``anneal_export.json`` present) are skipped unless ``force``. ``out`` itself is only
    added to, and claimed as such: never ``.``, the run or an input."""
    run_dir, out = Path(run_dir), Path(out)
    _run_config(run_dir)
    tags = checkpoint.intact_checkpoints(run_dir / "checkpoints")
    if not tags:
        _select_checkpoint(run_dir, None)  # raises the no-checkpoint UserError
    _claim_out(out, run_dir=run_dir, inputs=[], force=True, every=True)
    reports = []
    for tag_dir in tags:
        dest = out / tag_dir.name
        if is_export(dest) and not force:
            continue
        reports.append(export(run_dir, out=dest, tag=tag_dir.name, force=True, **kwargs))
    return reports


def export_at_save(run_dir: Path, tag_dir: Path) -> dict | None:
    """``train.export_every_save``: export the checkpoint just written to ``RUN/hf/<tag>``
    (rank 0, after the save). A failure is logged, not raised: the run and its checkpoint are
    fine, and raising on one rank would leave the others waiting in a collective."""
    try:
        report = export(run_dir, out=Path(run_dir) / "hf" / tag_dir.name, tag=tag_dir.name,
                        force=True)  # fmt: skip
    except Exception:  # noqa: BLE001 - training goes on; the failure is logged in full
        log.exception("export of %s failed; training continues, the checkpoint is intact", tag_dir)
        return None
    log.info("%s", format_report(report))
    return report


def format_report(r: dict) -> str:
    gib = 2**30
    lines = [
        f"exported {r['checkpoint']} (step {r['step']}, ZeRO stage {r['zero_stage']}, "
        f"{r['world_size']} rank(s)) -> {r['out']}",
        f"  {r['params']:,} parameters as {r['dtype']} in {len(r['files'])} file(s); "
        f"conversion {r['convert_s']:.1f} s",
    ]
    if r.get("peak_rss_bytes") and r.get("rss_before_bytes"):
        grew = r["peak_rss_bytes"] - r["rss_before_bytes"]
        lines.append(
            f"  memory: peak RSS {r['peak_rss_bytes'] / gib:.2f} GiB, "
            f"{max(grew, 0) / gib:.3f} GiB above the process before conversion; model "
            f"{r['model_bytes_fp32'] / gib:.3f} GiB fp32, largest tensor "
            f"{r['largest_tensor_bytes_fp32'] / gib:.3f} GiB"
        )
    v = r.get("verify")
    if v:
        lines.append(
            f"  verified: transformers loads it; max |logit diff| {v['max_abs_logit_diff']:.3g} "
            f"(tolerance {v['tolerance']:.3g}); {r['dtype']} rounding moves logits by "
            f"{v['dtype_rounding_diff']:.3g}"
        )
    return "\n".join(lines)
