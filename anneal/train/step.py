"""One optimizer step (docs/training.md, "One optimizer step"): zero grads (DeepSpeed sets them
to None after each step) -> forward (bf16 when the ds_config enables it) -> cross-entropy on next
tokens -> backward (DeepSpeed divides the loss by the accumulation steps and reduces gradients
only at the boundary) -> global L2 clip to ``gradient_clipping`` -> AdamW with decoupled decay on
2-D+ weights -> the LR schedule's step (warmup-cosine or WSD). And validation on the fixed
held-out windows.

Nothing here is there for tests: fault injection (``anneal.resilience.faults``) wraps
``train_step`` from outside, through its ``stream`` and ``loss_fn`` arguments. The loss itself
(chunked, or plain over the full logits: ``train.loss``) lives in ``anneal.train.loss``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import numpy as np
import torch
import torch.distributed as dist

from anneal.data.documents import document_positions
from anneal.data.stream import PackedSplit, TokenStream, validation_windows
from anneal.dist import world_size
from anneal.hardware import GiB, peak_memory_bytes
from anneal.model import Attention, MoeShape
from anneal.resilience.preempt import Preemption
from anneal.resolution.resolve import Launch
from anneal.train import experts, loss, sequence
from anneal.train.engine import data_replica
from anneal.train.loss import next_token_loss


@dataclasses.dataclass
class TrainState:
    """Everything that advances during training besides the engine's own state."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepShape:
    """What one optimizer step takes of the launch (``StepShape.of``)."""

    grad_accum: int
    """Micro-batches per optimizer step (``gradient_accumulation_steps``)."""
    tokens_per_step: int
    """Tokens of one optimizer step over all data-parallel replicas: ``Launch.tokens_per_step``,
    the one definition."""
    memory_per_rank: bool = False
    """``train.memory_per_rank``: every rank's memory in the row too (``memory_fields``)."""
    moe: MoeShape | None = None
    """A sparse model's shape (its router's loss weights; ``anneal.train.experts``)."""
    attention: Attention = Attention()
    """The launch's attention: with ``data.document_mask``, the positions of the documents
    (``model_inputs``)."""

    @classmethod
    def of(cls, launch: Launch) -> StepShape:
        return cls(
            grad_accum=launch.grad_accum,
            tokens_per_step=launch.tokens_per_step,
            memory_per_rank=launch.cfg.train.memory_per_rank,
            moe=launch.preset.moe,
            attention=launch.attention,
        )


def _step_collective(
    step_loss: torch.Tensor,
    device: torch.device,
    preemption: Preemption | None,
    *,
    memory_per_rank: bool = False,
    extra: torch.Tensor | None = None,
) -> tuple[float, dict, bool, list[float]]:
    """The one collective (and the one host sync) of a step, on every rank: this rank's mean
    loss, its memory and whether it got a preemption signal, gathered from all ranks, and
    ``extra`` (a sparse model's router sums: ``RouterStats.vector``). Returns the mean loss over
    ranks, the memory fields of the row, whether any rank was signalled, and ``extra`` summed
    over ranks ([] without it).
    """
    flag = float(preemption is not None and preemption.signalled)
    # the device's peak since the previous step; the host's since the process began (its reset
    # would hide the process's peak from the parent that waits on it: anneal.hardware)
    mem = float(peak_memory_bytes(device, reset=device.type == "cuda"))
    mine = torch.stack(
        [
            step_loss.to(torch.float64),
            torch.tensor(mem, dtype=torch.float64, device=device),
            torch.tensor(flag, dtype=torch.float64, device=device),
        ]
    )
    if extra is not None:
        mine = torch.cat([mine, extra])
    width = mine.numel()
    if world_size() > 1:
        parts = [torch.empty_like(mine) for _ in range(world_size())]
        dist.all_gather(parts, mine)
        mine = torch.stack(parts)
    # With tensor parallelism each replica's loss comes once per rank of its group, all equal,
    # and with sequence parallelism once per slice, each over as many tokens, so the mean over
    # ranks is still the mean over data-parallel replicas.
    rows = mine.view(-1, width).tolist()
    memory = memory_fields([r[1] for r in rows], per_rank=memory_per_rank)
    loss_mean = sum(r[0] for r in rows) / len(rows)
    summed = [sum(col) for col in zip(*(r[3:] for r in rows), strict=True)]
    return loss_mean, memory, any(r[2] > 0 for r in rows), summed


def memory_fields(per_rank_bytes: list[float], *, per_rank: bool = False) -> dict:
    """The memory of a train row, from each rank's bytes: the smallest and the largest in GiB
    and the rank of the largest, so a row has the same size at any number of ranks; with
    ``per_rank`` (``train.memory_per_rank``) also every rank's, ``mem_gib``."""
    gib = [round(b / GiB, 4) for b in per_rank_bytes]
    top = max(range(len(gib)), key=gib.__getitem__)
    fields = {"mem_min_gib": min(gib), "mem_max_gib": gib[top], "mem_max_rank": top}
    return fields | {"mem_gib": gib} if per_rank else fields


def model_inputs(
    engine, x: torch.Tensor, y: torch.Tensor, attention: Attention | None
) -> tuple[dict, torch.Tensor]:
    """(the engine's keyword inputs, the targets) of a micro-batch x, y (B, T): with
    ``data.document_mask`` the position ids of its documents (``anneal.data.documents``), the
    rows made one where the kernel reads documents only so (``Attention.flat_batch``); under
    Ulysses this rank's slice of each (``anneal.train.sequence.shard``). Without masking the
    inputs are what Anneal always gave the model."""
    if attention is None or not attention.document_mask:
        return sequence.shard(engine, x, y)
    positions = document_positions(x, attention.eos_id)
    if attention.flat_batch:  # (1, B x T): each row starts a document at position 0
        x, y, positions = x.reshape(1, -1), y.reshape(1, -1), positions.reshape(1, -1)
    return sequence.shard(engine, x, y, positions)


def train_step(
    engine,
    stream: TokenStream,
    state: TrainState,
    shape: StepShape,
    preemption: Preemption | None = None,
    loss_fn=next_token_loss,
) -> dict:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches; advances ``state``
    and returns the step's train row. ``shape``: what the step takes of the launch.
    ``preemption``: the run's ``Preemption``; this step's collective sets its
    ``requested_by_any`` on every rank. ``loss_fn(output, targets)``: the loss of one
    micro-batch from the model's output (its logits, or the loss its chunked head computed).

    The micro-batch losses stay on the device and are read once, at the end of the step, in
    the step's one collective (``_step_collective``)."""
    start = time.perf_counter()
    device = engine.device
    lr = engine.get_lr()[0]  # the LR this step applies
    loss_sum, wait_s = torch.zeros((), dtype=torch.float64, device=device), 0.0
    router = experts.RouterStats.of(engine, shape.moe)  # None for a dense model
    for i in range(shape.grad_accum):
        if preemption is not None:  # one process, signalled: StopMidStep (resilience.preempt)
            preemption.micro_batch_boundary(state.step, i, shape.grad_accum)
        t0 = time.perf_counter()
        x, y = stream.next_batch()
        wait_s += time.perf_counter() - t0
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        inputs, y = model_inputs(engine, x, y, shape.attention)  # Ulysses: this rank's slice
        if router is not None:
            router.before_forward()
        with loss.targets(engine.module, y):  # train.loss=chunked: no full logits
            output = engine(**inputs)
            micro_loss = loss_fn(output.logits, y)
        # a sparse model adds its router's losses to the objective (not to the row's loss)
        objective = micro_loss if router is None else router.objective(output, micro_loss)
        # scales by 1/accumulation; reduces only at the boundary (Ulysses: this slice's share)
        engine.backward(objective * sequence.loss_share(engine))
        engine.step()  # at the boundary: clip, AdamW, LR step, zero grads
        loss_sum += micro_loss.detach()
    loss_mean, memory, preempt, summed = _step_collective(
        loss_sum / shape.grad_accum,
        device,
        preemption,
        memory_per_rank=shape.memory_per_rank,
        extra=None if router is None else router.vector(),
    )
    state.step += 1
    if preemption is not None:
        preemption.requested_by_any = preempt
        preemption.step_done(state.step, shape.grad_accum)
    state.tokens += shape.tokens_per_step
    grad_norm = engine.get_global_grad_norm()
    elapsed = time.perf_counter() - start
    return {
        "kind": "train",
        "step": state.step,
        "tokens": state.tokens,
        "loss": loss_mean,
        "lr": lr,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "tokens_per_s": shape.tokens_per_step / elapsed,
        "data_wait_s": round(wait_s, 6),
        "data_wait_share": round(wait_s / elapsed, 6),  # of step time; prefetch keeps it < 1%
        **memory,
        **({} if router is None else router.row(summed, world_size())),
        "time": round(time.time(), 3),  # wall clock at the end of the step
    }


@torch.no_grad()
def validate(
    engine,
    val: PackedSplit,
    token_bytes: np.ndarray,
    *,
    n_samples: int,
    micro_batch: int,
    attention: Attention | None = None,
) -> dict:
    """Loss on ``n_samples`` fixed held-out windows (chosen per source: ``validation_windows``),
    ``micro_batch`` at a time; bits per UTF-8 byte so tokenizers compare. With more than one
    source the row adds each source's ``val_loss/<key>`` and ``val_bpb/<key>`` (``source_keys``;
    sources without a window left out). ``attention``: the run's, so that validation masks
    the documents as training does (``model_inputs``)."""
    engine.eval()
    device = engine.device
    byte_table = torch.from_numpy(token_bytes).to(device, torch.float64)
    sums = torch.zeros(len(val.source_windows), 3, dtype=torch.float64, device=device)
    dp_rank, dp_size = data_replica(engine)  # a tensor-parallel group reads as one
    for windows in validation_windows(
        val.n_windows,
        n_samples=n_samples,
        rank=dp_rank,
        world_size=dp_size,
        micro_batch=micro_batch,
        sources=val.source_windows,
    ):
        real = [max(j, 0) for j in windows]  # -1: padding, weight 0
        x, y = val.batch(real)
        x, y = x.to(device), y.to(device)
        inputs, y = model_inputs(engine, x, y, attention)  # Ulysses: each rank sums its slice
        weight = torch.tensor([float(j >= 0) for j in windows], dtype=torch.float64, device=device)
        with loss.targets(engine.module, y, per_token=True):
            nats = loss.token_nats(engine(**inputs).logits, y)
        nats, y = nats.reshape(len(windows), -1), y.reshape(len(windows), -1)  # (B, T): rows apart
        per_window = torch.stack(  # (B, 3): nats, tokens, bytes
            [nats.double().sum(1), torch.full_like(weight, y.size(1)), byte_table[y].sum(1)], 1
        )
        source = torch.from_numpy(val.source_of(real)).to(device)
        sums.index_add_(0, source, per_window * weight[:, None])  # (sources, 3)
    if world_size() > 1:  # a TP group's ranks add equal sums: their ratios stay the same
        dist.all_reduce(sums)
    engine.train()
    row = {"kind": "val", "step": 0, **_figures(*sums.sum(0).tolist())}
    if len(val.source_names) > 1:
        keys = source_keys(val.source_names)
        for key, source_sums in zip(keys, sums.tolist(), strict=True):
            if source_sums[1] > 0:  # tokens: a source without a val window has no figures
                f = _figures(*source_sums)
                row |= {f"val_loss/{key}": f["val_loss"], f"val_bpb/{key}": f["val_bpb"]}
    return row


def _figures(nats: float, tokens: float, n_bytes: float) -> dict:
    val_loss = nats / tokens
    return {
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss),
        "val_bpb": nats / math.log(2) / n_bytes,
    }


def source_keys(names: list[str]) -> list[str]:
    """Each source's name (meta.json) as the suffix of its validation keys and TensorBoard tags,
    one key per source, no two equal: characters other than letters, digits, ``.``, ``-`` and
    ``_`` become ``_``; names that then coincide get ``_<source index>`` appended, and again
    while that is another source's key (``a b.txt``, ``a_b.txt``, ``a_b.txt_1`` give
    ``a_b.txt_0``, ``a_b.txt_1_1``, ``a_b.txt_1``)."""
    cleaned = [re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_" for name in names]
    taken, keys = set(cleaned), []  # a name that stays as it is keeps its key
    for s, k in enumerate(cleaned):
        if cleaned.count(k) > 1:
            k = f"{k}_{s}"
            while k in taken:
                k = f"{k}_{s}"
            taken.add(k)
        keys.append(k)
    return keys
