"""The ZeRO layouts: where each parameter's fp32 values lie in a DeepSpeed checkpoint.

ZeRO-3: a parameter of ``n`` elements takes ``ceil(n / world)`` of every rank's flat group of its
sub-group, in order (AutoEP's experts, partitioned over the ranks that hold them, are
``anneal.hf.autoep_zero3``'s). ZeRO-1/2: the rank partitions of each param group concatenated
hold the parameters in order, each followed by its alignment padding. No ZeRO (stage 0): the
module's own weights. ``open_checkpoint`` indexes these lazily (``anneal.hf.reader``);
``reference_state_dict`` builds the same weights independently, as DeepSpeed's ``zero_to_fp32``
does, through ``torch.load(weights_only=True)``, for the export's verification.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import re
from pathlib import Path

import torch

from anneal.errors import UserError
from anneal.hf.reader import Archive, LazyTensor
from anneal.resilience import ds_files, safeload
from anneal.resilience.ds_files import LayoutError, checkpoint_files


@dataclasses.dataclass(frozen=True)
class Piece:
    tensor: LazyTensor
    start: int
    count: int


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """One parameter of the checkpoint: its name, shape and where its fp32 values are."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
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


def cut_pieces(pieces: list[Piece], start: int, count: int, what: str = "parameter") -> list[Piece]:
    """Elements ``[start, start + count)`` of the concatenation of ``pieces``, as pieces."""
    cut, base = [], 0
    for p in pieces:
        lo, hi = max(start, base), min(start + count, base + p.count)
        if lo < hi:
            cut.append(Piece(p.tensor, p.start + lo - base, hi - lo))
        base += p.count
    if sum(p.count for p in cut) != count:
        raise LayoutError(f"its flat groups are shorter than its {what} shapes")
    return cut


def _slices(flat: list[LazyTensor], start: int, count: int) -> list[Piece]:
    """Elements ``[start, start + count)`` of the concatenation of ``flat`` as pieces."""
    return cut_pieces([Piece(t, 0, t.numel()) for t in flat], start, count)


EXPERT_PARAM = re.compile(r"\.experts\.w[123]$")
"""AutoEP's grouped expert weights (DeepSpeed's ``EXPERT_PARAMETER_PATTERNS``): their own
param groups in ZeRO-1/2, each rank holding its experts only; exported from the expert files."""


@dataclasses.dataclass
class ZeroCheckpoint:
    """The parameters of one checkpoint tag directory, readable one at a time."""

    tag_dir: Path
    zero_stage: int
    world_size: int
    sources: list[TensorSource]
    archives: list[Archive]

    def close(self) -> None:
        for a in self.archives:
            a.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# What indexing a file that is not laid out as expected raises (a dict where a list was, ...).
NOT_A_CHECKPOINT = (
    LayoutError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    ValueError,
    EOFError,
    pickle.UnpicklingError,
)


def is_expert_group(group: dict) -> bool:
    """Whether a ZeRO param group holds AutoEP's expert weights (DeepSpeed never mixes them
    with the others in one group)."""
    experts = [bool(EXPERT_PARAM.search(name)) for name in group]
    if any(experts) and not all(experts):
        raise LayoutError("a param group mixes expert and other parameters")
    return bool(experts) and all(experts)


def open_checkpoint(tag_dir: Path, mp_rank: int = 0) -> ZeroCheckpoint:
    """Index a DeepSpeed checkpoint tag directory (tensor-parallel rank ``mp_rank``'s files)
    without loading its tensors."""
    tag_dir = Path(tag_dir)
    model_files, optim_files = checkpoint_files(tag_dir, mp_rank)
    if not model_files:
        raise UserError(f"{tag_dir}: no DeepSpeed {ds_files.MODEL_STATES} file; not a checkpoint.")
    archives: list[Archive] = []
    try:
        for f in [model_files[0], *optim_files]:
            archives.append(Archive(f))
        stage, world, sources = _index(tag_dir, archives[0].index(), archives[1:])
    except NOT_A_CHECKPOINT as e:
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


def _index(tag_dir: Path, model_state, optim_archives: list[Archive]):
    """(ZeRO stage, ranks, parameter sources) from the unpickled (lazy) indexes."""
    shapes = model_state.get("param_shapes")
    if isinstance(shapes, dict):
        shapes = [shapes]
    optims = [a.index()["optimizer_state_dict"] for a in optim_archives]
    stage = ds_files.stage_of_optimizer(optims)
    if model_state.get("frozen_param_shapes"):
        raise UserError(
            f"{tag_dir}: the model has frozen parameters (frozen_param_shapes), which anneal "
            f"export does not convert; Anneal's training trains every parameter. Convert it "
            f"with DeepSpeed's own zero_to_fp32.py, and only if you trust where it came from."
        )
    if stage in (1, 2, 3):
        count = optims[0]["partition_count"]
        world = max(count) if isinstance(count, list) else int(count)
        if world != len(optims):
            raise LayoutError(f"{len(optims)} optimizer state file(s) for {world} ranks")
    if stage == 3:
        sources = _zero3_sources(shapes, optims, world)
    elif stage in (1, 2):
        sources = _zero12_sources(shapes, optims)
    elif stage == 0:  # no ZeRO: the module's own weights (bf16 runs: bf16 values)
        world, buffers = 1, model_state.get("buffer_names", [])
        sources = [
            TensorSource(name, t.shape, t.dtype, (Piece(t, 0, t.numel()),))
            for name, t in model_state["module"].items()
            if isinstance(t, LazyTensor) and name not in buffers
        ]
    else:
        raise LayoutError(f"ZeRO stage {stage}")
    return stage, world, _with_buffers_and_aliases(sources, model_state)


def _zero3_counts(optim: dict, groups: int, world: int) -> list[int]:
    """Each ZeRO-3 sub-group's partition count (``ds_zero_partition_groups``; all ``world``
    ranks where a checkpoint does not record them)."""
    parts = optim.get("ds_zero_partition_groups")
    if parts is None:
        return [world] * groups
    if len(parts) != groups:
        raise LayoutError(f"{len(parts)} partition groups for {groups} parameter groups")
    return [int(p["partition_count"]) for p in parts]


def _zero3_sources(shapes: list[dict], optims: list[dict], world: int) -> list[TensorSource]:
    """A parameter of ``n`` elements takes ``ceil(n / world)`` of every rank's flat group of
    its sub-group (one a param group, in order). AutoEP's experts, partitioned over fewer
    ranks, are read by ``anneal.hf.autoep_zero3``."""
    flats = [list(o["fp32_flat_groups"]) for o in optims]
    if len(flats[0]) != len(shapes):
        raise LayoutError(f"{len(flats[0])} flat groups for {len(shapes)} parameter groups")
    sources = []
    counts = _zero3_counts(optims[0], len(shapes), world)
    for g, (group, count) in enumerate(zip(shapes, counts, strict=True)):
        if is_expert_group(group):
            continue
        if count != world:
            raise LayoutError(f"parameter group {g} is partitioned over {count} of {world} ranks")
        offset = 0
        for name, shape in group.items():
            part = math.ceil(math.prod(shape) / world)
            pieces = [p for r in range(world) for p in _slices([flats[r][g]], offset, part)]
            sources.append(TensorSource(name, tuple(shape), flats[0][g].dtype, tuple(pieces)))
            offset += part
        if offset != flats[0][g].numel():
            raise LayoutError(f"its parameters take {offset} of {flats[0][g].numel()} in group {g}")
    return sources


def _zero12_sources(shapes: list[dict], optims: list[dict]) -> list[TensorSource]:
    """Each param group's rank partitions, concatenated, hold its parameters in order, each
    followed by its alignment padding."""
    paddings = optims[0].get("param_alignment_paddings")
    sources = []
    for g, group in enumerate(shapes):
        if is_expert_group(group):  # each rank's own experts: read from the expert files
            continue
        parts = [o["single_partition_of_fp32_groups"][g] for o in optims]
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            pieces = _slices(parts, offset, n)
            sources.append(TensorSource(name, tuple(shape), parts[0].dtype, tuple(pieces)))
            offset += n + (paddings[g][i] if paddings is not None else 0)
    return sources


def _with_buffers_and_aliases(sources: list[TensorSource], model_state) -> list[TensorSource]:
    """``sources`` plus the module's buffers and the tied parameters' second names; each
    source's pieces checked to be tensors of its dtype."""
    sources = list(sources)
    module = model_state.get("module") or {}
    for name in model_state.get("buffer_names", []):
        t = module.get(name)
        if isinstance(t, LazyTensor):
            sources.append(TensorSource(name, t.shape, t.dtype, (Piece(t, 0, t.numel()),)))
    by_name = {s.name: s for s in sources}
    for alias, target in (model_state.get("shared_params") or {}).items():
        if target not in by_name:
            raise LayoutError(f"shared parameter {alias} names a missing {target}")
        sources.append(dataclasses.replace(by_name[target], name=alias))
    for s in sources:
        kinds = {p.tensor.dtype if isinstance(p.tensor, LazyTensor) else None for p in s.pieces}
        if kinds != {s.dtype}:
            raise LayoutError(f"{s.name}'s pieces are not all {s.dtype} tensors")
    return sources


# --- safetensors, streamed -------------------------------------------------------------------


def load_weights_only(path: Path) -> dict:
    """``torch.load(weights_only=True)``: tensors and the few types of
    ``anneal.resilience.safeload``'s allow-list are built, any other global is refused before
    it is imported."""
    try:
        with torch.serialization.safe_globals(safeload.safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{path}: torch.load(weights_only=True) refuses it ({first}); loading it otherwise "
            f"could run code, so it is not loaded. Export a checkpoint from a source you trust."
        ) from None


def reference_state_dict(
    tag_dir: Path, zero_stage: int, mp_rank: int = 0
) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in fp32, consolidated as DeepSpeed's ``zero_to_fp32`` does but
    read with ``torch.load(weights_only=True)``: an independent path to the lazy reader's, and
    one that never unpickles anything but tensors and plain types.

    ZeRO-1/2: each param group's fp32 partitions (``single_partition_of_fp32_groups``), one per
    rank, concatenated and cut in order of ``param_shapes`` with its alignment paddings. ZeRO-3:
    each rank's ``fp32_flat_groups`` concatenated; a parameter of ``n`` elements takes
    ``ceil(n / ranks)`` of every rank's, in order. No ZeRO: the module's own weights. With
    tensor parallelism: tensor-parallel rank ``mp_rank``'s slices."""
    model_files, optim_files = checkpoint_files(tag_dir, mp_rank)
    model_state = load_weights_only(model_files[0])
    module = model_state.get("module") or {}
    if zero_stage == 0:
        return {k: v.float() for k, v in module.items() if torch.is_tensor(v)}
    sd = {k: module[k].float() for k in model_state.get("buffer_names", []) if k in module}
    optims = [load_weights_only(f)["optimizer_state_dict"] for f in optim_files]
    shapes = model_state["param_shapes"]
    shapes = [shapes] if isinstance(shapes, dict) else shapes
    world = len(optims)
    if zero_stage == 3:
        for g, group in enumerate(shapes):
            if is_expert_group(group):  # AutoEP's, over fewer ranks (anneal.hf.autoep_zero3)
                continue
            flat = [o["fp32_flat_groups"][g].flatten() for o in optims]
            offset = 0
            for name, shape in group.items():
                n, part = math.prod(shape), math.ceil(math.prod(shape) / world)
                rows = torch.cat([f[offset : offset + part] for f in flat])
                sd[name] = rows[:n].view(tuple(shape)).float()
                offset += part
    else:
        paddings = optims[0].get("param_alignment_paddings")
        for g, group in enumerate(shapes):
            if is_expert_group(group):  # the expert files' (anneal.hf.autoep)
                continue
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
