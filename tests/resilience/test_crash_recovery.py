"""Crash recovery on the real engine (2 ranks, ZeRO-3, fp32 on CPU): the whole job is killed
with SIGKILL mid-run (no cleanup, possibly mid-save); the newest checkpoint it left is then
corrupted in place at the same size, as a bad disk would; the same command with
``--resume auto`` says the newest checkpoint is corrupt, falls back to the one before, and from
there logs bitwise the losses, grad norms and learning rates of an uninterrupted run, resuming
at that checkpoint's data position (every sample consumed once)."""

import subprocess
import time

import pytest

from anneal.resilience import checkpoint
from tests.conftest import ROOT, SMALL, env, kill_tree, launch, read_metrics, run_recipe

pytestmark = pytest.mark.slow
STEPS = 8
SAMPLES_PER_STEP = 16  # micro 4 x accumulation 2 x 2 ranks


def _args(data, out):
    return [
        "--out",
        str(out),
        "--data",
        str(data),
        "--max-steps",
        str(STEPS),
        "--save-every",
        "2",
        "--val-every",
        "0",
        *SMALL,
        "--set",
        "train.val_samples=0",
    ]


def _kill_after_step(args, run_dir, step: int, timeout_s: float = 400) -> None:
    """Start the 2-rank job and SIGKILL its whole process group once ``step`` is logged."""
    cmd = launch(2, "recipes/pretrain_tiny.py", *args)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and any(r["step"] >= step for r in read_metrics(run_dir, "train")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it could be killed"
    finally:
        kill_tree(proc)
        proc.wait()


def test_kill_corrupt_and_resume_reproduce_the_uninterrupted_run(stdlib_data, tmp_path):
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    run_recipe(_args(stdlib_data, full), ranks=2, timeout_s=400)
    _kill_after_step(_args(stdlib_data, crashed), crashed, step=5)

    intact = checkpoint.intact_checkpoints(crashed / "checkpoints")
    assert len(intact) >= 2, intact
    newest, previous = intact[-1], intact[-2]
    shard = newest / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(data))

    start = checkpoint.read_manifest(previous)["step"]
    resumed = run_recipe(_args(stdlib_data, crashed), ranks=2, timeout_s=400)
    assert f"checkpoint {newest} is corrupt" in resumed.stderr
    assert f"resumed from {previous} at step {start}" in resumed.stdout
    [event] = [e for e in read_metrics(crashed, "event") if e["event"] == "resume"]
    assert event["step"] == start and event["position"] == start * SAMPLES_PER_STEP

    a = {r["step"]: r for r in read_metrics(full, "train")}
    b = {r["step"]: r for r in read_metrics(crashed, "train")}  # the last row of each step
    assert sorted(b) == list(range(1, STEPS + 1))
    for step in range(start + 1, STEPS + 1):
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert a[step][key] == b[step][key], (step, key)
