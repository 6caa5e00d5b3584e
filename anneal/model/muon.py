"""Which parameters step with Muon and which with AdamW, and the LR each Muon matrix takes: the
one place that decides it (issue 42; docs/training.md, "Muon").

Muon (Jordan et al. 2024) orthogonalizes a matrix's momentum by Newton-Schulz; it is defined on
the hidden matrices of a network. The rest steps with AdamW, as in Moonlight (arXiv 2502.16982)
and OLMo-core:

- Muon: every hidden matrix (attention q, k, v, o; the MLP's gate, up and down), and a sparse
  model's experts: AutoEP's fused (experts x rows x cols) tensors, which DeepSpeed marks
  ``is_expert_group`` so that Newton-Schulz runs on each expert's matrix alone;
- AdamW: the input embedding and the output head (``embed``, ``lm_head``: a lookup table and
  a classifier, not hidden matrices), every norm gain and bias (1-D), and the MoE router (its
  rows are the experts' logits: Muon would force every expert's score to the same scale).

DeepSpeed 0.19.8 tags ``use_muon`` itself by shape and by name (``embed``, ``lm_head``), which
would put the router on Muon; ``anneal.train.engine`` applies ``takes_muon`` after it.

The update scale. DeepSpeed scales an orthogonalized update of a (rows x cols) matrix by
sqrt(max(1, rows/cols)): its RMS is then 1/sqrt(cols) whatever the shape, so its LRs (about
0.02) mean nothing to an AdamW user and shift with the width. Moonlight's RMS-matched update,
0.2 x sqrt(max(rows, cols)) x the orthogonal matrix, has RMS 0.2, close to an AdamW update's,
so that AdamW's LR and weight decay carry over. ``muon_scale = "rms"`` gets it from DeepSpeed's
update by each Muon group's LR: x 0.2 x sqrt(cols), and its weight decay / that factor, so the
decay per step stays ``lr x weight_decay`` as AdamW's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from anneal.model.shape import ModelPreset

MUON_RMS = 0.2
"""The RMS of an RMS-matched Muon update (Moonlight, arXiv 2502.16982, section 2.2)."""
NS_STEPS = 5
"""Newton-Schulz iterations per update: fixed at 5 in DeepSpeed 0.19.8 (``muon_update``)."""


def is_router(name: str) -> bool:
    """A MoE router's weight: Hugging Face's ``...mlp.gate.weight`` (Qwen3-MoE, Mixtral's
    ``block_sparse_moe.gate``) or AutoEP's ``...router.gate.weight`` (``gate_proj`` is not)."""
    parts = name.split(".")
    return "router" in parts or parts[-2:] == ["gate", "weight"]


def takes_muon(name: str, shape: Sequence[int]) -> bool:
    """Whether the parameter ``name`` of the layer shape ``shape`` (``p.ds_shape`` under
    ZeRO-3, where ``p.shape`` is a 1-D shard) steps with Muon; else with AdamW."""
    lowered = name.lower()
    if len(shape) < 2 or "embed" in lowered or "lm_head" in lowered:
        return False
    return not is_router(name)


def layer_shape(p) -> tuple[int, ...]:
    """A parameter's own shape: ``ds_shape`` for a ZeRO-3 partition (``p.dim()`` is 1 there)."""
    shape = getattr(p, "ds_shape", None)
    return tuple(p.shape if shape is None else shape)


def lr_factor(shape: Sequence[int], scale: str) -> float:
    """What a Muon matrix's LR is multiplied by: 0.2 x sqrt(cols) under ``rms`` (DeepSpeed's
    update has RMS 1/sqrt(cols); this makes it 0.2), 1 under ``deepspeed``."""
    return MUON_RMS * math.sqrt(shape[-1]) if scale == "rms" else 1.0


def split_counts(preset: ModelPreset) -> tuple[int, int] | None:
    """(parameters on Muon, parameters on AdamW) of a preset, from its shapes; None for a
    Hugging Face architecture (``--init-from``), counted only when the engine is built."""
    if preset.hf_config is not None:
        return None
    from anneal.model.counts import count_params

    h, layers = preset.hidden_size, preset.num_hidden_layers
    q = preset.num_attention_heads * preset.head_dim
    kv = preset.num_key_value_heads * preset.head_dim
    attn = 2 * h * q + 2 * h * kv
    if preset.moe is None:
        mlp = 3 * h * preset.intermediate_size
    else:  # the experts; the router stays on AdamW
        mlp = preset.moe.num_experts * 3 * h * preset.moe.expert_intermediate_size
    muon = layers * (attn + mlp)
    return muon, count_params(preset) - muon


def describe_split(preset: ModelPreset, *, scale: str) -> str:
    """One line for the launch's summary: which parameters take which optimizer."""
    counts = split_counts(preset)
    share = ""
    if counts is not None:
        muon, adam = counts
        share = f" ({muon:,} = {muon / (muon + adam):.0%} on Muon, {adam:,} on AdamW)"
    experts = ", experts per expert" if preset.moe is not None else ""
    how = "RMS-matched (0.2 x sqrt(cols)): AdamW's LR" if scale == "rms" else "DeepSpeed's scale"
    return (
        f"optimizer muon: hidden matrices{experts} on Muon; embeddings, lm_head, norms, biases"
        f"{', router' if preset.moe is not None else ''} on AdamW{share}; Muon update {how}"
    )


def muon_param_groups(
    named_params, *, weight_decay: float, adam_lr: float, muon_lr: float, scale: str
) -> list[dict]:
    """The optimizer's groups for Muon beside AdamW, from ``model.named_parameters()``: AdamW's
    two (decay on matrices, none on norms and biases) at ``adam_lr``, first, so that a train
    row's ``lr`` is AdamW's as under ``adamw``; then one Muon group per column count, at
    ``muon_lr x lr_factor`` with the weight decay divided by that factor (the decay per step
    ``muon_lr x weight_decay``). Each group holds one half only, so DeepSpeed's split of a group
    into its Muon and Adam halves (``_muon_param_groups``) keeps each group's own LR."""
    decay, no_decay, muon = [], [], {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        shape = layer_shape(p)
        if takes_muon(name, shape):
            muon.setdefault(shape[-1], []).append(p)
        else:
            (decay if len(shape) >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "lr": adam_lr, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "lr": adam_lr, "name": "no_decay"},
    ]
    for cols, params in sorted(muon.items()):
        factor = lr_factor((cols,), scale)
        groups.append(
            {
                "params": params,
                "weight_decay": weight_decay / factor,
                "lr": muon_lr * factor,
                "name": f"muon_cols{cols}",
            }
        )
    return groups


def muon_shapes(preset: ModelPreset) -> list[tuple[int, ...]]:
    """The layer shape of every parameter on Muon: each layer's q, k, v, o and MLP matrices, a
    sparse model's experts as (experts, rows, cols); a Hugging Face architecture's read off its
    model on the meta device."""
    if preset.hf_config is not None:
        return _hf_muon_shapes(preset)
    h, q = preset.hidden_size, preset.num_attention_heads * preset.head_dim
    kv = preset.num_key_value_heads * preset.head_dim
    layer = [(q, h), (kv, h), (kv, h), (h, q)]
    if preset.moe is None:
        i = preset.intermediate_size
        layer += [(i, h), (i, h), (h, i)]
    else:
        e, i = preset.moe.num_experts, preset.moe.expert_intermediate_size
        layer += [(e, i, h), (e, i, h), (e, h, i)]
    return layer * preset.num_hidden_layers


def _hf_muon_shapes(preset: ModelPreset) -> list[tuple[int, ...]]:
    import torch

    from anneal.model.build import build_model

    with torch.device("meta"):
        model = build_model(preset)
    return [
        tuple(p.shape) for name, p in model.named_parameters() if takes_muon(name, tuple(p.shape))
    ]


def newton_schulz_flops(preset: ModelPreset) -> int:
    """FLOPs of one optimizer step's Newton-Schulz over every Muon matrix, once (ZeRO shares the
    matrices out among the ranks): ``NS_STEPS x (4 n^2 m + 2 n^3)`` for an (n x m) matrix,
    n <= m, the quintic iteration's three matmuls (X X^T, A A, B X); per expert for a sparse
    model's experts. DeepSpeed's default ``gram`` variant does fewer where m > n; this is the
    ``standard`` count, an upper bound."""
    total = 0
    for shape in muon_shapes(preset):
        batch = math.prod(shape[:-2])
        n, m = sorted(shape[-2:])
        total += batch * NS_STEPS * (4 * n * n * m + 2 * n**3)
    return total


def step_flops_per_token(preset: ModelPreset, *, tokens_per_step: int, ds_config: dict) -> float:
    """What a token adds to a step's FLOPs beyond the model's (``flops_per_token``): Muon's
    Newton-Schulz spread over the step's tokens under ``"type": "Muon"``, else 0."""
    if ds_config.get("optimizer", {}).get("type", "").lower() != "muon":
        return 0.0
    return newton_schulz_flops(preset) / tokens_per_step
