"""Muon in the plan: the estimator's optimizer state for each half (AdamW's 12 bytes a
parameter, Muon's 4 + its momentum buffer: 2 under bf16 with ZeRO, 4 in fp32; the
checkpoint's files agree: tests/train/test_muon_layouts.py) and the forecast's step time with
Newton-Schulz's FLOPs added to the model's."""

from __future__ import annotations

import pytest

from anneal.model import flops_per_token, get_preset
from anneal.model.muon import newton_schulz_flops, split_counts
from anneal.planning import forecast, memory


def _ds(kind: str, stage: int, bf16: bool = True) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": kind},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
    }


@pytest.mark.parametrize(
    "stage, bf16, per_param", [(3, True, 6), (2, True, 6), (1, True, 6), (3, False, 8)]
)
def test_muon_half_keeps_one_buffer_where_adamw_keeps_two(stage, bf16, per_param):
    preset = get_preset("1b")
    work = memory.Workload(micro_batch=4, seq_len=2048, n_gpus=8)
    adamw = memory.estimate(
        preset, memory.ZeroSetup.from_ds_config(_ds("AdamW", stage, bf16)), work
    )
    muon = memory.estimate(preset, memory.ZeroSetup.from_ds_config(_ds("Muon", stage, bf16)), work)
    on_muon, _ = split_counts(preset)
    saved = on_muon * (12 - per_param) / 8
    assert adamw.optimizer - muon.optimizer == pytest.approx(saved, abs=2)
    assert adamw.params == muon.params and adamw.grads == muon.grads


def test_forecast_adds_newton_schulz_flops():
    preset, tokens = get_preset("1b"), 524_288
    common = dict(
        preset=preset,
        tokens_per_step=tokens,
        world_size=8,
        max_steps=100,
        start_step=0,
        mfu=0.4,
        peak_flops=989e12,
    )
    adamw = forecast.make(ds_config=_ds("AdamW", 3), **common)
    muon = forecast.make(ds_config=_ds("Muon", 3), **common)
    model = flops_per_token(preset) * tokens
    assert muon.step_s / adamw.step_s == pytest.approx(1 + newton_schulz_flops(preset) / model)
    assert 1.001 < muon.step_s / adamw.step_s < 1.05
