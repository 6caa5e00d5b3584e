"""The learning rate the engine applies at each optimizer step equals the seed formula: linear
warmup a_max*t/T_warm, then cosine from a_max to a_min = 0.1*a_max at T_max."""

import math

import pytest

from anneal.config.schedule import lr_ratio
from tests.conftest import read_metrics


def seed_lr(t, *, a_max, t_warm, t_max):
    """The formula as the seed documents write it."""
    a_min = 0.1 * a_max
    if t <= t_warm:
        return a_max * t / t_warm
    return a_min + 0.5 * (a_max - a_min) * (1 + math.cos(math.pi * (t - t_warm) / (t_max - t_warm)))


@pytest.mark.parametrize("t", [1, 2, 999, 1000, 1001, 5000, 50_000, 99_999, 100_000])
def test_ratio_matches_seed_formula(t):
    got = lr_ratio(t, total_num_steps=100_000, warmup_num_steps=1000, cos_min_ratio=0.1)
    assert got == pytest.approx(seed_lr(t, a_max=1.0, t_warm=1000, t_max=100_000), rel=1e-12)


def test_shape_landmarks():
    kw = dict(total_num_steps=100, warmup_num_steps=10, cos_min_ratio=0.1)
    assert lr_ratio(10, **kw) == 1.0
    assert lr_ratio(55, **kw) == pytest.approx(0.55)  # cosine midpoint: (1 + 0.1) / 2
    assert lr_ratio(100, **kw) == pytest.approx(0.1)
    assert lr_ratio(150, **kw) == pytest.approx(0.1)  # held at the floor past T_max


def test_engine_applies_the_formula(same_seed_runs):
    """The session's fp32 run (tests/conftest.py: 4 steps, warmup 2): the learning rate the
    engine logged at every step is the seed's formula: the linear warmup, its peak at step 2,
    the cosine's midpoint at step 3 and the floor (0.1 of the peak) at the last step."""
    rows = read_metrics(same_seed_runs["fp32"][0], "train")
    a_max = 3e-3  # the tiny recipe's optim.lr (cpu.json says "auto")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["lr"] == pytest.approx(
            seed_lr(r["step"], a_max=a_max, t_warm=2, t_max=4), rel=1e-9
        ), r["step"]
