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
and at stage 3 nothing of the states does. ZeRO-3 gains from EP a smaller gathered module: the
largest module it gathers whole for a forward is often one layer's experts (AutoEP's grouped
``w1``, ``w2`` and ``w3``, ``3 (E / EP) h I`` parameters: ``largest_module_params``), not the
embedding. Anneal refuses a sparse model with offload, tensor or sequence parallelism before
launch, and so does this estimate, by the same rules (``anneal.model.layout_rules``; the EP
degrees it accepts: ``layout_rules.expert_degrees``).

Under imbalance the rank whose experts the router favours computes more rows than the balanced
``k s b`` this estimate counts (``memory_activations``); Megatron-Core's MoE README warns of
out-of-memory errors from it, typically in the first 100-300 steps from scratch.
"""

from __future__ import annotations

from anneal.model import ModelPreset
from anneal.planning import memory_tp


def expert_params(preset: ModelPreset) -> int:
    """``P_e = L E 3 h I``: the parameters of every layer's experts (0 for a dense model)."""
    moe = preset.moe
    if moe is None:
        return 0
    width = 3 * preset.hidden_size * moe.expert_intermediate_size
    return preset.num_hidden_layers * moe.num_experts * width


def dense_and_expert_params_per_gpu(preset: ModelPreset, *, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) parameters on one GPU before ZeRO: the dense ones after AutoTP's shards
    (``memory_tp.params_per_gpu``), and ``P_e / EP``."""
    experts = expert_params(preset)
    return memory_tp.params_per_gpu(preset, tp) - experts, experts // ep


def largest_module_params(preset: ModelPreset, *, tp: int, ep: int) -> int:
    """Parameters of the largest module ZeRO-3 gathers whole: ``memory_tp``'s (the embedding,
    LM head or an MLP projection), or for a sparse model one layer's experts on one GPU,
    AutoEP's grouped ``w1``, ``w2`` and ``w3`` of ``E / EP`` experts, if larger."""
    largest = memory_tp.largest_layer_params(preset, tp)
    if preset.moe is None:
        return largest
    experts = 3 * (preset.moe.num_experts // ep) * preset.hidden_size
    return max(largest, experts * preset.moe.expert_intermediate_size)


def routed_buffer_bytes(preset: ModelPreset, work, *, value_bytes: int) -> int:
    """Working copies of one sparse layer's ``N = k s b`` routed rows, at their peak in the
    combine: its zero-filled scatter target (v bytes a value) and its fp32 product with the
    router's scores, ``N h (v + 4)``; the dispatch's all-to-all send and receive copies
    (``2 N h v``) are no larger. 0 for a dense model."""
    if preset.moe is None:
        return 0
    rows = preset.moe.top_k * work.seq_len * work.micro_batch
    return int(rows * preset.hidden_size * (value_bytes + 4))
