"""Muon on the real engine, in this process (one rank, gloo, fp32 on CPU, ZeRO-2): DeepSpeed's
``MuonWithAuxAdam`` gets Anneal's groups, each parameter tagged by ``takes_muon`` (the
router rule included: checked on the tags DeepSpeed would have set), AdamW's two groups first
at the AdamW LR and one Muon group per column count at lr x 0.2 x sqrt(cols); the schedule
scales every group alike: each group's LR at each step equals its peak times the closed form of
warmup-cosine (the engine's own scheduler), of warmup-stable-decay and of a cooldown branch
(``WarmupDecay`` on the engine's optimizer), and the guard's ``scale_peak`` halves both halves.
One step leaves Muon's one momentum buffer on its groups and AdamW's two moments on the others.
About 20 s in all here (two engines built in this process: one dense, one sparse), cheaper
than the launches that would prove the same.
"""

from __future__ import annotations

import math

import pytest

from tests.conftest import SMALL, resolve_tiny, sets

WARM, TOTAL = 2, 10


def _cosine(t: int) -> float:
    if t <= WARM:
        return t / WARM
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - WARM) / (TOTAL - WARM)))


def _wsd(t: int) -> float:
    """Warmup 2, peak to step 8, 1-sqrt decay over the last 2 steps to 0."""
    if t <= WARM:
        return t / WARM
    return 1.0 if t <= 8 else 1.0 - math.sqrt(min(1.0, (t - 8) / 2))


def _cooldown(t: int) -> float:
    """From 1.0 x peak after step 4, linear to 0.1 at step 10."""
    return 0.1 + 0.9 * (1 - min(1.0, (t - 4) / 6))


@pytest.fixture(scope="module")
def engine_and_launch(tiny_data, tmp_path_factory, world_of_one):
    from anneal.train.engine import build_engine

    out = tmp_path_factory.mktemp("muon-engine") / "run"
    launch = resolve_tiny(
        [
            *("--out", str(out), "--data", str(tiny_data), "--max-steps", str(TOTAL)),
            *SMALL,
            *sets("optim.optimizer=muon", "ds.zero_optimization.stage=2"),
        ],
        world_size=1,
    )
    return build_engine(launch), launch


def test_groups_tags_and_peak_lrs(engine_and_launch):
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    from anneal.model import takes_muon
    from anneal.model.muon import layer_shape

    engine, launch = engine_and_launch
    assert isinstance(engine.optimizer.optimizer, MuonWithAuxAdam)
    named = list(engine.module.named_parameters())
    assert all(p.use_muon == takes_muon(n, layer_shape(p)) for n, p in named)
    groups = engine.optimizer.optimizer.param_groups
    assert [(g["name"], g["use_muon"]) for g in groups] == [
        ("decay-adam-params", False),
        ("no_decay-adam-params", False),
        ("muon_cols64-muon-params", True),
        ("muon_cols176-muon-params", True),
    ]
    lr = launch.cfg.optim.lr
    peaks = engine.lr_scheduler.peak_lrs
    assert peaks[:2] == [lr, lr]
    assert peaks[2:] == pytest.approx([lr * 0.2 * 8, lr * 0.2 * math.sqrt(176)], rel=1e-12)
    assert launch.ds_config["gradient_clipping"] == 0.0
    assert "gradient_clipping = 0 (the file's 1 is off under Muon" in launch.describe()


def test_every_group_follows_the_schedule_and_the_guard_scale(engine_and_launch):
    from anneal.config.schedule import Schedule, WarmupDecay

    engine, _ = engine_and_launch
    opt = engine.optimizer
    peaks = list(engine.lr_scheduler.peak_lrs)
    base = dict(total_num_steps=TOTAL, warmup_num_steps=WARM)
    schedules = [
        (engine.lr_scheduler, _cosine),
        (WarmupDecay(opt, Schedule(kind="wsd", min_ratio=0.0, **base)), _wsd),
        (
            WarmupDecay(
                opt,
                Schedule(kind="wsd", min_ratio=0.1, decay_shape="linear", cooldown_step=4, **base),
            ),
            _cooldown,
        ),
    ]
    for scheduler, closed_form in schedules:
        scheduler.peak_lrs = list(peaks)
        scheduler.steps_done = 3 if closed_form is _cooldown else 0
        scheduler.apply()
        for t in range(scheduler.steps_done + 1, TOTAL + 1):
            want = [p * closed_form(t) for p in peaks]
            assert [g["lr"] for g in opt.param_groups] == pytest.approx(want, rel=1e-12), t
            scheduler.step()
    scheduler = engine.lr_scheduler
    scheduler.steps_done = 4
    scheduler.scale_peak(0.5)  # what the guard's rewind does with guard.lr_scale=0.5
    want = [0.5 * p * _cosine(5) for p in peaks]
    assert [g["lr"] for g in opt.param_groups] == pytest.approx(want, rel=1e-12)


def test_one_step_keeps_one_buffer_on_muon_and_two_moments_on_adamw(engine_and_launch):
    import torch

    from anneal.train.loss import next_token_loss

    engine, launch = engine_and_launch
    gen = torch.Generator().manual_seed(0)
    for _ in range(launch.grad_accum):  # the micro-batches of one optimizer step
        x = torch.randint(0, launch.preset.vocab_size, (4, 65), generator=gen)
        engine.backward(next_token_loss(engine(input_ids=x[:, :-1]).logits, x[:, 1:]))
        engine.step()
    assert engine.global_steps == 1
    inner = engine.optimizer.optimizer
    for group in inner.param_groups:
        [flat] = group["params"]
        keys = set(inner.state[flat])
        want = {"momentum_buffer"} if group["use_muon"] else {"exp_avg", "exp_avg_sq", "step"}
        assert keys == want, (group["name"], keys)


def test_a_sparse_models_experts_take_muon_and_its_router_adamw(tiny_data, tmp_path, world_of_one):
    """AutoEP's engine (EP=1, ZeRO-2) under Muon: its fused experts ``w1``, ``w2``, ``w3``
    (experts x rows x cols, ``is_expert_group``) tagged Muon, its router and everything else
    DeepSpeed would tag Muon by shape but that is no hidden matrix, AdamW; one step runs and
    leaves a momentum buffer on the experts' group."""
    import torch

    from anneal.train.engine import build_engine
    from anneal.train.loss import next_token_loss
    from tests.train.test_moe import _resolve

    launch = _resolve(
        tiny_data, tmp_path / "run", *sets("optim.optimizer=muon", "optim.global_batch_tokens=64")
    )
    engine = build_engine(launch)
    named = dict(engine.module.named_parameters())
    experts = [n for n in named if ".experts." in n]
    routers = [n for n in named if ".router." in n or n.endswith("mlp.gate.weight")]
    assert experts and routers
    assert all(named[n].use_muon and named[n].dim() == 3 for n in experts)
    assert all(getattr(named[n], "is_expert_group", False) for n in experts)
    assert not any(named[n].use_muon for n in routers)
    x = torch.randint(
        0, launch.preset.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0)
    )
    for _ in range(launch.grad_accum):
        out = engine(input_ids=x[:, :-1])
        engine.backward(next_token_loss(out.logits, x[:, 1:]))
        engine.step()
    assert engine.global_steps == 1
    inner = engine.optimizer.optimizer
    muon_groups = [g for g in inner.param_groups if g["use_muon"]]
    assert muon_groups and all(
        "momentum_buffer" in inner.state[g["params"][0]] for g in muon_groups
    )
