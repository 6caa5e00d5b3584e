"""Activation checkpointing is a run-config switch: with it on, ZeRO-3 training recomputes the
decoder layers in backward and, in fp32, logs exactly the losses and grad norms of the run
without it (recompute changes memory, never the math)."""

import json

from tests.conftest import SMALL, read_metrics, run_recipe


def test_recompute_gives_the_same_training(tiny_data, tmp_path):
    common = [
        "--data",
        str(tiny_data),
        "--max-steps",
        "3",
        "--eval-every",
        "3",
        "--save-every",
        "0",
        *SMALL,
    ]
    off = run_recipe(["--out", str(tmp_path / "plain"), *common])
    on = run_recipe(
        ["--out", str(tmp_path / "ac"), *common, "--set", "model.activation_checkpointing=true"]
    )
    assert "activation checkpointing off" in off.stdout
    assert "activation checkpointing on" in on.stdout
    plain, ac = read_metrics(tmp_path / "plain", "train"), read_metrics(tmp_path / "ac", "train")
    assert [(r["loss"], r["grad_norm"]) for r in ac] == [(r["loss"], r["grad_norm"]) for r in plain]
    cfg = json.loads((tmp_path / "ac" / "config.json").read_text())
    assert cfg["run"]["model"]["activation_checkpointing"] is True
