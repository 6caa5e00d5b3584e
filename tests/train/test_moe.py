"""Sparse (Mixture-of-Experts) models: the presets and their counts, the expert-parallel layout
resolved and refused before any process starts, and one training step of DeepSpeed's AutoEP
engine against plain transformers.

Counts: each sparse preset's total parameters equal those of its transformers model built on
the meta device, its active ones the closed form (total less the experts a token skips), and
the published sizes (OLMoE-1B-7B 6.9B/1.3B, Qwen3-30B-A3B 30.5B/3.3B) within 2%; FLOPs per token
(hence MFU) count active parameters. Layouts: through ``resolve_launch`` (every rank and the
launcher's pre-flight run it) each bad layout is one UserError raised on every rank, naming the
key and the fix. The engine (in this process, one rank, gloo): AutoEP's logits and
load-balancing loss equal plain transformers' on the same weights (the fused experts split
into AutoEP's w1/w3/w2), the objective is LM + aux_coef x aux + z_coef x z, and the counts AutoEP
keeps per expert are the top-k choices of the reference router's softmax.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from anneal.errors import UserError
from anneal.model import PRESETS, active_params, count_params, flops_per_token
from tests.conftest import ROOT, sets

MOE = ROOT / "recipes" / "pretrain_moe_tiny.py"
SHAPE = sets(
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.seq_len=32",
    "model.num_experts=4",
    "model.expert_intermediate_size=32",
    "ds.train_micro_batch_size_per_gpu=2",
)


def _resolve(data, out, *extra: str, world_size: int = 1, device_type: str = "cpu"):
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.resolution.resolve import resolve_launch

    args = ["--out", str(out), "--data", str(data), *SHAPE, *extra]
    cfg, overrides = config_from_args(
        args, prog=str(MOE), on_cpu=device_type == "cpu", **load_recipe(MOE)
    )
    return resolve_launch(cfg, overrides, world_size=world_size, device_type=device_type)


def _refused(data, out, *extra: str, world_size: int = 2) -> str:
    with pytest.raises(UserError) as caught:
        _resolve(data, out, *extra, world_size=world_size)
    assert caught.value.every_rank
    assert not out.exists()  # refused before anything is written
    return str(caught.value)


# -- presets and counts ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-moe", "olmoe-1b-7b", "qwen3-30b-a3b"])
def test_sparse_counts_are_the_models(name):
    """Total parameters equal those of the Qwen3-MoE model built on the meta device; active ones
    the total less each layer's skipped experts."""
    import torch

    from anneal.model import build_model

    preset = PRESETS[name]
    with torch.device("meta"):
        model = build_model(preset)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert count_params(preset) == sum(p.numel() for p in model.parameters())
    moe = preset.moe
    expert = 3 * preset.hidden_size * moe.expert_intermediate_size
    skipped = preset.num_hidden_layers * (moe.num_experts - moe.top_k) * expert
    assert active_params(preset) == count_params(preset) - skipped


@pytest.mark.parametrize(
    "name, total, active", [("olmoe-1b-7b", 6.9e9, 1.3e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9)]
)
def test_published_shapes_have_their_published_sizes(name, total, active):
    """OLMoE-1B-7B (arXiv 2409.02060, Table 1) and Qwen3-30B-A3B (its model card): within 2%."""
    preset = PRESETS[name]
    assert count_params(preset) == pytest.approx(total, rel=0.02)
    assert active_params(preset) == pytest.approx(active, rel=0.02)


def test_flops_per_token_count_active_parameters():
    """tiny-moe's token runs through the tiny dense model's parameters plus a router per layer:
    its FLOPs per token are the dense model's plus 6 x the routers', not 6 x its total."""
    sparse, dense = PRESETS["tiny-moe"], PRESETS["tiny"]
    routers = sparse.num_hidden_layers * sparse.hidden_size * sparse.moe.num_experts
    qk_norms = sparse.num_hidden_layers * 2 * sparse.head_dim
    assert flops_per_token(sparse) == flops_per_token(dense) + 6 * (routers + qk_norms)
    assert count_params(sparse) > 1.8 * count_params(dense)


# -- the layout, resolved and refused ----------------------------------------------------------


def test_a_sparse_launch_resolves_with_autoep_filled_in(tiny_data, tmp_path):
    """AutoEP on at degree 1 by default, Qwen3-MoE's preset, the plain expert loop on a CPU and
    grouped GEMMs on a GPU in bf16; the describe line says how experts and tokens are laid out;
    config.json records the degree."""
    launch = _resolve(
        tiny_data, tmp_path / "a", *sets("ds.expert_parallel.autoep_size=2"), world_size=4
    )
    section = launch.ds_config["expert_parallel"]
    assert section == {
        "enabled": True,
        "autoep_size": 2,
        "preset_model": "qwen3_moe",
        "use_grouped_mm": False,
    }
    assert launch.layout.expert_parallel == 2 and launch.layout.data_parallel == 4
    assert (
        launch.ds_config["train_micro_batch_size_per_gpu"] * 4 * launch.grad_accum
        == (launch.ds_config["train_batch_size"])
    )  # every rank reads its own samples
    text = launch.describe()
    assert "4 ranks = data-parallel 4, experts shared out over groups of 2" in text
    assert "each rank holds 2 experts of every layer, 2 copies of each expert" in text
    assert launch.config_document()["launch"]["expert_parallel_size"] == 2
    gpu = _resolve(tiny_data, tmp_path / "b", *sets("train.precision=bf16"), device_type="cuda")
    assert gpu.ds_config["expert_parallel"]["use_grouped_mm"] is True
    dense = PRESETS["tiny"]
    assert "expert_parallel" not in _dense_ds(tiny_data, tmp_path / "c") and dense.moe is None


def _dense_ds(data, out) -> dict:
    from tests.conftest import resolve_tiny

    return resolve_tiny(["--out", str(out), "--data", str(data)], world_size=1).ds_config


@pytest.mark.parametrize(
    "extra, world, match",
    [
        (["ds.expert_parallel.autoep_size=3"], 3, "does not divide the model's 4 experts"),
        (["ds.expert_parallel.autoep_size=4"], 2, "do not split into expert groups of 4"),
        (
            ["ds.expert_parallel.autoep_size=2", "ds.tensor_parallel.autotp_size=2"],
            4,
            "with tensor_parallel.autotp_size 2",
        ),
        (["ds.sequence_parallel_size=2"], 2, "with sequence_parallel_size 2"),
        (
            ["ds.zero_optimization.stage=3", "ds.sequence_parallel_size=2"],
            2,
            "with sequence_parallel_size 2",
        ),
        (
            ['ds.zero_optimization.offload_optimizer={"device": "cpu"}'],
            2,
            "a sparse model with ZeRO offload",
        ),
        (
            [
                "ds.zero_optimization.stage=3",
                'ds.zero_optimization.offload_param={"device": "cpu"}',
            ],
            2,
            "a sparse model with ZeRO offload",
        ),
        (
            ["ds.zero_optimization.stage=3", "ds.expert_parallel.expert_tensor_parallel_size=2"],
            2,
            "expert_tensor_parallel_size",
        ),
        (["ds.expert_parallel.load_balance_coeff=0.001"], 2, "rejects aux-loss-free balancing"),
        (["ds.expert_parallel.preset_model=mixtral"], 2, "Anneal's sparse models are Qwen3-MoE"),
        (["ds.expert_parallel.enabled=false"], 2, "trains every sparse model through"),
        (["model.experts_per_token=5"], 2, "is more than model.num_experts 4"),
        (["ds.expert_parallel.autoep_size=0"], 2, "expert_parallel.autoep_size is 0"),
    ],
)
def test_each_bad_expert_layout_is_one_clear_error(tiny_data, tmp_path, extra, world, match):
    """Each refused before anything is written, on every rank, with its reason and a fix."""
    message = _refused(tiny_data, tmp_path / "run", *sets(*extra), world_size=world)
    assert match in message
    assert "\n" not in message


@pytest.mark.parametrize("ep", [1, 2])
def test_a_sparse_launch_resolves_at_zero3(tiny_data, tmp_path, ep):
    """ZeRO-3 goes with AutoEP at any degree (without tensor or sequence parallelism, expert
    tensor parallelism or offload): the launch resolves, its ds_config at stage 3 with the
    expert section filled in (tests/train/test_moe_parallel.py trains it)."""
    launch = _resolve(
        tiny_data,
        tmp_path / "run",
        *sets("ds.zero_optimization.stage=3", f"ds.expert_parallel.autoep_size={ep}"),
        world_size=2,
    )
    assert launch.ds_config["zero_optimization"]["stage"] == 3
    assert launch.ds_config["expert_parallel"]["autoep_size"] == ep
    assert launch.layout.expert_parallel == ep and launch.layout.data_parallel == 2


def test_expert_settings_on_a_dense_model_are_refused(tiny_data, tmp_path):
    """A dense preset given experts, or expert parallelism, is told which presets are sparse."""
    from tests.conftest import refused_tiny

    base = ["--out", str(tmp_path / "run"), "--data", str(tiny_data)]
    for extra in (["model.num_experts=4"], ["ds.expert_parallel.enabled=true"]):
        message = refused_tiny([*base, *sets(*extra)], world_size=1)
        assert "tiny-moe" in message and "dense" in message


def test_resume_at_another_expert_parallel_degree_passes_the_layout_check(tmp_path):
    """A checkpoint saved at EP=2 resumed at EP=1 is not refused before launch: it goes through
    DeepSpeed's universal checkpoint (tests/train/test_moe_parallel.py runs it); one saved with
    sequence parallelism, which that conversion does not carry, is."""
    from anneal.resolution import parallel

    here = parallel.Layout(2, 1, 1, 1)
    for saved in ({"expert_parallel_size": 2, "world_size": 2}, {"world_size": 2}):
        parallel.check_resume_layout(tmp_path, saved, here, stage=2)
    with pytest.raises(UserError, match="Resume on 2 ranks"):
        saved = {"sequence_parallel_size": 2, "expert_parallel_size": 2, "world_size": 2}
        parallel.check_resume_layout(tmp_path, saved, here, stage=2)


def test_the_registry_repair_is_needed_and_undone():
    """transformers 5.24's registry refuses the dict calls DeepSpeed 0.19.8's AutoEP makes (the
    repair is needed); inside the repair they work as on a dict; after it, the class is
    transformers' own again."""
    from transformers.utils import output_capturing

    from anneal.train.experts import autoep_registry_fix

    registry = output_capturing._CAN_RECORD_REGISTRY
    cls = type(registry)
    with pytest.raises(TypeError):
        registry.get("<class 'nothing'>", None)
    original = cls.get, cls.__setitem__
    with autoep_registry_fix():
        assert registry.get("<class 'nothing'>", "missing") == "missing"
        registry["<class 'nothing'>"] = {"x": 1}
        assert dict.get(registry, "<class 'nothing'>") == {"x": 1}
        dict.pop(registry, "<class 'nothing'>")
    assert (cls.get, cls.__setitem__) == original


# -- the engine against plain transformers -----------------------------------------------------


def test_autoep_engine_equals_transformers(tiny_data, tmp_path, world_of_one):
    """About 5 s (an engine built in this process). The first forward of Anneal's AutoEP engine
    (EP=1, ZeRO-2) against the same weights in plain transformers' Qwen3MoeForCausalLM (its
    fused experts): logits within 1e-5, the load-balancing loss within 1e-6; the objective is
    LM + 0.01 x aux + 0.001 x z; AutoEP's per-expert counts are the reference router's top-2."""
    import torch

    from anneal.model import build_model, init_weights_
    from anneal.train.engine import build_engine
    from anneal.train.experts import RouterStats
    from anneal.train.step import next_token_loss

    launch = _resolve(tiny_data, tmp_path / "run")
    engine = build_engine(launch)
    ref = build_model(launch.preset)
    init_weights_(ref, std=launch.preset.initializer_range, seed=launch.cfg.train.seed)
    ref.eval(), engine.eval()
    x = torch.randint(
        0, launch.preset.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0)
    )
    inputs, y = x[:, :-1], x[:, 1:]
    router = RouterStats.of(engine, launch.preset.moe)
    router.before_forward()
    out = engine(input_ids=inputs)
    with torch.no_grad():
        expected = ref(input_ids=inputs, output_router_logits=True)
    assert (out.logits - expected.logits).abs().max().item() < 1e-5
    assert out.aux_loss.item() == pytest.approx(expected.aux_loss.item(), abs=1e-6)
    lm = next_token_loss(out.logits, y)
    objective = router.objective(out, lm)
    z = torch.stack([torch.logsumexp(g, -1).square().mean() for g in expected.router_logits])
    want = lm.item() + 0.01 * expected.aux_loss.item() + 0.001 * z.mean().item()
    assert objective.item() == pytest.approx(want, rel=1e-6)
    for layer, logits in enumerate(expected.router_logits):
        top = torch.softmax(logits, -1).topk(2, dim=-1).indices.flatten()
        want_counts = torch.bincount(top, minlength=4).double()
        assert torch.equal(router.counts[layer], want_counts), layer
    row = router.row(router.vector().tolist(), ranks=1)
    assert [sum(c) for c in row["moe_counts"]] == [2 * 32 * 2] * 2
    assert row["moe_entropy"][0] <= math.log(4) + 1e-9
    json.dumps(row)  # the row's fields are plain JSON
    assert dataclasses.is_dataclass(launch.preset.moe)
