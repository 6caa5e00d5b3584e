"""A sparse run's experts at ZeRO-3: DeepSpeed 0.19.8 AutoEP's ``"zero3_partitioned"`` format.

Under ZeRO-3 AutoEP writes no per-expert files (``anneal.hf.autoep`` reads those of ZeRO-0/1/2):
the experts live in each rank's files (``anneal.resilience.ds_files``) like every other weight.
Each rank's model states name, in ``ds_autoep_layers`` (one entry a layer), the experts it
holds, ``global_expert_start`` up to ``global_expert_end``, and its place
(``expert_data_parallel_rank``) in the expert-data-parallel group of the world / EP ranks that
hold those same experts. The grouped weights ``{prefix}.w1 [E_local, I, H]``, ``w2 [E_local, H,
I]`` and ``w3 [E_local, I, H]`` of every layer form their own ZeRO-3 sub-group, which the
optimizer file's ``ds_zero_partition_groups`` describes (family ``autoep_expert``, its
``partition_count``: that group's size, its ``partition_rank``: this rank's place in it). As for
any ZeRO-3 sub-group, the rank's fp32 flat group holds ``ceil(n / partition_count)`` elements of
each of its parameters, in order; the E_local experts of one expert-parallel rank are the
concatenation of those slices over its group's ranks, in partition order, cut to ``n``.

``expert_slices`` turns that metadata into where each layer's grouped weight lies;
``expert_sources`` reads the experts lazily from there for the export, ``reference_experts``
with ``torch.load(weights_only=True)`` for its verification.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from anneal.hf.expert_names import per_expert
from anneal.hf.reader import Archive
from anneal.hf.zero import (
    Piece,
    TensorSource,
    ZeroCheckpoint,
    cut_pieces,
    is_expert_group,
    load_weights_only,
)
from anneal.resilience.ds_files import LayoutError, checkpoint_files, zero3_rank_files

_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""AutoEP's grouped weight -> the name save_pretrained gives each expert's matrix."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """``count`` elements from ``start`` of rank ``rank``'s fp32 flat group ``group``."""

    rank: int
    group: int
    start: int
    count: int


@dataclasses.dataclass(frozen=True)
class GroupedWeight:
    """One layer's grouped weight (``w1``, ``w2`` or ``w3``) as one expert-parallel rank
    holds it: experts ``first`` to ``first + shape[0]``, its values the slices in order."""

    layer: dict
    weight: str
    first: int
    shape: tuple[int, ...]
    slices: tuple[Slice, ...]


def expert_slices(shapes, layers: list[list[dict]], groups: list[list[dict]]):
    """Where every layer's grouped weights lie: a ``GroupedWeight`` per layer, weight and
    expert-parallel rank. ``shapes``: the model states' ``param_shapes`` (the same on every
    rank); ``layers[r]``, ``groups[r]``: rank r's ``ds_autoep_layers`` and
    ``ds_zero_partition_groups``. LayoutError where they disagree or leave an expert out."""
    shapes = [shapes] if isinstance(shapes, dict) else shapes
    by_key = {layer["expert_key_prefix"]: i for i, layer in enumerate(layers[0])}
    found: dict[tuple[str, int], dict[int, Slice]] = {}
    info: dict[tuple[str, int], tuple] = {}
    for g, group in enumerate(shapes):
        if not is_expert_group(group):
            continue
        for r, (mine, parts) in enumerate(zip(layers, groups, strict=True)):
            count, place = parts[g]["partition_count"], parts[g]["partition_rank"]
            offset = 0
            for name, shape in group.items():
                prefix, weight = name.rsplit(".", 1)
                layer = mine[by_key[prefix]]
                if (
                    layer["expert_data_parallel_world_size"],
                    layer["expert_data_parallel_rank"],
                ) != (
                    count,
                    place,
                ):
                    raise LayoutError(
                        f"rank {r}'s expert group of {name} disagrees with its ZeRO group"
                    )
                n, first = math.prod(shape), int(layer["global_expert_start"])
                part = math.ceil(n / count)
                found.setdefault((name, first), {})[place] = Slice(r, g, offset, part)
                info[(name, first)] = (layers[0][by_key[prefix]], weight, tuple(shape), count)
                offset += part
    weights = []
    for key, placed in sorted(found.items()):
        layer, weight, shape, count = info[key]
        if sorted(placed) != list(range(count)):
            raise LayoutError(f"{key[0]} of experts from {key[1]} lacks a partition")
        weights.append(
            GroupedWeight(layer, weight, key[1], shape, tuple(placed[p] for p in range(count)))
        )
    _check_cover(weights, layers[0])
    return weights


def _check_cover(weights: list[GroupedWeight], layers: list[dict]) -> None:
    """Each layer's w1, w2 and w3 hold each of its experts exactly once."""
    for layer in layers:
        for weight in _NAMES:
            held = sorted(
                e
                for w in weights
                if w.layer["moe_layer_id"] == layer["moe_layer_id"] and w.weight == weight
                for e in range(w.first, w.first + w.shape[0])
            )
            if held != list(range(int(layer["num_experts"]))):
                raise LayoutError(f"{layer['module_path']}'s {weight} holds experts {held[:8]}")


def _rank_metadata(tag_dir: Path, optims: list[dict]):
    """(param_shapes, each rank's ds_autoep_layers, each rank's ds_zero_partition_groups),
    the model states read as lazy indexes, closed again."""
    files = zero3_rank_files(tag_dir)
    if len(files) != len(optims):
        raise LayoutError(f"{len(files)} model states file(s) for {len(optims)} ranks")
    layers, shapes = [], None
    for f in files:
        archive = Archive(f)
        try:
            index = archive.index()
        finally:
            archive.close()
        layers.append(index["ds_autoep_layers"])
        shapes = index["param_shapes"] if shapes is None else shapes
    return shapes, layers, [o["ds_zero_partition_groups"] for o in optims]


def expert_sources(ckpt: ZeroCheckpoint) -> list[TensorSource]:
    """Every layer's experts under the names save_pretrained writes
    (``anneal.hf.expert_names``), read lazily from the ranks' fp32 flat groups."""
    optims = [a.index()["optimizer_state_dict"] for a in ckpt.archives[1:]]
    weights = expert_slices(*_rank_metadata(ckpt.tag_dir, optims))
    flats = [list(o["fp32_flat_groups"]) for o in optims]
    sources = []
    for w in weights:
        pieces = [Piece(flats[s.rank][s.group], s.start, s.count) for s in w.slices]
        rows, dtype = math.prod(w.shape[1:]), flats[0][w.slices[0].group].dtype
        for j in range(w.shape[0]):
            name = per_expert(w.layer["expert_key_prefix"], w.first + j, _NAMES[w.weight])
            cut = tuple(cut_pieces(pieces, j * rows, rows, what="expert"))
            sources.append(TensorSource(name, w.shape[1:], dtype, cut))
    return sources


def reference_experts(tag_dir: Path) -> dict[str, torch.Tensor]:
    """``{prefix}.w1``, ``w2`` and ``w3`` of every layer with all its experts ``[E, ...]``,
    fp32, each rank's files read with ``torch.load(weights_only=True)``."""
    _, optim_files = checkpoint_files(tag_dir)
    optims = [load_weights_only(f)["optimizer_state_dict"] for f in optim_files]
    states = [load_weights_only(f) for f in zero3_rank_files(tag_dir)]
    weights = expert_slices(
        states[0]["param_shapes"],
        [s["ds_autoep_layers"] for s in states],
        [o["ds_zero_partition_groups"] for o in optims],
    )
    local: dict[str, dict[int, torch.Tensor]] = {}
    for w in weights:
        flat = torch.cat(
            [
                optims[s.rank]["fp32_flat_groups"][s.group][s.start : s.start + s.count]
                for s in w.slices
            ]
        )
        name = f"{w.layer['expert_key_prefix']}.{w.weight}"
        local.setdefault(name, {})[w.first] = flat[: math.prod(w.shape)].view(w.shape).float()
    return {name: torch.cat([held[f] for f in sorted(held)]) for name, held in local.items()}
