"""Tensor-parallel checkpoints: AutoTP's per-rank slices merged back into whole matrices.

With ``tensor_parallel.autotp_size`` t, the ranks that hold tensor-parallel rank r's slices save
a ZeRO checkpoint of their own (model and optimizer states named by their tensor-parallel rank,
``anneal.resilience.ds_files.checkpoint_files``) whose ``param_shapes`` are the slice shapes.
DeepSpeed 0.19.8's AutoTP cuts a matrix into contiguous pieces in rank order
(``deepspeed/module_inject/layers.py``: ``LinearLayer`` splits the weight's dim 0 by
``get_shard_size_list`` and keeps piece ``tp_index``, ``LinearAllreduce`` dim 1), so
the whole matrix is the pieces concatenated in rank order along the dimension that was cut;
embeddings and norms are whole on every rank (the same values: their gradients are complete on
each rank of a group).

Two independent readers, as for ZeRO (``anneal.hf.zero``): ``open_tp_checkpoint`` (the lazy
reader the export writes from) finds the cut dimension by comparing each slice's shape with the
model's (``check_shapes`` then checks every merged shape), and ``reference_tp_state_dict`` (the
export's verification) cuts where the model's Hugging Face ``tp_plan`` says, as DeepSpeed reads
it (``_get_hf_tp_plan`` and ``TPPlanConverter``): column-wise on dim 0, row-wise on dim 1.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from anneal.errors import UserError
from anneal.hf.zero import TensorSource, ZeroCheckpoint, open_checkpoint, reference_state_dict
from anneal.resilience.ds_files import MODEL_STATES_PATTERN, checkpoint_files


@dataclasses.dataclass(frozen=True)
class MergedSource:
    """One parameter of a tensor-parallel checkpoint: its whole shape and the slices of the
    ranks, concatenated along ``dim`` in rank order (``dim`` None: whole on every rank, read
    from rank 0's). Loading holds the whole tensor and one slice."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[TensorSource, ...]
    dim: int | None

    def numel(self) -> int:
        return math.prod(self.shape)

    def load(self) -> torch.Tensor:
        if self.dim is None:
            return self.parts[0].load()
        out = torch.empty(self.shape, dtype=self.dtype)
        at = 0
        for part in self.parts:
            width = part.shape[self.dim]
            out.narrow(self.dim, at, width).copy_(part.load())
            at += width
        return out


def rank_files(tag_dir: Path, tp: int) -> list[tuple[list[Path], list[Path]]]:
    """``checkpoint_files`` of each tensor-parallel rank; UserError where one has none."""
    files = [checkpoint_files(tag_dir, r) for r in range(tp)]
    missing = [f"{r:02d}" for r, (model, _) in enumerate(files) if not model]
    if missing:
        raise UserError(
            f"{tag_dir}: its manifest says tensor-parallel degree {tp}, but there are no model "
            f"states of tensor-parallel rank(s) {', '.join(missing)} ({MODEL_STATES_PATTERN}): "
            f"the checkpoint is incomplete. Export another tag (--tag), or copy the "
            f"checkpoint again from where it was saved."
        )
    return files


def open_tp_checkpoint(tag_dir: Path, tp: int, shapes: dict[str, tuple[int, ...]]):
    """The checkpoint's parameters merged over its ``tp`` ranks' slices, ``shapes`` the whole
    model's (names as the model's). The returned checkpoint owns every rank's open files."""
    rank_files(tag_dir, tp)
    ranks: list[ZeroCheckpoint] = []
    try:
        for r in range(tp):
            ranks.append(open_checkpoint(tag_dir, r))
        sources = [_merge(tag_dir, name, ranks, shapes) for name in _names(tag_dir, ranks)]
    except BaseException:
        for c in ranks:
            c.close()
        raise
    first = ranks[0]
    return ZeroCheckpoint(
        tag_dir,
        first.zero_stage,
        first.world_size * tp,
        sources,
        [a for c in ranks for a in c.archives],
    )


def _names(tag_dir: Path, ranks: list[ZeroCheckpoint]) -> list[str]:
    names = [s.name for s in ranks[0].sources]
    for r, c in enumerate(ranks[1:], start=1):
        if [s.name for s in c.sources] != names:
            raise UserError(
                f"{tag_dir}: tensor-parallel rank {r:02d}'s files hold other parameters than "
                f"rank 00's: not a checkpoint that Anneal's training wrote. Export another tag "
                f"(--tag)."
            )
    return names


def _merge(tag_dir: Path, name: str, ranks: list[ZeroCheckpoint], shapes) -> MergedSource:
    """The slices of ``name`` and the one dimension along which they add up to the model's
    shape (none: whole on every rank). A shape that fits neither is left to ``check_shapes``
    (merged at rank 0's shape), which names the checkpoint and the model."""
    parts = tuple(next(s for s in c.sources if s.name == name) for c in ranks)
    first = parts[0]
    want = tuple(shapes.get(name, first.shape))
    if all(p.shape == want for p in parts):
        return MergedSource(name, want, first.dtype, parts, None)
    for dim in range(len(want)):
        rest = want[:dim] + want[dim + 1 :]
        if (
            all(
                len(p.shape) == len(want) and p.shape[:dim] + p.shape[dim + 1 :] == rest
                for p in parts
            )
            and sum(p.shape[dim] for p in parts) == want[dim]
        ):
            return MergedSource(name, want, first.dtype, parts, dim)
    return MergedSource(name, first.shape, first.dtype, parts, None)


def reference_tp_state_dict(
    tag_dir: Path, zero_stage: int, tp: int, model
) -> dict[str, torch.Tensor]:
    """The checkpoint's whole weights in fp32: each tensor-parallel rank's weights read as
    ``reference_state_dict`` reads a ZeRO checkpoint, then concatenated in rank order where
    ``model``'s Hugging Face tp_plan cuts them, as DeepSpeed's AutoTP reads that plan
    (column-wise: dim 0; row-wise: dim 1; anything else whole, rank 0's copy)."""
    cut = _plan_dims(model)
    per_rank = [reference_state_dict(tag_dir, zero_stage, r) for r in range(tp)]
    merged = {}
    for name, first in per_rank[0].items():
        dim = _plan_dim(cut, name)
        if dim is None:
            merged[name] = first
        else:
            merged[name] = torch.cat([sd[name] for sd in per_rank], dim=dim)
    return merged


def _plan_dim(cut, name: str) -> int | None:
    """The dimension the plan cuts parameter ``name`` along. DeepSpeed's specs name weights;
    a column-wise layer's bias is cut with its weight's rows (``LinearLayer`` splits both), a
    row-wise layer's bias is whole."""
    if name.endswith(".bias"):
        weight = name.removesuffix(".bias") + ".weight"
        return 0 if next((d for spec, d in cut if spec.matches(weight)), None) == 0 else None
    return next((d for spec, d in cut if spec.matches(name)), None)


def _plan_dims(model) -> list[tuple[object, int | None]]:
    """(DeepSpeed's layer spec, the dimension it cuts) for each entry of ``model``'s tp_plan, by
    DeepSpeed's own reading of it (``deepspeed.runtime.tensor_parallel.config._get_hf_tp_plan``,
    ``deepspeed.module_inject.tp_plan_converter.TPPlanConverter``)."""
    from deepspeed.module_inject.autotp_config import PartitionType
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    dims = {PartitionType.COLUMN: 0, PartitionType.ROW: 1}
    specs = TPPlanConverter.convert(_get_hf_tp_plan(model)) or []
    return [(spec, dims.get(spec.partition_type)) for spec in specs]
