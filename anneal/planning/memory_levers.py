"""Levers: what to change for a run that does not fit in GPU memory, in order of preference:
first what costs nothing (the chunked loss, when the plain one is selected), then what costs no
quality (micro-batch, with more accumulation; for a sparse model, expert parallelism, which
spreads the experts over more GPUs for two all-to-alls of the routed tokens per layer), then
context, then tensor parallelism (it
shards the layers' matrices and activations over the GPUs of a node, and costs communication),
then Ulysses sequence parallelism (it splits every sequence's activations and logits over the
GPUs of a node, not the weights, for two all-to-alls per layer), then model shape. Each lever
but the loss is the largest setting that fits by ``anneal.planning.memory.estimate``, found by
bisection, since the estimate grows with each of them.
"""

from __future__ import annotations

import dataclasses
import math

from anneal.hardware import GiB
from anneal.model import ModelPreset
from anneal.model.layout_rules import SP_REDUCE_SCATTER, SP_WINDOW, expert_degrees
from anneal.planning.memory import Workload, ZeroSetup, estimate
from anneal.planning.memory_layout import accepts, refused_by

_SPARSE = "not with a sparse model (Anneal runs experts with EP and data parallelism only)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lever:
    name: str
    """chunked loss | micro-batch | expert parallel | context length | tensor parallel |
    sequence parallel | layers | width"""
    setting: str | None
    """The largest value that fits, as the flag or key to set; None when nothing does."""
    total: int | None
    """Peak bytes per GPU at that setting."""
    note: str = ""


def _largest(lo: int, hi: int, fits) -> int | None:
    """Largest x in [lo, hi] with fits(x), for fits monotone (true up to some x)."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def levers(
    preset: ModelPreset, zero: ZeroSetup, work: Workload, *, capacity: int, runtime_bytes: int
) -> list[Lever]:
    """Each lever alone, from the given setup: the chunked loss (under the plain one),
    micro-batch, expert parallelism (a sparse model), context length, tensor parallelism,
    sequence parallelism, layers, width."""

    def total(p: ModelPreset, w: Workload) -> int:
        return estimate(p, zero, w, capacity=capacity, runtime_bytes=runtime_bytes).total

    out = [_chunked_loss(preset, work, total, capacity)] if work.loss == "plain" else []
    b = _largest(
        1, work.micro_batch - 1, lambda x: total(preset, _w(work, micro_batch=x)) <= capacity
    )
    out.append(
        Lever(
            name="micro-batch",
            setting=None
            if b is None
            else f"train_micro_batch_size_per_gpu {b} (raise "
            f"gradient_accumulation_steps x{work.micro_batch / b:g} to keep the global batch)",
            total=None if b is None else total(preset, _w(work, micro_batch=b)),
            note="" if b else "even micro-batch 1 does not fit",
        )
    )
    if preset.is_moe:
        out.append(_expert_parallel(preset, work, total, capacity))
    out.append(_context_length(preset, work, total, capacity))
    out.append(_tensor_parallel(preset, zero, work, total, capacity))
    out.append(_sequence_parallel(preset, zero, work, total, capacity))
    n_layers = _largest(
        1,
        preset.num_hidden_layers - 1,
        lambda x: total(dataclasses.replace(preset, num_hidden_layers=x), work) <= capacity,
    )
    out.append(
        Lever(
            name="layers",
            setting=None if n_layers is None else f"model.num_hidden_layers={n_layers}",
            total=None
            if n_layers is None
            else total(dataclasses.replace(preset, num_hidden_layers=n_layers), work),
            note="" if n_layers else "even one layer does not fit",
        )
    )
    unit = math.lcm(64, preset.num_attention_heads)

    def narrower(k: int) -> ModelPreset:
        h = k * unit
        f = max(64, round(preset.intermediate_size * h / preset.hidden_size / 64) * 64)
        moe = preset.moe
        if moe is not None:  # the experts narrow in proportion
            width = max(64, round(moe.expert_intermediate_size * h / preset.hidden_size / 64) * 64)
            moe = dataclasses.replace(moe, expert_intermediate_size=width)
        return dataclasses.replace(preset, hidden_size=h, intermediate_size=f, moe=moe)

    k = _largest(
        1, (preset.hidden_size - 1) // unit, lambda x: total(narrower(x), work) <= capacity
    )
    out.append(
        Lever(
            name="width",
            setting=None if k is None else _width_setting(narrower(k)),
            total=None if k is None else total(narrower(k), work),
            note="" if k else f"even hidden size {unit} does not fit",
        )
    )
    return out


def _context_length(preset: ModelPreset, work: Workload, total, capacity: int) -> Lever:
    """The longest context, in steps of 128 tokens, that fits."""
    step = 128 if work.seq_len > 128 else 1
    t = _largest(
        1,
        (work.seq_len - 1) // step,
        lambda x: total(preset, _w(work, seq_len=x * step)) <= capacity,
    )
    return Lever(
        name="context length",
        setting=None if t is None else f"model.seq_len={t * step}",
        total=None if t is None else total(preset, _w(work, seq_len=t * step)),
        note="" if t else f"even {step} tokens do not fit",
    )


def _width_setting(p: ModelPreset) -> str:
    if p.moe is not None:
        return (
            f"model.hidden_size={p.hidden_size} "
            f"model.moe.expert_intermediate_size={p.moe.expert_intermediate_size}"
        )
    return f"model.hidden_size={p.hidden_size} model.intermediate_size={p.intermediate_size}"


def _expert_parallel(preset: ModelPreset, work: Workload, total, capacity: int) -> Lever:
    """The smallest expert-parallel degree above the current one that AutoEP accepts (it divides
    the experts of a layer and the GPUs: ``layout_rules.expert_degrees``) and fits."""
    name = "expert parallel"
    degrees = [d for d in expert_degrees(preset, work.n_gpus) if d > work.ep]
    for d in degrees:
        fitting = total(preset, _w(work, ep=d))
        if fitting <= capacity:
            setting = f"--set ds.expert_parallel.autoep_size={d}"
            return Lever(name=name, setting=setting, total=fitting)
    tried = ", ".join(map(str, degrees))
    return Lever(
        name=name,
        setting=None,
        total=None,
        note=f"autoep_size {tried} does not fit"
        if degrees
        else f"no degree above {work.ep} divides the experts and the {work.n_gpus} GPUs",
    )


def _chunked_loss(preset: ModelPreset, work: Workload, total, capacity: int) -> Lever:
    """The chunked loss in place of the plain one: it costs nothing."""
    chunked = total(preset, _w(work, loss="chunked"))
    saves, fits = (total(preset, work) - chunked) / GiB, chunked <= capacity
    return Lever(
        name="chunked loss",
        setting=f"train.loss=chunked (saves {saves:.2f} GiB)" if fits else None,
        total=chunked if fits else None,
        note="" if fits else f"train.loss=chunked saves {saves:.2f} GiB, not enough alone",
    )


def _tensor_parallel(
    preset: ModelPreset, zero: ZeroSetup, work: Workload, total, capacity: int
) -> Lever:
    """The smallest power-of-2 tensor-parallel degree above the current one, up to 8 (one node),
    that the layout rules accept (it divides the head counts and the GPUs: ``memory_layout``)
    and fits; none under SP (Anneal runs them apart) or for a sparse model."""
    if preset.is_moe:
        return Lever(name="tensor parallel", setting=None, total=None, note=_SPARSE)
    if work.sp > 1:
        return Lever(name="tensor parallel", setting=None, total=None, note="not with SP")
    degrees = [t for t in (2, 4, 8) if t > work.tp and accepts(preset, zero, _w(work, tp=t))]
    for t in degrees:
        fitting = total(preset, _w(work, tp=t))
        if fitting <= capacity:
            return Lever(
                name="tensor parallel",
                setting=f"--set ds.tensor_parallel.autotp_size={t}",
                total=fitting,
            )
    tried = ", ".join(map(str, degrees))
    return Lever(
        name="tensor parallel",
        setting=None,
        total=None,
        note=f"autotp_size {tried} does not fit"
        if degrees
        else f"no degree up to 8 divides the heads and the {work.n_gpus} GPUs",
    )


def _sequence_parallel(
    preset: ModelPreset, zero: ZeroSetup, work: Workload, total, capacity: int
) -> Lever:
    """The smallest power-of-2 Ulysses degree above the current one, up to 8 (one node), that
    the layout rules accept (it divides the head counts, the sequence and the GPUs, and more:
    ``memory_layout``) and fits; none where Anneal would refuse Ulysses at any degree (with TP,
    below ZeRO-2, eager attention, a sparse model)."""
    name = "sequence parallel"
    if preset.is_moe:
        return Lever(name=name, setting=None, total=None, note=_SPARSE)
    if work.tp > 1 or zero.stage < 2 or work.eager_attention:
        why = "not with TP" if work.tp > 1 else "needs ZeRO-2 or 3 and SDPA attention"
        return Lever(name=name, setting=None, total=None, note=why)
    rule = refused_by(preset, zero, _w(work, sp=2))
    if rule in _NO_ULYSSES:
        return Lever(name=name, setting=None, total=None, note=_NO_ULYSSES[rule])
    degrees = [s for s in (2, 4, 8) if s > work.sp and accepts(preset, zero, _w(work, sp=s))]
    for s in degrees:
        fitting = total(preset, _w(work, sp=s))
        if fitting <= capacity:
            return Lever(name=name, setting=f"--set ds.sequence_parallel_size={s}", total=fitting)
    tried = ", ".join(map(str, degrees))
    return Lever(
        name=name,
        setting=None,
        total=None,
        note=f"sequence_parallel_size {tried} does not fit"
        if degrees
        else f"no degree up to 8 divides the heads, the sequence and the {work.n_gpus} GPUs",
    )


_NO_ULYSSES = {
    SP_REDUCE_SCATTER: "needs zero_optimization.reduce_scatter at ZeRO-3",
    SP_WINDOW: "not on a sliding attention window",
}
"""The rules that refuse Ulysses at every degree, and the lever's note for each."""


def _w(work: Workload, **changes) -> Workload:
    return dataclasses.replace(work, **changes)
