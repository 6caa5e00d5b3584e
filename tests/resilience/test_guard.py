"""The spike guard and fault injection.

Fast: the default thresholds pass 3000 steps of a noisy, heavy-tailed training curve (its fast
start included) without a false alarm and flag a 1.5x jump; a run whose loss has never been
finite stops after 3 steps (or at its last, or when guard.max_rewinds would stop it) with a
message of its own, while one finite loss leaves the usual limits; a resume moves the data
position past recorded skips and re-applies the LR scale; ANNEAL_FAULTS parses and rejects bad
specs.

End to end (real runs, 1 rank, ZeRO-3 fp32 on CPU): a NaN loss leaves the weights unchanged
(ZeRO skips the step; checked against a fingerprint of the parameters), is logged, and training
goes on; a bad sample makes a spike that rewinds to the previous checkpoint and skips exactly the
samples from that checkpoint to the spike plus the margin, after which the loss is sane, and
resumed on 2 ranks from a later checkpoint in a directory of its own, the guard's record (loss
history, incidents, skips, LR scale) and the steps after are the uninterrupted run's; with
ZeRO stage 0 (no overflow check) a NaN update is applied and the guard rewinds instead; repeated
spikes stop the run after guard.max_rewinds with a message naming steps and samples; a 2-step
run whose loss is NaN from the first step exits 2 with the never-finite paragraph.
"""

import json
import math
import random

import pytest
import torch

from anneal.config.run import GuardConfig
from anneal.errors import UserError
from anneal.resilience import faults
from anneal.resilience.guard import Guard
from anneal.train.observers import Observer
from tests.conftest import SMALL, read_metrics, run_recipe


class Sink(Observer):
    """The run's observers, as far as the guard tells them: its events, kept."""

    def __init__(self):
        self.rows = []

    def on_event(self, step, event, **fields):
        self.rows.append({"step": step, "event": event, **fields})


class StepEngine:
    def __init__(self, applied, grad_norm):
        self.applied, self.grad_norm = applied, grad_norm

    def was_step_applied(self):
        return self.applied

    def get_global_grad_norm(self):
        return self.grad_norm


def check(guard, step, loss, sink, applied=True, grad_norm=1.0, **kwargs):
    row = {"step": step, "loss": loss}
    engine = StepEngine(applied, grad_norm)
    return guard.check(row, engine, samples=(step * 8, step * 8 + 8), events=sink, **kwargs)


def test_default_thresholds_ignore_noise_and_catch_a_spike(tmp_path):
    rng = random.Random(0)
    guard, sink = Guard(GuardConfig(), run_dir=tmp_path, resuming=False), Sink()
    for step in range(1, 3001):
        clean = 2.5 + 8.0 * math.exp(-step / 150)
        noise = rng.gauss(0, 0.03) * clean
        if rng.random() < 0.01:  # heavy tail: an occasional hard batch
            noise = abs(noise) * 4
        assert check(guard, step, clean + noise, sink) == "ok", step
    assert check(guard, 3001, 1.5 * 2.5, sink) == "rewind"
    assert check(guard, 3002, float("nan"), sink, applied=False) == "skipped"
    assert check(guard, 3003, 2.5, sink, grad_norm=float("inf"), applied=True) == "rewind"
    assert check(guard, 3004, 2.5, sink, grad_norm=None) == "ok"  # no norm without ZeRO
    assert [r["event"] for r in sink.rows] == ["spike", "spike", "skip", "spike"]


def test_max_rewinds_within_the_span(tmp_path):
    cfg = GuardConfig(min_history=2, max_rewinds=2, span_steps=100)
    guard, sink = Guard(cfg, run_dir=tmp_path, resuming=False), Sink()
    for step in range(1, 5):
        check(guard, step, 3.0, sink)
    check(guard, 5, 30.0, sink)
    check(guard, 200, 30.0, sink)  # outside the span of the first
    check(guard, 201, 30.0, sink)
    with pytest.raises(UserError, match=r"3 loss spikes .* step 200 .* samples \[1600, 1608\)"):
        check(guard, 202, 30.0, sink)


def test_a_loss_never_finite_stops_the_run_with_its_own_message(tmp_path):
    """No finite loss since the first step: stopped after NEVER_FINITE_STEPS (3) steps, at the
    run's last step if that comes first, or as soon as guard.max_rewinds would stop it, with
    a paragraph that says the start is the cause, not a spike; guard.json records the steps."""
    nan = float("nan")
    guard, sink = Guard(GuardConfig(), run_dir=tmp_path, resuming=False), Sink()
    for step in (1, 2):
        assert check(guard, step, nan, sink, applied=False, grad_norm=nan) == "skipped"
    with pytest.raises(UserError, match=r"never been finite .* \(steps 1 to 3\)") as e:
        check(guard, 3, nan, sink, applied=False, grad_norm=nan)
    assert "not the LR" in str(e.value) and e.value.every_rank and "\n" not in str(e.value)
    assert len(json.loads((tmp_path / "guard.json").read_text())["incidents"]) == 3

    short = Guard(GuardConfig(), run_dir=tmp_path, resuming=False)  # a run of one step
    with pytest.raises(UserError, match=r"never been finite .* \(step 1\)"):
        check(short, 1, nan, sink, applied=False, last=True)
    strict = Guard(GuardConfig(max_rewinds=1), run_dir=tmp_path, resuming=False)
    check(strict, 1, float("inf"), sink, applied=False)
    with pytest.raises(UserError, match=r"never been finite .* \(steps 1 to 2\)"):
        check(strict, 2, float("inf"), sink, applied=False)  # not "2 loss spikes"


def test_one_finite_loss_and_the_usual_limits_apply(tmp_path):
    """A finite loss once (even with an infinite grad norm, or in the history a resume restores)
    and later non-finite steps are spikes as before: skipped, then guard.max_rewinds."""
    nan = float("nan")
    guard, sink = Guard(GuardConfig(), run_dir=tmp_path, resuming=False), Sink()
    assert check(guard, 1, 5.0, sink, applied=False, grad_norm=float("inf")) == "skipped"
    for step in (2, 3):
        assert check(guard, step, nan, sink, applied=False, last=step == 3) == "skipped"
    with pytest.raises(UserError, match="4 loss spikes within 1000 steps"):
        check(guard, 4, nan, sink, applied=False)
    (tmp_path / "r").mkdir()
    resumed = Guard(GuardConfig(), run_dir=tmp_path / "r", resuming=False)
    resumed.restore(FakeEngine(), {"guard": {"history": [[6, 8.4]]}}, 48)
    for step in (7, 8, 9):
        assert check(resumed, step, nan, sink, applied=False) == "skipped"


class FakeScheduler:
    def __init__(self):
        self.peak_lrs = [1.0, 1.0]

    def scale_peak(self, factor):
        self.peak_lrs = [lr * factor for lr in self.peak_lrs]


class FakeEngine:
    lr_scheduler = FakeScheduler()


def test_a_resume_skips_what_a_rewind_skipped(tmp_path):
    # the rewind was logged to guard.json after the checkpoint at position 48 was written
    log = {"incidents": [], "skipped": [[48, 64]], "lr_scale": 0.5, "history": []}
    (tmp_path / "guard.json").write_text(json.dumps(log))
    guard = Guard(GuardConfig(), run_dir=tmp_path, resuming=True)
    engine = FakeEngine()
    client = {"guard": {"history": [[6, 8.4]], "skipped": [], "lr_scale": 1.0}}
    assert guard.restore(engine, client, 48) == 64
    assert engine.lr_scheduler.peak_lrs == [0.5, 0.5]
    assert guard.history == [(6, 8.4)]
    assert guard.skip_past(40) == 40 and guard.skip_past(63) == 64
    assert Guard(GuardConfig(), run_dir=tmp_path, resuming=False).skipped == []


def test_fault_specs():
    parsed = faults.parse("nan_loss@step=30,spike@step=40:x=50,kill@step=55,slow_rank@rank=1:s=5")
    assert [f.kind for f in parsed] == ["nan_loss", "spike", "kill", "slow_rank"]
    assert parsed[1].x == 50 and parsed[3].rank == 1 and parsed[3].s == 5
    assert faults.parse("spike@sample=7")[0].sample == 7
    for bad in ("boom@step=1", "spike@x=5", "kill@rank=1", "nan_loss@step=x", "spike@when=1"):
        with pytest.raises(UserError, match="ANNEAL_FAULTS"):
            faults.parse(bad)


def _args(data, out, *extra):
    return [
        "--out",
        str(out),
        "--data",
        str(data),
        "--max-steps",
        "10",
        "--save-every",
        "2",
        "--val-every",
        "0",
        *SMALL,
        "--set",
        "train.val_samples=0",
        "--set",
        "guard.min_history=3",
        *extra,
    ]


def _run(data, out, spec, *extra, check=True):
    args = _args(data, out, *extra)
    return run_recipe(args, timeout_s=400, check=check, extra_env={"ANNEAL_FAULTS": spec})


def _events(run_dir, name):
    return [e for e in read_metrics(run_dir, "event") if e["event"] == name]


def _guard_record(tag_dir) -> dict:
    """The guard's record in a checkpoint's client state (rank 0's model states)."""
    [states] = sorted(tag_dir.glob("zero_pp_rank_0_*model_states.pt"))
    return torch.load(states, weights_only=False)["guard"]


@pytest.mark.slow
def test_nan_is_skipped_and_a_bad_sample_is_rewound_and_skipped(stdlib_data, tmp_path):
    """Then the run's step-8 checkpoint (after the rewind) resumed on 2 ranks in a directory of
    its own, so that the guard's record can only come from the checkpoint, through DeepSpeed's
    universal checkpoint: the record at step 10 (loss history, incidents, skipped samples, LR
    scale) is the uninterrupted run's, and so are steps 9-10 (the data position past the skip,
    the halved LR, the losses within 1e-5). About 20 s more for the 2-rank leg."""
    # 8 samples per step on 1 rank: step 3 reads samples [16, 24), step 7 reads [48, 56)
    run = tmp_path / "run"
    done = _run(stdlib_data, run, "nan_loss@step=3,spike@sample=50", "--set", "guard.lr_scale=0.5")
    assert "fault: nan_loss at step 3: weights unchanged on rank 0" in done.stderr
    spikes = _events(run, "spike")
    assert [(s["step"], s["reason"], s["action"]) for s in spikes] == [
        (3, "nonfinite", "skipped"),
        (7, "loss", "rewind"),
    ]
    assert spikes[0]["update_applied"] is False and spikes[0]["samples"] == [16, 24]
    [rewind] = _events(run, "rewind")
    assert rewind["to_step"] == 6 and rewind["checkpoint"].endswith("step00000006")
    skips = [(s["step"], s["samples"]) for s in _events(run, "skip")]
    assert skips == [(3, [16, 24]), (7, [48, 64])]  # checkpoint position -> spike + 1 step
    assert "guard: rewound to step00000006 (step 6); skipping samples [48, 64)" in done.stdout
    rows = {r["step"]: r for r in read_metrics(run, "train")}  # the last row of each step
    assert sorted(rows) == list(range(1, 11))
    assert all(math.isfinite(rows[s]["loss"]) for s in range(4, 11))
    assert rows[10]["loss"] < rows[2]["loss"] < 10
    guard_log = json.loads((run / "guard.json").read_text())
    assert guard_log["skipped"] == [[48, 64]]
    assert guard_log["lr_scale"] == 0.5
    # Resumed on 2 ranks (4 samples a rank, no accumulation: 8 a step as before) elsewhere.
    tag = run / "checkpoints" / "step00000008"
    resumed = run_recipe(
        [
            *_args(stdlib_data, tmp_path / "moved"),
            *("--set", "ds.gradient_accumulation_steps=1", "--resume", str(tag)),
        ],
        ranks=2,
        timeout_s=400,
    )
    assert "step00000008 was saved on 1 rank, ZeRO-3; this launch is 2 ranks" in resumed.stderr
    after = {r["step"]: r for r in read_metrics(tmp_path / "moved", "train")}
    assert sorted(after) == [9, 10]
    for step in (9, 10):
        for key in ("loss", "grad_norm"):
            assert after[step][key] == pytest.approx(rows[step][key], rel=1e-5), (step, key)
        assert after[step]["lr"] == pytest.approx(rows[step]["lr"], rel=1e-9)
        assert after[step]["tokens"] == rows[step]["tokens"]
    got = _guard_record(tmp_path / "moved" / "checkpoints" / "step00000010")
    want = _guard_record(run / "checkpoints" / "step00000010")
    assert got["skipped"] == want["skipped"] == [(48, 64)]
    assert got["lr_scale"] == want["lr_scale"] == 0.5
    assert got["incidents"] == want["incidents"] and len(want["incidents"]) == 2
    assert [s for s, _ in got["history"]] == [s for s, _ in want["history"]]
    assert [x for _, x in got["history"]] == pytest.approx(
        [x for _, x in want["history"]], rel=1e-5
    )


@pytest.mark.slow
def test_applied_nan_rewinds_and_repeated_spikes_stop(stdlib_data, tmp_path):
    done = _run(
        stdlib_data,
        tmp_path,
        "nan_loss@sample=20,spike@step=7",
        "--set",
        "ds.zero_optimization.stage=0",
        "--set",
        "guard.max_rewinds=2",
        check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "fault: nan_loss at step 3: weights CHANGED on rank 0" in done.stderr
    actions = [(s["step"], s["reason"], s["action"]) for s in _events(tmp_path, "spike")]
    assert actions == [(3, "nonfinite", "rewind"), (7, "loss", "rewind"), (7, "loss", "rewind")]
    assert [r["to_step"] for r in _events(tmp_path, "rewind")] == [2, 6]
    assert "guard: 3 loss spikes within 1000 steps, more than guard.max_rewinds=2" in done.stderr
    assert "step 3 (nonfinite, samples [16, 24), rewind)" in done.stderr
    # the rewind to step 2 skipped [16, 32): step 7 now reads [64, 72), and after the
    # second rewind (skipping [64, 80)) [80, 88)
    assert "step 7 (loss, samples [64, 72), rewind); step 7 (loss, samples [80, 88)" in done.stderr


@pytest.mark.slow
def test_a_run_whose_loss_is_never_finite_stops_with_exit_2(tiny_data, tmp_path):
    """Every step's loss NaN from the first (the fault hook's ``nan_loss`` at steps 1 and 2 of a
    2-step run): the run stops at its last step with the paragraph and exit 2, before that
    step's checkpoint, instead of ending with "final train loss nan" and a checkpoint. Slow:
    one recipe run in a process of its own, about 20 s here."""
    spec = "nan_loss@step=1,nan_loss@step=2"
    done = _run(tiny_data, tmp_path, spec, "--max-steps", "2", check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the loss has never been finite in this run" in done.stderr
    assert "(steps 1 to 2)" in done.stderr and "Traceback" not in done.stderr
    assert "final train loss" not in done.stdout
    assert not (tmp_path / "checkpoints" / "step00000002").exists()
    spikes = [(s["step"], s["action"]) for s in _events(tmp_path, "spike")]
    assert spikes == [(1, "skipped"), (2, "skipped")]
