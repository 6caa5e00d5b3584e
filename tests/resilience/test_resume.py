"""Exact resume on the real engine: 2 ranks, ZeRO-3, fp32 on CPU. A run of 2N steps and a run
stopped after N steps (a preemption drill) and resumed with ``--resume auto`` log bitwise-equal
losses, grad norms and learning rates at every step after N, and the same validation loss:
model, optimizer, scheduler, data position and RNG all continue. The same with bf16 (run here
on tiny shapes) holds within 1e-3 relative."""

import json

import pytest

from tests.conftest import SMALL, read_metrics, run_recipe

N = 4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def runs(request, stdlib_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"resume-{request.param}")
    precision = ["--set", f"train.precision={request.param}"]
    common = [
        "--data",
        str(stdlib_data),
        "--max-steps",
        str(2 * N),
        "--val-every",
        str(N),
        "--save-every",
        str(N),
        *SMALL,
        *precision,
    ]
    run_recipe(["--out", str(tmp / "full"), *common], ranks=2)
    first = run_recipe(
        ["--out", str(tmp / "split"), *common, "--set", f"train.stop_at_step={N}"], ranks=2
    )
    second = run_recipe(["--out", str(tmp / "split"), *common], ranks=2)
    return tmp / "full", tmp / "split", first, second, request.param


def test_first_leg_stops_at_n_and_second_resumes(runs):
    _, split, first, second, _ = runs
    assert f"resumed from {split / 'checkpoints' / f'step{N:08d}'} at step {N}" in second.stdout
    events = read_metrics(split, "event")
    assert [e["step"] for e in events if e["event"] == "resume"] == [N]


def test_losses_after_n_are_equal(runs):
    """Bitwise in fp32; within 1e-3 relative in bf16."""
    full, split, *_, precision = runs
    a = {r["step"]: r for r in read_metrics(full, "train")}
    b = {r["step"]: r for r in read_metrics(split, "train")}
    assert sorted(a) == list(range(1, 2 * N + 1)) and sorted(b) == sorted(a)
    rel = 0 if precision == "fp32" else 1e-3
    for step in range(N + 1, 2 * N + 1):
        for key in ("loss", "grad_norm"):
            assert a[step][key] == pytest.approx(b[step][key], rel=rel, abs=0), (step, key)
        assert (a[step]["lr"], a[step]["tokens"]) == (b[step]["lr"], b[step]["tokens"])
    # the data moved on: no step repeats the batch of another
    assert len({a[s]["loss"] for s in a}) == 2 * N


def test_validation_after_resume_is_equal(runs):
    full, split, *_, precision = runs
    va = [r for r in read_metrics(full, "val") if r["step"] == 2 * N]
    vb = [r for r in read_metrics(split, "val") if r["step"] == 2 * N]
    rel = 0 if precision == "fp32" else 1e-3
    assert va and va[0]["val_loss"] == pytest.approx(vb[0]["val_loss"], rel=rel, abs=0)


def test_checkpoints_have_manifests_and_latest(runs):
    full, *_ = runs
    ckpt = full / "checkpoints"
    assert (ckpt / "latest").read_text() == f"step{2 * N:08d}"
    for step in (N, 2 * N):
        manifest = json.loads((ckpt / f"step{step:08d}" / "manifest.json").read_text())
        assert manifest["step"] == step and manifest["world_size"] == 2
        names = set(manifest["files"])
        for r in (0, 1):  # one optimizer shard per rank (bf16_ prefixed with bf16)
            assert any(n.endswith(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for n in names)


def test_metric_rows_follow_the_contract(runs):
    full, *_ = runs
    train = read_metrics(full, "train")
    for row in train:
        assert {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(row)
    tokens_per_step = train[0]["tokens"]
    assert [r["tokens"] for r in train] == [tokens_per_step * s for s in range(1, 2 * N + 1)]
    config = json.loads((full / "config.json").read_text())
    assert tokens_per_step == config["ds_config"]["train_batch_size"] * 64
    for row in read_metrics(full, "val"):
        assert {"val_loss", "val_ppl", "val_bpb"} <= set(row)
