"""Expert parallelism (DeepSpeed AutoEP) in the memory estimate: where a sparse model's experts
live, and over which ranks ZeRO partitions their states.

A sparse preset's P parameters split in two: the experts, ``P_e = L E 3 h I`` (each of the L
layers' E SwiGLU experts of width I), and the rest, ``P_d = P - P_e`` (attention, norms, the
routers, the embedding and the LM head). AutoEP (``"expert_parallel": {"autoep_size": EP}``)
gives each rank of an expert-parallel group of EP consecutive ranks E / EP experts of every
layer, so a GPU holds ``P_e / EP`` expert parameters and the dense ones whole (before TP). ZeRO
then partitions each family over its own group, as DeepSpeed 0.19.8 does:

- the dense parameters over the data-parallel group (n / t ranks; all n under Ulysses), as for
  a dense model;
- the expert parameters over the expert-data-parallel group, the n / EP ranks that hold the same
  experts (``utils/groups._create_expert_and_data_parallel``). ZeRO-1/2 give each MoE parameter
  group that group as its ``real_dp_process_group`` and its size as ``partition_count``
  (``runtime/zero/stage_1_and_2._configure_moe_settings``); ZeRO-3 sets every AutoEP expert
  parameter's ``ds_zero_partition_process_group`` to it (``runtime/engine.py``,
  ``_partition_autoep_zero3_experts``).

With ``memory``'s ZeRO formulas per family, a GPU's expert states take (mixed precision)::

    stage 0:  16 P_e / EP                   stage 2:  2 P_e / EP + 14 P_e / n
    stage 1:  4 P_e / EP + 12 P_e / n       stage 3:  16 P_e / n

EP divides what ZeRO leaves whole (at stage 1 the weights and gradients, at stage 2 the
weights): the partitioned part, ``x (P_e / EP) / (n / EP) = x P_e / n``, does not depend on EP,
and at stage 3 nothing of the states does. There EP shrinks what ZeRO-3 gathers: one layer's
experts (``3 h I E / EP`` parameters, one module) are the largest thing it fetches. Under AutoTP
the experts are not sharded: AutoEP folds its groups across the tensor-parallel lanes
(``module_inject/auto_ep_folding.py``; the expert-data-parallel group stays n / EP) and the
folded layer splits the routed rows over the TP ranks; the estimate counts AutoTP's shards of a
sparse model as its attention and LM head.

Under imbalance the rank whose experts the router favours computes more rows than the balanced
``k s b`` this estimate counts (``memory_activations``); Megatron-Core's README warns of
out-of-memory errors from it in a dropless router's first few hundred steps.
"""

from __future__ import annotations

from anneal.errors import UserError
from anneal.model import ModelPreset
from anneal.planning import memory_tp


def autoep_size(ds: dict) -> int:
    """``expert_parallel.autoep_size`` of a ds_config when the section is enabled, else 1."""
    section = ds.get("expert_parallel")
    if not isinstance(section, dict) or not section.get("enabled", False):
        return 1
    value = section.get("autoep_size", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def expert_params(preset: ModelPreset) -> int:
    """``P_e = L E 3 h I``: the parameters of every layer's experts (0 for a dense model)."""
    moe = preset.moe
    if moe is None:
        return 0
    width = 3 * preset.hidden_size * moe.expert_intermediate_size
    return preset.num_hidden_layers * moe.num_experts * width


def params_per_gpu(preset: ModelPreset, *, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) parameters on one GPU before ZeRO: the dense ones after AutoTP's shards
    (``memory_tp.params_per_gpu``), and ``P_e / EP``."""
    experts = expert_params(preset)
    return memory_tp.params_per_gpu(preset, tp) - experts, experts // ep


def largest_module_params(preset: ModelPreset, *, tp: int, ep: int) -> int:
    """The largest module ZeRO-3 gathers at once: a dense model's (``memory_tp``), or for a
    sparse one the larger of the embedding (V x h) and one layer's local experts
    (``3 h I E / EP``, AutoEP's ``experts`` module)."""
    if preset.moe is None:
        return memory_tp.largest_layer_params(preset, tp)
    local = preset.moe.num_experts // ep
    vh = preset.vocab_size * preset.hidden_size
    return max(vh, 3 * preset.hidden_size * preset.moe.expert_intermediate_size * local)


def routed_buffer_bytes(preset: ModelPreset, work, *, value_bytes: int) -> int:
    """Working copies of one sparse layer's routed rows (``N = k s b / t`` on a rank: the folded
    layer splits them over the t TP ranks): the combine's zero-filled scatter target (v bytes a
    value) and its fp32 product with the router's scores, ``N h (v + 4)``. The dispatch's
    all-to-all send and receive copies (``2 N h v``) are no larger. 0 for a dense model."""
    if preset.moe is None:
        return 0
    rows = preset.moe.top_k * work.seq_len * work.micro_batch / work.tp
    return int(rows * preset.hidden_size * (value_bytes + 4))


def fitting_degrees(preset: ModelPreset, n_gpus: int) -> list[int]:
    """The EP degrees AutoEP accepts for ``preset`` on ``n_gpus``: divisors of both the experts
    per layer and the GPUs."""
    if preset.moe is None:
        return [1]
    experts = preset.moe.num_experts
    return [d for d in range(1, min(experts, n_gpus) + 1) if experts % d == 0 and n_gpus % d == 0]


def check(preset: ModelPreset, zero, work) -> None:
    """One UserError where AutoEP (DeepSpeed 0.19.8) would refuse ``work.ep`` for ``preset``
    with ``zero`` (a ``memory.ZeroSetup``) on ``work`` (a ``memory.Workload``), with the flag
    to change."""
    ep, n, tp, sp = work.ep, work.n_gpus, work.tp, work.sp
    if ep < 1:
        raise UserError(f"--ep {ep}: the expert-parallel degree must be at least 1.")
    moe = preset.moe
    if moe is None:
        if ep > 1:
            raise UserError(
                f"--ep {ep} (expert_parallel.autoep_size) with {preset.name}, a dense model: "
                f"expert parallelism shards the experts of a sparse one. Drop --ep, or give a "
                f"sparse model (a preset such as olmoe-1b-7b)."
            )
        return
    degrees = ", ".join(map(str, fitting_degrees(preset, n)))
    choose = f"Choose an --ep that divides both: {degrees}."
    why = None
    if moe.num_experts % ep:
        why = (
            f"does not divide the {moe.num_experts} experts of each layer of {preset.name}: "
            f"AutoEP gives each rank of a group the same number of whole experts. {choose}"
        )
    elif n % ep:
        why = (
            f"with {n} GPUs (--nodes x --gpus-per-node): the GPUs do not split into "
            f"expert-parallel groups of {ep}. {choose}"
        )
    elif tp > 1 and ep == 1:
        why = (
            f"with --tp {tp}: AutoEP runs tensor parallelism only folded into expert "
            f"parallelism (autoep_size above 1; at 1 every TP rank would compute every routed "
            f"token). Choose an --ep above 1 that divides both: {degrees.removeprefix('1, ')}. "
            f"Or drop --tp"
        )
    elif zero.stage == 3 and sp > 1:
        why = (
            f"with --sp {sp} and ZeRO-3: AutoEP under ZeRO-3 refuses sequence parallelism. "
            f"Use ZeRO-2 with --sp, or drop --sp"
        )
    elif tp > 1 and (zero.offload_optimizer or zero.offload_param):
        why = (
            f"with --tp {tp} and ZeRO offload: AutoEP refuses offload with AutoTP folding. "
            f"Drop the offload or --tp"
        )
    if why:
        raise UserError(f"--ep {ep} (expert_parallel.autoep_size) {why.rstrip('.')}.")
