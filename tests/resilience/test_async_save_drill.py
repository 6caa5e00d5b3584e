"""Asynchronous saves end to end (one rank, ZeRO-3, fp32 on CPU, the real recipe), against the
suite's shared ``fp32`` run, which never stopped (same seed, data and shape; it saved only at
its end). One run directory, three launches that save every step in the background:

1. **Crash in flight.** SIGKILL (``kill@step=3``, 2 s into that step) while the write of step
   2 is in flight (``save_slow``: the next file 60 s away): step 2's tag has no manifest, and the
   newest intact checkpoint, the one resume chooses, is step 1.
2. **Preemption in flight.** The same command resumes from step 1 (the half-written tag is
   never chosen); SIGUSR1 comes while the write of step 2 is held 4 s: the run waits for it,
   commits it (and, at a step after it, saves that step too) and exits 75; the checkpoint the
   ``preempt`` event names is intact.
3. **A full disk.** The same command resumes from there, and every step after it gives bitwise
   the losses, grad norms and learning rates of the run that never stopped; each
   ``checkpoint`` event follows its ``snapshot`` and carries the seconds the loop waited and
   the write took. The write of step 4, the last, fails with ENOSPC (``save_fail``): the end of
   the run waits for it, and the run stops (exit 2) with one paragraph that names rank 0, the
   file and the error; the checkpoint before stays the newest, verified.

Slow: three 1-rank launches (the reference is the shared run), 27 s for the three here on
2026-12-07 at load average 3 (60 s at load 9), 6 s of it the faults' held writes."""

from __future__ import annotations

import signal

import pytest

from anneal.resilience import checkpoint
from anneal.rundir import read_metrics
from tests.conftest import SMALL, run_recipe, signal_recipe_when

pytestmark = pytest.mark.slow


def _args(data, out) -> list[str]:
    """The shared ``fp32`` run's arguments (tests/conftest.py), saving every step, async."""
    same_seed = ["--max-steps", "4", "--val-every", "2", *SMALL, "--set", "train.log_every=2"]
    return [
        *("--out", str(out), "--data", str(data), *same_seed),
        *("--save-every", "1", "--set", "train.async_save=true"),
    ]


def _since_last_resume(out) -> list[dict]:
    """The rows of the launch that resumed last ([] before its resume event)."""
    rows = read_metrics(out)
    starts = [i for i, r in enumerate(rows) if r.get("event") == "resume"]
    return rows[starts[-1] :] if starts else []


def _preempt_while_step_2_is_written(data, out):
    """Launch 2: SIGUSR1 once step 2 is logged, while its write is held 4 s."""

    def step_2_logged() -> bool:
        rows = _since_last_resume(out) if (out / "metrics.jsonl").exists() else []
        return any(r["kind"] == "train" and r["step"] == 2 for r in rows)

    done, _ = signal_recipe_when(
        _args(data, out),
        step_2_logged,
        signal.SIGUSR1,
        extra_env={"ANNEAL_FAULTS": "save_slow@step=2:s=4"},
    )
    return done.returncode, done.stderr


def test_crash_preemption_and_a_full_disk_during_background_writes(
    tiny_data, same_seed_runs, tmp_path
):
    full = {r["step"]: r for r in read_metrics(same_seed_runs["fp32"][0], "train")}
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    killed = run_recipe(
        _args(tiny_data, out),
        check=False,
        # the kill waits 2 s: the background write copies the state before its first file
        extra_env={"ANNEAL_FAULTS": "save_slow@step=2:s=60,slow_rank@step=3:s=2,kill@step=3"},
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert checkpoint.intact_checkpoints(ckpt) == [ckpt / "step00000001"]
    half = ckpt / "step00000002"
    assert half.is_dir() and checkpoint.read_manifest(half) is None
    assert any(half.iterdir())  # what the save had written (DeepSpeed's script, a file, a part)

    code, err = _preempt_while_step_2_is_written(tiny_data, out)
    assert code == 75, err[-3000:]
    [preempt] = [r for r in _since_last_resume(out) if r.get("event") == "preempt"]
    k = preempt["step"]
    assert k in (2, 3) and preempt["path"] == str(ckpt / f"step{k:08d}")
    assert checkpoint.intact_checkpoints(ckpt)[-1] == ckpt / f"step{k:08d}"
    assert checkpoint.damaged_files(ckpt / "step00000002") == []

    resumed = run_recipe(
        _args(tiny_data, out),
        check=False,
        extra_env={"ANNEAL_FAULTS": "save_slow@s=2,save_fail@step=4"},
    )
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert f"resumed from {ckpt / f'step{k:08d}'} at step {k}" in resumed.stdout
    after = _since_last_resume(out)
    trained = {r["step"]: r for r in after if r["kind"] == "train"}
    assert sorted(trained) == list(range(k + 1, 5))
    for step, row in trained.items():
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert row[key] == full[step][key], (step, key)

    events = [
        (r["event"], r["step"]) for r in after if r.get("event") in ("snapshot", "checkpoint")
    ]
    expected = [e for s in range(k + 1, 4) for e in (("snapshot", s), ("checkpoint", s))]
    assert events == [*expected, ("snapshot", 4)], events
    committed = [r for r in after if r.get("event") == "checkpoint"]
    assert all(r["asynchronous"] and r["write_s"] >= 2.0 for r in committed)
    assert all(0 < r["blocking_s"] < r["write_s"] for r in committed)
    if k == 2:  # step 3's write was held 2 s: step 4's save waited for it
        assert "| checkpoint step00000003 | the loop waited" in resumed.stdout
        assert "the background write of step 3 is still in progress; waiting" in resumed.stderr

    tag4 = ckpt / "step00000004"
    message = " ".join(resumed.stderr.split())
    assert f"the asynchronous save of step 4 ({tag4}) failed in its background write" in message
    assert f"rank 0: {tag4}/" in message and "No space left on device" in message
    assert message.count("failed in its background write") == 1
    assert checkpoint.intact_checkpoints(ckpt)[-1] == ckpt / "step00000003"
    assert not tag4.exists() and (ckpt / "latest").read_text() == "step00000003"
    assert checkpoint.damaged_files(ckpt / "step00000003") == []
