"""Per-GPU memory estimate of a training run: model states by ZeRO stage, activations, logits
(plain or chunked), working buffers; whether it fits; and the levers that make it fit.

Model states with mixed-precision Adam take 2 + 2 + 12 bytes per parameter: 16-bit weights,
16-bit gradients, and fp32 master weights with Adam's two moments (ZeRO paper, Rajbhandari et
al. 2020, section 3.1). With P parameters over n data-parallel GPUs (section 5)::

    stage 0:  16P            stage 2:  2P + 14P/n
    stage 1:  4P + 12P/n     stage 3:  16P/n

``offload_optimizer`` moves the 12 bytes of optimizer state to host memory; ``offload_param``
(stage 3) moves the weights as well. Without bf16 (fp32 training, as on CPUs) weights and
gradients take 4 bytes each and DeepSpeed still keeps a separate fp32 master copy: 4 + 4 + 12.

Activations, the logits and the loss are ``memory_activations`` (Korthikanti et al. 2022's
count of every tensor a layer keeps for backward).

A peak happens in one of two phases: forward/backward (activations, logits, communication
buffers) or the optimizer step (the fp32 gradient copy DeepSpeed makes for Adam). ``total``
lets the phases reuse each other's freed memory, as PyTorch's CUDA caching allocator does;
``total_stacked`` does not, which is how host RSS behaves (docs/planning.md has the CPU check).

What ``train.float8`` changes (casts in flight; at ZeRO-3 the gathered weights its layers
keep until backward) is ``float8_costs``. Tensor parallelism is ``memory_tp``, sequence
parallelism ``memory_sp``, a sparse model's experts under expert parallelism ``memory_ep`` (each
family of parameters partitioned over its own group); the layouts it refuses, as the launch
does, ``memory_layout``; the levers for a run that does not fit, ``memory_levers``; what
``anneal estimate`` reads and prints, ``memory_io``.
"""

from __future__ import annotations

import dataclasses
import math

from anneal.errors import UserError
from anneal.hardware import GiB
from anneal.model import ModelPreset, count_params  # noqa: F401 (memory.count_params)
from anneal.model.layout_rules import offloads
from anneal.model.muon import muon_shapes
from anneal.planning import float8_costs, memory_ep, memory_layout, memory_sp
from anneal.planning.float8_costs import FLOAT8_OFF, Float8Setting
from anneal.planning.memory_activations import (  # noqa: F401 (memory.saved_tensors, ...)
    activation_bytes,
    layer_activation_bytes,
    logits_bytes,
    saved_tensors,
)

DEFAULT_DS_CONFIG = "zero3_bf16.json"
"""The ds_config ``anneal estimate`` assumes when neither ``--ds-config`` nor a run's
config.json names one: ZeRO-3, the stage that lets the largest models fit."""
DEFAULT_SPARSE_DS_CONFIG = "zero2_bf16.json"
"""The one it assumes for a sparse model: ZeRO-2, the config the sparse recipes ship (ZeRO-3
runs too: ``--ds-config zero3_bf16.json``)."""

DEFAULT_NODES = 1
DEFAULT_GPUS_PER_NODE = 8
"""Nodes and GPUs per node ``anneal estimate`` assumes: one HGX/DGX node of 8 GPUs."""

GPU_RUNTIME_BYTES = 1 * GiB
"""CUDA context, cuBLAS/NCCL workspaces and allocator slack, an assumption (the context alone
is 0.3-0.6 GiB on H100s); fragmentation beyond it is not modelled."""

# DeepSpeed's defaults for the keys the estimate reads (deepspeed/runtime/zero/config.py).
DS_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "sub_group_size": 1_000_000_000,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroSetup:
    """The parts of a ds_config that decide memory."""

    stage: int
    bf16: bool = True
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = False
    reduce_bucket_size: int = DS_DEFAULTS["reduce_bucket_size"]
    """Gradient elements reduced per bucket."""
    allgather_bucket_size: int = DS_DEFAULTS["allgather_bucket_size"]
    """Elements per all-gather of updated weights (stages 1-2)."""
    prefetch_bucket_size: int = DS_DEFAULTS["stage3_prefetch_bucket_size"]
    """Elements of weights gathered ahead of use (stage 3)."""
    sub_group_size: int = DS_DEFAULTS["sub_group_size"]
    """Elements per optimizer sub-group (stage 3): the fp32 gradient copy is made per group."""
    torch_adam: bool = False
    """``optimizer.params.torch_adam``: torch's AdamW instead of DeepSpeed's fused one."""
    reduce_scatter: bool = True
    """``zero_optimization.reduce_scatter`` (DeepSpeed's default: on): Ulysses at ZeRO-3 needs
    it (``anneal.model.layout_rules``, as the launch checks)."""
    muon: bool = False
    """``optimizer.type`` Muon: its half keeps one momentum buffer where AdamW keeps two moments
    (``optimizer_bytes_per_param``)."""
    offload_section: bool = False
    """An ``offload_optimizer`` or ``offload_param`` section, whatever its device (``none``
    included): DeepSpeed's AutoEP takes either as offload (``layout_rules.offloads``)."""

    @classmethod
    def from_ds_config(cls, ds: dict) -> ZeroSetup:
        zero = ds.get("zero_optimization", {})
        stage = int(zero.get("stage", 0))
        offload_opt = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
        offload_par = zero.get("offload_param", {}).get("device", "none") in ("cpu", "nvme")
        return cls(
            stage=stage,
            bf16=bool(ds.get("bf16", {}).get("enabled", False))
            or bool(ds.get("fp16", {}).get("enabled", False)),
            offload_optimizer=offload_opt,
            offload_param=offload_par and stage == 3,
            overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
            torch_adam=bool(ds.get("optimizer", {}).get("params", {}).get("torch_adam", False)),
            reduce_scatter=bool(zero.get("reduce_scatter", True)),
            offload_section=offloads(ds),
            muon=ds.get("optimizer", {}).get("type", "").lower() == "muon",
            **{
                field: int(zero.get(key, DS_DEFAULTS[key]))
                for field, key in (
                    ("reduce_bucket_size", "reduce_bucket_size"),
                    ("allgather_bucket_size", "allgather_bucket_size"),
                    ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
                    ("sub_group_size", "sub_group_size"),
                )
            },
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    micro_batch: int
    """Sequences per GPU per forward pass (train_micro_batch_size_per_gpu)."""
    seq_len: int
    """Tokens per sequence."""
    n_gpus: int
    """GPUs (nodes x GPUs per node); ZeRO partitions over the n_gpus / tp data-parallel ones."""
    tp: int = 1  # tensor_parallel.autotp_size: anneal.planning.memory_tp
    sp: int = 1  # sequence_parallel_size (Ulysses; each rank holds seq / sp): memory_sp
    ep: int = 1  # expert_parallel.autoep_size (AutoEP; E / ep experts a rank): memory_ep
    activation_checkpointing: bool = False
    eager_attention: bool = False
    """Attention that keeps its a x s x s scores (Korthikanti's 5as/h); SDPA keeps none."""
    loss: str = "chunked"
    """``train.loss``: chunked (a chunk's logits at a time, the default) | plain (full logits)."""
    loss_chunk_tokens: int = 512
    """``train.loss_chunk_tokens`` (its default, as ``anneal.config.run.TrainConfig``)."""
    float8: Float8Setting = FLOAT8_OFF
    """``train.float8``, ``train.float8_layers`` and compiled or not (``float8_costs``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes on each GPU (``host_bytes``: on the host, per GPU, for offloaded state)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    buffers: dict[str, int]
    """Working buffers of forward/backward by name (gradient buckets, gathered weights)."""
    step_buffers: dict[str, int]
    """Working buffers of the optimizer step by name (the fp32 gradient copy)."""
    runtime: int
    host_bytes: int
    capacity: int | None = None
    snapshot_bytes: int = 0
    """Host bytes per GPU that ``train.async_save`` keeps for the run: the host copy of the
    rank's checkpoint its saves are written from (``snapshot_bytes``); not in ``total``."""

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def forward_backward(self) -> int:
        return self.activations + self.logits + sum(self.buffers.values())

    @property
    def optimizer_step(self) -> int:
        return sum(self.step_buffers.values())

    @property
    def total(self) -> int:
        """Peak bytes per GPU: the phases reuse each other's freed memory, as PyTorch's CUDA
        caching allocator lets them."""
        return self.model_state + self.runtime + max(self.forward_backward, self.optimizer_step)

    @property
    def total_stacked(self) -> int:
        """Peak when freed memory is not reused across phases: both phases, plus the weights
        as first built (ZeRO copies them into flat buffers). Host RSS behaves like this, since
        glibc keeps small freed blocks mapped; an upper bound on GPUs."""
        return (
            self.model_state
            + self.runtime
            + self.forward_backward
            + self.optimizer_step
            + self.params
        )

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.total <= self.capacity

    def to_dict(self) -> dict:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "model_state": self.model_state,
            "activations": self.activations,
            "logits": self.logits,
            "buffers": self.buffers,
            "step_buffers": self.step_buffers,
            "runtime": self.runtime,
            "total": self.total,
            "total_stacked": self.total_stacked,
            "host_bytes_per_gpu": self.host_bytes,
            "async_save_host_bytes_per_gpu": self.snapshot_bytes,
            "capacity": self.capacity,
            "fits": self.fits,
        }


def optimizer_bytes_per_param(zero: ZeroSetup, *, muon: bool = False) -> int:
    """Optimizer state per parameter: the fp32 master weight (4) and AdamW's two fp32 moments
    (8), or on Muon's half its one momentum buffer, which DeepSpeed 0.19.8 keeps in the
    gradient's dtype at ZeRO-1/2 and the communication dtype at ZeRO-3: 2 bytes under bf16
    (read off its code, not measured here: no GPU; 4 at ZeRO-1 with ``data_types.
    grad_accum_dtype`` fp32, which this estimate does not read), 4 in fp32 (checked against a
    checkpoint's optimizer files: tests/train/test_muon_layouts.py)."""
    if not muon:
        return 12
    return 4 + (2 if zero.bf16 and zero.stage >= 1 else 4)


def model_state_bytes(
    params: int, zero: ZeroSetup, n_gpus: int, *, muon: bool = False
) -> tuple[int, int, int, int]:
    """(weights, gradients, optimizer state) bytes on each GPU, and bytes per GPU on the host;
    ``muon``: the parameters are on Muon's half."""
    w_bytes, g_bytes = (2, 2) if zero.bf16 else (4, 4)
    opt_bytes = optimizer_bytes_per_param(zero, muon=muon)
    p, n = params, n_gpus
    weights = w_bytes * p / n if zero.stage == 3 else w_bytes * p
    grads = g_bytes * p / n if zero.stage >= 2 else g_bytes * p
    optimizer = opt_bytes * p / n if zero.stage >= 1 else opt_bytes * p
    host = 0.0
    if zero.offload_optimizer:
        host += optimizer + 4 * p / n  # with the fp32 gradient copy Adam steps on
        optimizer = 0.0
    if zero.offload_param:
        host += weights
        weights = 0.0
    return int(weights), int(grads), int(optimizer), int(host)


def snapshot_bytes(params: int, zero: ZeroSetup, n_gpus: int, *, muon: bool = False) -> int:
    """Host bytes of one rank's checkpoint, which an asynchronous save's snapshot holds
    (``anneal.resilience.snapshot``): its share of the optimizer state (the fp32 master weights
    and the moments: 12 bytes a parameter for AdamW) and the weights DeepSpeed saves from it,
    in the training dtype: at ZeRO-3 its partition, at ZeRO-0/1/2 all of them (rank 0 writes
    the model file; the largest rank is the one a GPU's budget has to hold)."""
    w_bytes = 2 if zero.bf16 else 4
    weights = w_bytes * params / n_gpus if zero.stage == 3 else w_bytes * params
    share = n_gpus if zero.stage >= 1 else 1
    return int(optimizer_bytes_per_param(zero, muon=muon) * params / share + weights)


def estimate(
    preset: ModelPreset,
    zero: ZeroSetup,
    work: Workload,
    *,
    capacity: int | None = None,
    runtime_bytes: int = GPU_RUNTIME_BYTES,
) -> MemoryEstimate:
    """Peak bytes per GPU of training ``preset`` with ``zero`` on ``work``."""
    if zero.stage not in (0, 1, 2, 3):
        raise UserError(f"zero_optimization.stage {zero.stage}: must be 0, 1, 2 or 3.")
    if work.loss not in ("chunked", "plain"):
        raise UserError(f"train.loss {work.loss!r}: must be chunked or plain.")
    for name, value in (
        ("--micro-batch", work.micro_batch),
        ("--seq", work.seq_len),
        ("--nodes x --gpus-per-node", work.n_gpus),
        ("train.loss_chunk_tokens", work.loss_chunk_tokens),
    ):
        if value < 1:
            raise UserError(f"{name} {value}: must be at least 1.")
    memory_layout.check(preset, zero, work)  # the launch's layout rules, in the estimate's words
    local = memory_sp.local_workload(work)  # one rank's seq / sp tokens
    dense, experts = memory_ep.dense_and_expert_params_per_gpu(preset, tp=work.tp, ep=work.ep)
    p = dense + experts
    n = work.n_gpus // work.tp  # the data-parallel group ZeRO partitions over
    n_experts = work.n_gpus // work.ep  # the expert-data-parallel group, the experts' (memory_ep)
    on_muon = min(dense, muon_dense_params(preset)) if zero.muon else 0
    states = [model_state_bytes(dense - on_muon, zero, n)]
    if on_muon:
        states.append(model_state_bytes(on_muon, zero, n, muon=True))
    if experts:
        states.append(model_state_bytes(experts, zero, n_experts, muon=zero.muon))
    weights, grads, optimizer, host = (sum(column) for column in zip(*states, strict=True))
    snapshot = snapshot_bytes(dense - on_muon, zero, n) + snapshot_bytes(
        on_muon, zero, n, muon=True
    )
    snapshot += snapshot_bytes(experts, zero, n_experts, muon=zero.muon)
    value_bytes = 2 if zero.bf16 else 4
    buffers = _forward_backward_buffers(preset, zero, work, local, params=p, dp=n)
    step = {}
    if not zero.offload_optimizer:
        # One parameter group's fp32 copy at a time (stage_1_and_2.step frees each before the
        # next): a sparse model's dense partition, then its experts'.
        partition = (
            p if zero.stage == 0 else max(math.ceil(dense / n), math.ceil(experts / n_experts))
        )
        if zero.stage == 3:
            partition = min(partition, zero.sub_group_size)
        step["fp32 gradient partition"] = 4 * partition
        if zero.torch_adam:
            # torch.optim.AdamW (not DeepSpeed's fused kernel) builds sqrt(v) and its quotient.
            step["torch AdamW temporaries"] = 8 * partition
    if zero.stage in (1, 2) and n > 1:
        step["all-gather bucket"] = min(zero.allgather_bucket_size, p) * value_bytes

    return MemoryEstimate(
        params=weights,
        grads=grads,
        optimizer=optimizer,
        activations=activation_bytes(preset, local, bf16=zero.bf16),
        logits=logits_bytes(preset, local, bf16=zero.bf16),
        buffers=buffers,
        step_buffers={k: int(v) for k, v in step.items()},
        runtime=runtime_bytes,
        host_bytes=host,
        capacity=capacity,
        snapshot_bytes=snapshot,
    )


def _forward_backward_buffers(
    preset: ModelPreset, zero: ZeroSetup, work: Workload, local: Workload, *, params: int, dp: int
) -> dict[str, int]:
    """Working buffers of forward/backward by name, on one GPU holding ``params`` parameters
    of a data-parallel group of ``dp``; ``local``: one rank's share of the sequence."""
    p, value_bytes, buffers = params, 2 if zero.bf16 else 4, {}
    if zero.stage >= 2 or (zero.stage == 1 and dp > 1):
        copies = 2 if zero.overlap_comm else 1
        buffers["reduce bucket"] = copies * min(zero.reduce_bucket_size, p) * value_bytes
    if zero.stage == 3:
        live = memory_ep.largest_module_params(preset, tp=work.tp, ep=work.ep)
        live += min(zero.prefetch_bucket_size, p)
        buffers["gathered weights"] = live * value_bytes
    if preset.is_moe:
        routed = memory_ep.routed_buffer_bytes(preset, local, value_bytes=value_bytes)
        buffers["MoE dispatch and combine"] = routed
    if work.float8.on:  # anneal.planning.float8_costs
        tokens = local.micro_batch * local.seq_len
        buffers["float8 casts"] = float8_costs.cast_buffer_bytes(preset, work.float8, tokens=tokens)
        held = float8_costs.held_weight_bytes(
            preset, work.float8, stage=zero.stage, dp=dp, value_bytes=value_bytes
        )
        if held:
            buffers["float8 held weights"] = held
    return {k: int(v) for k, v in buffers.items()}


def format_bytes(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def muon_dense_params(preset: ModelPreset) -> int:
    """The parameters on Muon other than a sparse model's experts (``anneal.model.muon``)."""
    shapes = muon_shapes(preset)
    return sum(math.prod(shape) for shape in shapes if len(shape) == 2)
