"""Hostile input to the watcher and to the score documents (issue 41, points 3 and 5).

The watcher (``anneal.eval.watch.Watcher``, called as ``anneal eval RUN --watch`` calls it, with a
scorer that writes ``evals/step-N.json`` as the command does) never deletes or writes through a
link: a ``RUN/evals/.reading`` or ``RUN/evals`` that links elsewhere is refused in one paragraph
and the directory it points to is left byte for byte; a tag that is not named ``stepNNNNNNNN``
(``Documents``) is never scored; under ``.reading`` only what a watcher pinned (its mark) is
removed. ``RUN/evals/step-N.json`` planted by someone else (a FIFO, 100,000 nested ``[``, a
score of 1e308, a string score, a task name with ANSI escapes) is skipped with a warning naming
it by ``anneal report``, ``plot`` and ``compare``: nothing hangs (a 10 s alarm), no traceback,
no escape reaches the terminal, the planted value wins nothing. Each test takes about a second
or less."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from anneal import rundir
from anneal.errors import UserError
from anneal.eval import results, watch
from tests.conftest import tree
from tests.eval.test_eval_see import add_evals, branch, cli, doc, task
from tests.eval.test_eval_watch import Scorer, no_sleep, save, start_run
from tests.observe.test_observe import good_run


@pytest.fixture(autouse=True)
def no_hang():
    """A test that would block (a FIFO opened for reading) fails after 10 s instead."""

    def expired(signum, frame):
        raise TimeoutError("blocked for 10 s: something opened a FIFO or looped")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _other(tmp_path: Path) -> Path:
    """A directory of the user's, outside the run, with a sub-directory named like a tag."""
    other = tmp_path / "home"
    (other / "step00000010").mkdir(parents=True)
    (other / "step00000010" / "thesis.tex").write_text("mine\n")
    (other / ".reading" / "step00000010").mkdir(parents=True)
    (other / ".reading" / "step00000010" / "notes.txt").write_text("mine too\n")
    return other


def test_a_linked_reading_dir_is_refused_and_what_it_names_is_untouched(tmp_path):
    run, other = tmp_path / "run", _other(tmp_path)
    start_run(run, max_steps=10)
    save(run, 10)
    (run / "evals").mkdir()
    (run / "evals" / ".reading").symlink_to(other)
    before, scorer = tree(other), Scorer(run)
    with pytest.raises(UserError) as e:
        watch.Watcher(run, scorer, poll_s=5).run(sleep=no_sleep)
    assert "evals/.reading: a link to" in str(e.value) and "never writes or deletes" in str(e.value)
    assert "\n" not in str(e.value) and e.value.every_rank
    assert tree(other) == before and scorer.seen == []


def test_a_linked_evals_dir_is_refused_by_the_watcher_and_by_the_writer(tmp_path):
    run, other = tmp_path / "run", _other(tmp_path)
    start_run(run, max_steps=10)
    save(run, 10)
    (run / "evals").symlink_to(other)
    before, scorer = tree(other), Scorer(run)
    with pytest.raises(UserError, match=r"evals: a link to .*never writes or deletes"):
        watch.Watcher(run, scorer, poll_s=5).run(sleep=no_sleep)
    with pytest.raises(UserError, match=r"evals: a link to"):  # anneal eval's and the loop's
        results.write(run, {"step": 10, "tokens": 1, "tasks": {}, "failed": {}})
    from anneal.files import real_dir  # where the in-loop tasks are built

    with pytest.raises(UserError, match=r"evals: a link to"):
        real_dir(run, rundir.EVALS, "tasks")
    assert tree(other) == before and scorer.seen == []


def test_only_step_tags_are_scored_and_only_marked_pins_are_removed(tmp_path, caplog):
    """A checkpoint copied in as ``Documents`` is not scored; under a real ``.reading``, a
    folder named ``Documents`` and one named for a tag but without the watcher's mark stay
    (the tag is skipped, naming the folder in the way), a killed watcher's marked pin goes."""
    run = tmp_path / "run"
    start_run(run, max_steps=20)
    save(run, 10)
    save(run, 20)
    (rundir.checkpoints_dir(run) / "step00000020").rename(rundir.checkpoints_dir(run) / "Documents")
    save(run, 20)
    reading = run / "evals" / watch.READING
    for name in ("Documents", "step00000020"):
        (reading / name).mkdir(parents=True)
        (reading / name / "mine.txt").write_text("mine\n")
    (reading / "step00000005").mkdir()
    (reading / "step00000005" / ".anneal-pin").write_text("123\n")  # watch.PIN_MARK
    kept = {k: v for k, v in tree(reading).items() if "step00000005" not in k}
    scorer = Scorer(run)
    w = watch.Watcher(run, scorer, poll_s=5)
    assert w.run(sleep=no_sleep) == "finished"
    assert scorer.seen == [10]
    assert "step00000020" in w.skipped and "is there already" in w.skipped["step00000020"]
    assert "Documents" not in w.skipped
    assert tree(reading) == kept and not (reading / "step00000005").exists()
    assert "Documents: not a watcher's pinned checkpoint: left alone" in caplog.text
    assert watch.PIN_MARK == ".anneal-pin"


PLANTED = {"fifo": 100, "deep": 101, "huge": 102, "string": 103, "ansi": 104}
"""Each planted ``evals/step-N.json``, by its step."""


def _plant(run: Path, kind: str) -> Path:
    """``evals/step-N.json`` of ``kind`` (``PLANTED``)."""
    step = PLANTED[kind]
    path = rundir.eval_path(run, step)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "deep":
        path.write_text("[" * 100_000)
    else:
        metrics = {"huge": {"acc": 1e308}, "string": {"acc": "0.9"}}.get(kind, {"acc": 0.5})
        name = "\x1b[31mhellaswag\x1b[0m" if kind == "ansi" else "hellaswag"
        path.write_text(json.dumps(doc(step, {name: task({**metrics, "acc_stderr": 0.01})})))
    return path


def test_planted_score_documents_are_skipped_with_one_warning_each(tmp_path, capsys, caplog):
    """Beside a good document of step 50: a FIFO, 100,000 nested ``[``, a score of 1e308, a
    string score and a task name with ANSI escapes, each an ``evals/step-N.json``. ``anneal
    report``, ``anneal plot`` and the end of a training run (after its last save) read past
    them: exit 0, one warning naming each, no escape or 1e308 on the terminal, the good score
    shown, the charts drawn. In one run, to keep it to about 4 s."""
    run = add_evals(good_run(tmp_path / "run"), [doc(50, {"hellaswag": task({"acc": 0.3})})])
    paths = [_plant(run, kind) for kind in PLANTED]
    assert [d["step"] for d in rundir.read_evals(run)] == [50, 102, 103, 104]  # values: below
    caplog.clear()
    rc, out, err = cli(capsys, "report", run)
    assert rc == 0 and "\x1b" not in out + err and "1e+308" not in out
    assert "downstream hellaswag" in out and "acc 0.3 at step 50" in out
    for path in paths:
        assert caplog.text.count(f"{path}: skipped, not a score document anneal eval writes") == 1
    rc, out, err = cli(capsys, "plot", run)
    assert rc == 0 and (run / "plots" / "downstream.png").is_file()
    from anneal.observe.report import end_of_run

    end_of_run(run)
    assert (run / "report.txt").read_text().endswith("  no problems\n")


def test_a_planted_huge_score_wins_nothing_in_compare(tmp_path, capsys, caplog):
    """Two cooldown branches (``test_eval_see.branch``): b's planted hellaswag of 1e308 at a
    later step is skipped (one warning, though compare reads the scores twice), and a, 0.40
    against b's 0.43 by its real document, is not beaten by it."""
    parent = good_run(tmp_path / "parent")
    a = branch(tmp_path / "a", parent, val_loss=3.0, hs=0.40, arc=0.50)
    b = branch(tmp_path / "b", parent, val_loss=3.1, hs=0.43, arc=0.47)
    path = rundir.eval_path(b, 120)
    planted = doc(120, {"hellaswag": task({"acc_norm": 1e308, "acc_norm_stderr": 0.01})})
    path.write_text(json.dumps(planted))
    rc, out, err = cli(capsys, "compare", a, b)
    assert rc == 0 and "1e+308" not in out and "inf" not in out
    assert "  hellaswag acc_norm  0.4 ± 0.01   0.43 ± 0.01*" in out.splitlines()
    assert caplog.text.count(f"{path}: skipped") == 1


# -- anneal eval --out and --samples (issue 41, point 4) ---------------------------------------
# ``anneal eval`` (``anneal.cli.evaluate.run_eval``) calls these three checks on its Target,
# after finding the checkpoint and before any engine is built; here they get a Target as
# ``anneal.cli.eval_target.checkpoint_target`` makes it, over a hand-made run.


def _scoring(run: Path, out: Path | None = None, *, data: Path | None = None):
    from anneal.eval.score import Target

    tag = rundir.checkpoints_dir(run) / "step00000002"
    tag = tag if tag.is_dir() else save(run, 2)
    return Target(
        source="checkpoint",
        preset=None,
        ds_config={},
        ds_source="",
        step=2,
        tokens=2000,
        tokenizer_dir=data or run / "tokenizer",
        data_dir=data,
        results_dir=out or run,
        run_dir=run,
        tag_dir=tag,
        manifest_sha256="0" * 64,
    )


def _claimed(target, *, force: bool = False, samples: Path | None = None) -> None:
    """What ``run_eval`` checks before the engine, in its order."""
    results.check_out(target)
    results.check_results_file(target, force=force)
    if samples is not None:
        results.check_samples_file(samples, force=force, target=target)


def test_out_is_never_another_run_a_checkpoint_an_input_or_the_working_directory(
    tmp_path, monkeypatch
):
    """``--out OTHER_RUN --force`` (which replaced the other run's in-loop score of the step),
    ``--out OTHER_RUN`` without a collision (which filed the scores under it), ``--out .``,
    ``--out RUN/checkpoints``, another run's checkpoint and the run's prepared data: each one
    paragraph; nothing is written. A new directory, the run itself, and a directory of this
    run's earlier scores are fine."""
    run, other, data = tmp_path / "run", tmp_path / "other", tmp_path / "data"
    start_run(run, max_steps=2)
    start_run(other, max_steps=2)
    data.mkdir()
    save(run, 2)
    their_tag = save(other, 2)
    results.write(other, {"step": 2, "tokens": 7, "source": "loop", "tasks": {}, "failed": {}})
    (tmp_path / "work").mkdir()
    before = tree(tmp_path)
    monkeypatch.chdir(tmp_path / "work")
    for out, says in [
        (other, "a run or its checkpoints, and one run's scores are never filed"),
        (their_tag, "a run or its checkpoints"),
        (Path("."), "working directory, one of its parents"),
        (run / "checkpoints", "lies inside the run"),
        (tmp_path, "working directory, one of its parents"),
        (data, "which this command reads"),
    ]:
        for force in (False, True):
            with pytest.raises(UserError, match=says) as e:
                _claimed(_scoring(run, out, data=data), force=force)
            assert "\n" not in str(e.value) and e.value.every_rank
        assert tree(tmp_path) == before
    _claimed(_scoring(run, tmp_path / "new"))
    _claimed(_scoring(run, run))  # --out RUN: the run's own evals/, as without --out


def test_force_replaces_only_this_runs_own_document_of_the_step(tmp_path):
    run, out = tmp_path / "run", tmp_path / "scores"
    start_run(run, max_steps=2)
    target = _scoring(run, out)
    theirs = {"step": 2, "tokens": 7, "source": "checkpoint", "tasks": {}, "failed": {}}
    results.write(out, {**theirs, "checkpoint": str(tmp_path / "b" / "checkpoints" / "step2")})
    with pytest.raises(UserError, match="replaces only this run's own scores of step 2"):
        _claimed(target, force=True)
    results.write(out, {**theirs, "checkpoint": str(target.tag_dir)})  # this run's: replaced
    _claimed(target, force=True)
    results.write(run, {**theirs, "source": "loop", "checkpoint": None})  # in place: the run's
    _claimed(_scoring(run), force=True)


def test_samples_replaces_only_a_samples_file_and_never_writes_into_a_checkpoint(tmp_path):
    """``--samples FILE --force`` over a user's ``{}`` (which it replaced), a JSON object of
    lists, a FIFO (read without blocking) or a link: refused; over what ``samples_text``
    wrote, or a new file in the run directory: allowed; a ``--samples`` path inside the
    checkpoint scored, the run's checkpoints or the prepared data: refused, with or without
    --force."""
    run, data = tmp_path / "run", tmp_path / "data"
    start_run(run, max_steps=2)
    data.mkdir()
    target = _scoring(run, tmp_path / "scores", data=data)
    mine = tmp_path / "mine.json"
    for text in ("{}", '{"notes": ["a", "b"]}'):
        mine.write_text(text)
        with pytest.raises(UserError, match="the file exists") as e:
            _claimed(target, force=True, samples=mine)
        assert "\n" not in str(e.value)
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "link.json").symlink_to(mine)
    for path in (tmp_path / "fifo.json", tmp_path / "link.json"):
        with pytest.raises(UserError, match="the file exists"):
            _claimed(target, force=True, samples=path)
    ours = tmp_path / "samples.json"
    ours.write_text(results.samples_text(2, {"t": [{"doc_id": 0}]}))
    _claimed(target, force=True, samples=ours)
    _claimed(target, samples=run / "samples.json")  # beside the run's files: a new file
    for inside in (target.tag_dir / "s.json", run / "checkpoints" / "s.json", data / "s.json"):
        for force in (False, True):
            with pytest.raises(UserError, match="which anneal eval reads and never writes"):
                _claimed(target, force=force, samples=inside)
    assert mine.read_text() == '{"notes": ["a", "b"]}'
