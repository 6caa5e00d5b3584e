"""Precision: bf16 (the GPU default) trains correctly on tiny shapes here, close to fp32 from
the same weights and data; and a bf16 config on a device without fast bf16 is switched to fp32
automatically, with a note in the log and in the run's config.json."""

import json

import pytest

from tests.conftest import read_metrics


@pytest.fixture(scope="module")
def runs(same_seed_runs):
    """The session's same-seed runs (tests/conftest.py): fp32, bf16, and the shipped bf16
    config on this CPU ("auto"), with its log."""
    return {
        "fp32": same_seed_runs["fp32"][0],
        "bf16": same_seed_runs["bf16"][0],
        "auto": same_seed_runs["auto"][0],
        "auto_log": same_seed_runs["auto"][1].stdout + same_seed_runs["auto"][1].stderr,
    }


def test_bf16_is_really_bf16(runs):
    cfg = json.loads((runs["bf16"] / "config.json").read_text())
    assert cfg["ds_config"]["bf16"]["enabled"] is True


def test_bf16_tracks_fp32(runs):
    a = read_metrics(runs["fp32"], "train")
    b = read_metrics(runs["bf16"], "train")
    assert a[0]["loss"] != b[0]["loss"]  # a different precision really ran
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=2e-2)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=0.1)
    assert b[-1]["loss"] < b[0]["loss"]
    va, vb = read_metrics(runs["fp32"], "val")[-1], read_metrics(runs["bf16"], "val")[-1]
    assert vb["val_loss"] == pytest.approx(va["val_loss"], rel=2e-2)


def test_no_fast_bf16_means_fp32(runs):
    cfg = json.loads((runs["auto"] / "config.json").read_text())
    assert cfg["ds_config"]["bf16"]["enabled"] is False
    assert cfg["ds_config"]["zero_optimization"]["stage"] == 3
    assert "has no fast bf16: training in fp32" in runs["auto_log"]
