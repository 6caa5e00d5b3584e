"""Asynchronous saves end to end (one rank, ZeRO-3, fp32 on CPU, the real recipe), against the
suite's shared ``fp32`` run, which never stopped (same seed, data and shape; it saved only at
its end):

1. A run saving every step in the background is killed with SIGKILL (``kill@step=3``) while the
   write of step 2 is in flight (``save_slow``: one file on disk, the next one 60 s away): step
   2's tag has no manifest, and the newest intact checkpoint, the one resume chooses, is step 1.
2. The same command resumes from step 1 (the half-written tag is never chosen), and steps 2 to 4
   give bitwise the losses, grad norms and learning rates of the run that never stopped. Step
   3's write is held 2 s, so step 4's save waits for it and says so; each ``checkpoint`` event
   follows its ``snapshot`` and carries the seconds the loop waited and the write took. The
   write of step 4 fails with ENOSPC (``save_fail``, as on a full disk): the end of the run
   waits for it, and the run stops (exit 2) with one paragraph that names rank 0, the file and
   the error; step 3 stays the newest checkpoint and verifies.

Slow: two launches of about 10 s each here (the reference is the shared run)."""

from __future__ import annotations

import signal

import pytest

from anneal.resilience import checkpoint
from anneal.rundir import read_metrics
from tests.conftest import SMALL, run_recipe

pytestmark = pytest.mark.slow


def _args(data, out) -> list[str]:
    """The shared ``fp32`` run's arguments (tests/conftest.py), saving every step, async."""
    same_seed = ["--max-steps", "4", "--val-every", "2", *SMALL, "--set", "train.log_every=2"]
    return [
        *("--out", str(out), "--data", str(data), *same_seed),
        *("--save-every", "1", "--set", "train.async_save=true"),
    ]


def test_crash_in_flight_resume_and_a_full_disk(tiny_data, same_seed_runs, tmp_path):
    full = {r["step"]: r for r in read_metrics(same_seed_runs["fp32"][0], "train")}
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    killed = run_recipe(
        _args(tiny_data, out),
        check=False,
        extra_env={"ANNEAL_FAULTS": "save_slow@step=2:s=60,kill@step=3"},
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert checkpoint.intact_checkpoints(ckpt) == [ckpt / "step00000001"]
    assert (ckpt / "step00000002").is_dir() and checkpoint.read_manifest(
        ckpt / "step00000002"
    ) is None

    resumed = run_recipe(
        _args(tiny_data, out),
        check=False,
        extra_env={"ANNEAL_FAULTS": "save_slow@step=3:s=2,save_fail@step=4"},
    )
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert f"resumed from {ckpt / 'step00000001'} at step 1" in resumed.stdout
    rows = read_metrics(out)
    start = max(i for i, r in enumerate(rows) if r.get("event") == "resume")
    after = rows[start:]
    trained = {r["step"]: r for r in after if r["kind"] == "train"}
    assert sorted(trained) == [2, 3, 4]
    for step, row in trained.items():
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert row[key] == full[step][key], (step, key)

    events = [
        (r["event"], r["step"]) for r in after if r.get("event") in ("snapshot", "checkpoint")
    ]
    assert events == [
        ("snapshot", 2),
        ("checkpoint", 2),
        ("snapshot", 3),
        ("checkpoint", 3),
        ("snapshot", 4),
    ], events
    [third] = [r for r in after if r.get("event") == "checkpoint" and r["step"] == 3]
    assert third["asynchronous"] is True and third["write_s"] >= 2.0
    assert 0 < third["blocking_s"] < third["write_s"]
    assert "the background write of step 3 is still in progress; waiting for it" in resumed.stderr
    assert "| checkpoint step00000003 | the loop waited" in resumed.stdout

    tag4 = ckpt / "step00000004"
    message = " ".join(resumed.stderr.split())
    assert f"the asynchronous save of step 4 ({tag4}) failed in its background write" in message
    assert f"rank 0: {tag4}/" in message and "No space left on device" in message
    assert message.count("failed in its background write") == 1
    assert checkpoint.intact_checkpoints(ckpt)[-1] == ckpt / "step00000003"
    assert not tag4.exists() and (ckpt / "latest").read_text() == "step00000003"
    assert checkpoint.damaged_files(ckpt / "step00000003") == []
