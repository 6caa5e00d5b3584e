"""Which parameters take Muon and which AdamW (``anneal.model.muon``, the one place), and the LR
each Muon matrix takes.

On the models themselves (built on the meta device): a dense Llama's q, k, v, o, gate, up and
down projections take Muon, its embedding, head and norms AdamW; a sparse Qwen3-MoE's fused
experts take Muon and its router AdamW, under Hugging Face's names and AutoEP's (whose
(experts x rows x cols) tensors DeepSpeed orthogonalizes per expert); a ZeRO-3 partition (1-D,
its shape in ``ds_shape``) is judged by its layer's shape. The launch summary's counts are the
model's. The RMS-matched LR: DeepSpeed's update of an exactly orthogonalized (rows x cols)
matrix, times ``lr_factor``, has RMS 0.2 (Moonlight's) at every shape; through DeepSpeed's own
``muon_update`` (5 Newton-Schulz steps) within the iteration's spread.
"""

from __future__ import annotations

import dataclasses

import pytest

from anneal.model import PRESETS, build_model, muon_param_groups, takes_muon
from anneal.model.muon import MUON_RMS, describe_split, layer_shape, lr_factor, split_counts


def _meta_model(preset):
    import torch

    with torch.device("meta"):
        return build_model(preset)


SMALL_DENSE = dataclasses.replace(
    PRESETS["tiny"], hidden_size=64, intermediate_size=176, num_hidden_layers=2
)


def test_dense_llama_hidden_matrices_on_muon_the_rest_on_adamw():
    model = _meta_model(SMALL_DENSE)
    muon = {n for n, p in model.named_parameters() if takes_muon(n, layer_shape(p))}
    leaves = {n.split(".")[-2] for n in muon}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    adam = {n for n, _ in model.named_parameters()} - muon
    assert "model.embed_tokens.weight" in adam and "lm_head.weight" in adam
    assert all("norm" in n or "embed" in n or "lm_head" in n for n in adam), adam
    muon_params = sum(p.numel() for n, p in model.named_parameters() if n in muon)
    total = sum(p.numel() for p in model.parameters())
    assert split_counts(SMALL_DENSE) == (muon_params, total - muon_params)


def test_sparse_experts_on_muon_router_on_adamw():
    """Hugging Face's Qwen3-MoE names (fused 3-D experts, ``mlp.gate`` router) and AutoEP's
    (``experts.w1/w2/w3``, ``router.gate``)."""
    preset = PRESETS["tiny-moe"]
    model = _meta_model(preset)
    named = dict(model.named_parameters())
    routers = [n for n in named if n.endswith("mlp.gate.weight")]
    experts = [n for n in named if ".experts." in n]
    assert routers and experts
    assert not any(takes_muon(n, layer_shape(named[n])) for n in routers)
    assert all(takes_muon(n, layer_shape(named[n])) and named[n].dim() == 3 for n in experts)
    e, h, i = preset.moe.num_experts, preset.hidden_size, preset.moe.expert_intermediate_size
    assert takes_muon("model.layers.0.mlp.experts.w1", (e, i, h))
    assert takes_muon("model.layers.0.mlp.experts.w2", (e, h, i))
    assert not takes_muon("model.layers.0.mlp.router.gate.weight", (e, h))
    assert takes_muon("model.layers.0.mlp.gate_proj.weight", (i, h))
    muon = sum(p.numel() for n, p in named.items() if takes_muon(n, layer_shape(p)))
    total = sum(p.numel() for p in named.values())
    assert split_counts(preset) == (muon, total - muon)
    assert "experts per expert" in describe_split(preset, scale="rms")
    assert "router on AdamW" in describe_split(preset, scale="rms")


def test_a_zero3_partition_is_judged_by_its_layer_shape():
    import torch

    shard = torch.nn.Parameter(torch.zeros(8))  # what zero.Init leaves: 1-D
    shard.ds_shape = torch.Size([64, 176])
    assert shard.dim() == 1 and takes_muon(
        "model.layers.0.mlp.down_proj.weight", layer_shape(shard)
    )
    norm = torch.nn.Parameter(torch.zeros(8))
    norm.ds_shape = torch.Size([64])
    assert not takes_muon("model.layers.0.input_layernorm.weight", layer_shape(norm))


@pytest.mark.parametrize("rows, cols", [(64, 64), (64, 176), (176, 64), (16, 64), (512, 8)])
def test_rms_matched_factor_gives_deepspeeds_update_rms_0_2(rows, cols):
    """DeepSpeed scales the orthogonalized matrix (U V^T of the SVD) by its own
    ``_aspect_ratio_scale``; times ``lr_factor`` that update has RMS 0.2 exactly."""
    import torch
    from deepspeed.runtime.zero.muon.original_muon import _aspect_ratio_scale

    g = torch.randn(rows, cols, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    u, _, vt = torch.linalg.svd(g, full_matrices=False)
    update = (u @ vt) * _aspect_ratio_scale(rows, cols)
    rms = update.square().mean().sqrt().item()
    assert rms * lr_factor((rows, cols), "rms") == pytest.approx(MUON_RMS, rel=1e-9)
    assert lr_factor((rows, cols), "deepspeed") == 1.0


@pytest.mark.parametrize("ns_method", ["gram", "standard"])
def test_deepspeeds_own_update_is_near_rms_0_2(ns_method):
    """Through DeepSpeed's ``muon_update`` (5 quintic Newton-Schulz steps, which leave the
    singular values in about 0.7 to 1.2 rather than 1): RMS 0.2 within 25% at three shapes,
    where DeepSpeed's own scale spreads 1/sqrt(cols) over 0.06 to 0.13."""
    import torch
    from deepspeed.runtime.zero.muon import original_muon

    from anneal.train.muon_engine import cpu_newton_schulz

    cpu_newton_schulz()  # compiled, the first calls take seconds on a CPU
    for rows, cols in [(64, 64), (176, 64), (64, 176)]:
        g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
        update = original_muon.muon_update(
            g.clone(), torch.zeros_like(g), beta=0.95, ns_method=ns_method
        )
        rms = update.square().mean().sqrt().item() * lr_factor((rows, cols), "rms")
        assert rms == pytest.approx(MUON_RMS, rel=0.25), (rows, cols, rms)


def test_groups_hold_one_half_each_with_their_lr_and_decay():
    """AdamW's two groups first (the train row's ``lr`` is theirs), then one Muon group per
    column count at lr x 0.2 x sqrt(cols) with the decay divided by that factor."""
    model = _meta_model(SMALL_DENSE)
    groups = muon_param_groups(
        model.named_parameters(), weight_decay=0.1, adam_lr=3e-3, muon_lr=2e-3, scale="rms"
    )
    assert [g["name"] for g in groups] == ["decay", "no_decay", "muon_cols64", "muon_cols176"]
    assert [g["lr"] for g in groups[:2]] == [3e-3, 3e-3]
    assert groups[1]["weight_decay"] == 0.0
    for g, cols in zip(groups[2:], (64, 176), strict=True):
        assert g["lr"] == pytest.approx(2e-3 * 0.2 * cols**0.5, rel=1e-12)
        assert g["lr"] * g["weight_decay"] == pytest.approx(2e-3 * 0.1, rel=1e-12)
        assert all(p.shape[-1] == cols and p.dim() == 2 for p in g["params"])
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())


def test_newton_schulz_flops_are_torchs_count_of_the_iteration():
    """``newton_schulz_flops`` of a one-layer model against torch's FLOP counter run over
    DeepSpeed's own (eager) quintic iteration on every Muon matrix of it."""
    import torch
    from deepspeed.runtime.zero.muon import original_muon
    from torch.utils.flop_counter import FlopCounterMode

    from anneal.model.muon import NS_STEPS, muon_shapes, newton_schulz_flops

    preset = dataclasses.replace(SMALL_DENSE, num_hidden_layers=1)
    iterate = getattr(
        original_muon.zeropower_via_newtonschulz5,
        "_torchdynamo_orig_callable",
        original_muon.zeropower_via_newtonschulz5,
    )
    counter = FlopCounterMode(display=False)
    with counter:
        for shape in muon_shapes(preset):
            iterate(torch.randn(*shape), steps=NS_STEPS)
    assert newton_schulz_flops(preset) == counter.get_total_flops()
