"""Activation checkpointing is a run-config switch: with it on, ZeRO-3 training recomputes the
decoder layers in backward and, in fp32, logs exactly the losses and grad norms of the run
without it (recompute changes memory, never the math)."""

import json

from tests.conftest import read_metrics


def test_recompute_gives_the_same_training(same_seed_runs):
    """The session's fp32 run and the same run with activation checkpointing on (4 steps each,
    tests/conftest.py: same_seed_runs)."""
    (plain_dir, off), (ac_dir, on) = same_seed_runs["fp32"], same_seed_runs["ac"]
    assert "activation checkpointing off" in off.stdout
    assert "activation checkpointing on" in on.stdout
    plain, ac = read_metrics(plain_dir, "train"), read_metrics(ac_dir, "train")
    assert len(plain) == 4
    assert [(r["loss"], r["grad_norm"]) for r in ac] == [(r["loss"], r["grad_norm"]) for r in plain]
    cfg = json.loads((ac_dir / "config.json").read_text())
    assert cfg["run"]["model"]["activation_checkpointing"] is True
