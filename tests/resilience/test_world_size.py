"""Resume on another number of ranks (ZeRO-1, 2 and 3, fp32 on CPU, the same global batch): a
checkpoint written by 2 ranks resumes on 1 and one written by 1 resumes on 2, with ``--resume
auto``, through DeepSpeed's universal checkpoint (converted once under the resuming run's
``checkpoints/.universal/``, never in the tag directory, and removed by the run's next save).
The losses and grad norms after the resume match a run that never changed its world size
(within 1e-5 relative: only the order of the reductions differs); at ZeRO-1/2, and at ZeRO-3
where the resume runs on one rank as the reference does, so does the AdamW state (master
weights, moments, step, each group's hyperparameters: the state the resume loaded, stepped as
often as the reference's); the data position is kept, and the no-decay param group still has
weight decay 0 after the load (DeepSpeed 0.19.8's ZeRO-3 universal load copies the first
group's hyperparameters into every group, and shares one Adam step counter between
sub-groups, which would show in the losses). A 2 -> 1 resume then goes back to 2 ranks from
its own save (converted again: DeepSpeed #7546) and matches again, the AdamW state too at
ZeRO-2: that leg is the 1 -> 2 case (at ZeRO-1, whose optimizer state and universal load are
ZeRO-2's, the case stops after 2 -> 1). About 35 s a case here (80 s in `make test-all`), each
three launches and two conversions, and 10 s for each stage's reference.
ZeRO-2 -> ZeRO-3 -> ZeRO-2 on 2 ranks matches the same way; a move to no ZeRO is refused
before anything starts and leaves the run's files as they were."""

import json

import pytest

from tests.conftest import SMALL_OWN_BATCH, read_metrics, run_recipe, tree
from tests.zero_state import adam_state, assert_same_adam_state, assert_same_zero3_state

pytestmark = pytest.mark.slow
N = 4


def _args(data, out, ranks, stage, *extra):
    accum = 4 // ranks  # 16 samples per step whatever the number of ranks (micro-batch 4)
    return [
        "--out",
        str(out),
        "--data",
        str(data),
        "--max-steps",
        str(3 * N),
        "--save-every",
        str(N),
        "--val-every",
        "0",
        *SMALL_OWN_BATCH,
        "--set",
        "train.val_samples=0",
        "--set",
        f"ds.gradient_accumulation_steps={accum}",
        "--set",
        f"ds.zero_optimization.stage={stage}",
        *extra,
    ]


REFERENCES = {}


def reference(data, tmp_path_factory, stage):
    """The run that never stopped, on one rank, at ``stage``: made once per stage."""
    if stage not in REFERENCES:
        out = tmp_path_factory.mktemp("ws") / f"ref{stage}"
        run_recipe(_args(data, out, 1, stage), ranks=1, timeout_s=400)
        REFERENCES[stage] = out
    return REFERENCES[stage]


def assert_same_adam_state_at_3n(run_dir, ref_dir):
    """``assert_same_adam_state`` at step 3N, of a run whose state was loaded at step N and
    stepped 2N times since (its Adam step counted from there)."""
    want = adam_state(ref_dir, 3 * N)
    for g in want:
        g["step"] = [2.0 * N]
    got = adam_state(run_dir, 3 * N)
    for g in got:
        g["step"] = [s - N for s in g["step"]]
    assert_same_adam_state(got, want, step=2.0 * N, moved=2 * N)


@pytest.mark.parametrize("stage", [3, 2, 1])
def test_resume_on_another_number_of_ranks(stdlib_data, tmp_path, tmp_path_factory, stage):
    """2 ranks at ``stage`` to step N, 1 rank to 2N, 2 ranks to 3N: 2 -> 1 and then 1 -> 2
    from a save made after a universal load (#7546); at ZeRO-1, 2 -> 1 only."""
    before, after = 2, 1
    ref_dir = reference(stdlib_data, tmp_path_factory, stage)
    ref = {r["step"]: r for r in read_metrics(ref_dir, "train")}
    stop = ["--set", f"train.stop_at_step={N}"]
    run_recipe(_args(stdlib_data, tmp_path, before, stage, *stop), ranks=before, timeout_s=400)
    stop = ["--set", f"train.stop_at_step={2 * N}", "--resume", "auto"]
    args = _args(stdlib_data, tmp_path, after, stage, *stop)
    done = run_recipe(args, ranks=after, timeout_s=400)
    tag = tmp_path / "checkpoints" / f"step{N:08d}"
    assert f"resumed from {tag} at step {N}" in done.stdout
    # announced once, as INFO: the routine path (issue 46); the load names its folder only
    assert done.stderr.count(f"resume: step{N:08d} was saved on") == 1, done.stderr
    assert f"INFO anneal.train.entry: resume: step{N:08d}" in done.stderr
    assert not [ln for ln in done.stderr.splitlines() if "WARNING" in ln and "universal" in ln]
    rank_s = {1: "rank", 2: "ranks"}
    assert (
        f"resume: step{N:08d} was saved on {before} {rank_s[before]}, ZeRO-{stage}; this launch "
        f"is {after} {rank_s[after]}, ZeRO-{stage}: it is converted once" in done.stderr
    )
    cache = tmp_path / "checkpoints" / ".universal"
    assert f"loading its universal form {cache}/step{N:08d}-" in done.stderr
    assert not (tag / "universal").exists() and not (tag / "zero").exists()
    # the step-8 save removed it: a resume takes step 8, saved at this layout
    assert f"this run has saved step {2 * N} since" in done.stderr
    assert [p for p in cache.iterdir() if p.is_dir()] == []
    assert "param groups after the universal load: weight_decay [0.1, 0.0]" in done.stderr
    [resume] = [e for e in read_metrics(tmp_path, "event") if e["event"] == "resume"]
    assert resume["position"] == N * 16
    rows = {r["step"]: r for r in read_metrics(tmp_path, "train")}
    for step in range(N + 1, 2 * N + 1):
        assert rows[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
        assert rows[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5), step
        assert rows[step]["lr"] == pytest.approx(ref[step]["lr"], rel=1e-9), step
        assert rows[step]["tokens"] == ref[step]["tokens"]
    if stage < 3:  # the optimizer at step 2N: what the resume loaded, stepped N times
        got, want = adam_state(tmp_path, 2 * N), adam_state(ref_dir, 2 * N)
        assert_same_adam_state(got, want, step=2.0 * N, moved=2 * N)
    else:  # on one rank, as the reference: the same files
        tag = f"step{2 * N:08d}"
        assert_same_zero3_state(tmp_path / "checkpoints" / tag, ref_dir / "checkpoints" / tag)
    if stage == 1:  # ZeRO-1's optimizer state is ZeRO-2's (the same partitions, the same
        return  # universal load): the way back is run at ZeRO-2 and ZeRO-3, not a third time
    # Back to the first layout from the step-2N checkpoint, saved after a universal load
    # (DeepSpeed #7546: after a ZeRO-3 load with load_universal on, the next save held rank 0's
    # model states only and the converters failed on it): it converts and resumes again.
    back = run_recipe(
        _args(stdlib_data, tmp_path, before, stage, "--resume", "auto"), ranks=before, timeout_s=400
    )
    assert f"loading its universal form {cache}/step{2 * N:08d}-" in back.stderr
    assert (
        f"resume: step{2 * N:08d} was saved on 1 rank, ZeRO-{stage}; this launch is 2 ranks, "
        f"ZeRO-{stage}: it is converted once" in back.stderr
    )
    rows = {r["step"]: r for r in read_metrics(tmp_path, "train")}
    for step in range(2 * N + 1, 3 * N + 1):
        assert rows[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
        assert rows[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5), step
    if stage < 3:  # and the optimizer after the 1 -> 2 resume, stepped N times
        assert_same_adam_state_at_3n(tmp_path, ref_dir)


def test_resume_at_zero_3_then_back_at_zero_2(stdlib_data, tmp_path, tmp_path_factory):
    """ZeRO-2 on 2 ranks to step N, ZeRO-3 on 2 ranks to 2N, ZeRO-2 again to 3N: each move
    through the universal checkpoint, which ``universal_stages.either_stage`` makes loadable at both
    stages (bench/repro/zero_stage_universal.py shows DeepSpeed 0.19.8 failing without it).
    The losses and grad norms of steps N+1..3N match the ZeRO-2 run that never stopped, and so
    does the AdamW state at step 3N, after both moves. Three 2-rank launches, about 60 s."""
    ref_dir = reference(stdlib_data, tmp_path_factory, 2)
    ref = {r["step"]: r for r in read_metrics(ref_dir, "train")}
    cache = tmp_path / "checkpoints" / ".universal"
    for stage, stop in ((2, N), (3, 2 * N), (2, 3 * N)):
        args = _args(stdlib_data, tmp_path, 2, stage, "--set", f"train.stop_at_step={stop}")
        done = run_recipe([*args, "--resume", "auto"], ranks=2, timeout_s=400)
        if stop == N:
            continue
        saved = 5 - stage
        assert (
            f"resume: step{stop - N:08d} was saved on 2 ranks, ZeRO-{saved}; this launch is 2 "
            f"ranks, ZeRO-{stage}: it is converted once" in done.stderr
        )
        assert f"loading its universal form {cache}/step{stop - N:08d}-" in done.stderr
        assert "param groups after the universal load: weight_decay [0.1, 0.0]" in done.stderr
    rows = {r["step"]: r for r in read_metrics(tmp_path, "train")}
    for step in range(N + 1, 3 * N + 1):
        assert rows[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
        assert rows[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5), step
        assert rows[step]["lr"] == pytest.approx(ref[step]["lr"], rel=1e-9), step
    assert_same_adam_state_at_3n(tmp_path, ref_dir)


def test_a_move_to_no_zero_is_refused_and_changes_nothing(stdlib_data, tmp_path_factory):
    """Before any process group or engine exists: the stage the checkpoint was saved at (its
    manifest's ``zero_stage``), the one that works, and not one file of the run changed."""
    run = reference(stdlib_data, tmp_path_factory, 2)
    manifest = json.loads((run / "checkpoints" / f"step{2 * N:08d}" / "manifest.json").read_text())
    assert manifest["zero_stage"] == 2
    before = tree(run)
    args = _args(stdlib_data, run, 1, 0, "--resume", "auto", "--max-steps", str(4 * N))
    done = run_recipe(args, ranks=1, check=False)
    assert done.returncode != 0
    assert "ds.zero_optimization.stage=2" in done.stderr + done.stdout
    assert "--init-from" in done.stderr + done.stdout
    assert tree(run) == before
