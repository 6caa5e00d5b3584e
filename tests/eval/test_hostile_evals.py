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


def _plant(run: Path, kind: str) -> Path:
    """``evals/step-100.json`` of ``kind``, beside a good document of step 50."""
    path = rundir.eval_path(run, 100)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "deep":
        path.write_text("[" * 100_000)
    else:
        metrics = {"huge": {"acc": 1e308}, "string": {"acc": "0.9"}}.get(kind, {"acc": 0.5})
        name = "\x1b[31mhellaswag\x1b[0m" if kind == "ansi" else "hellaswag"
        path.write_text(json.dumps(doc(100, {name: task({**metrics, "acc_stderr": 0.01})})))
    return path


@pytest.mark.parametrize("kind", ["fifo", "deep", "huge", "string", "ansi"])
def test_a_planted_score_document_is_skipped_with_a_warning(tmp_path, capsys, caplog, kind):
    run = add_evals(good_run(tmp_path / "run"), [doc(50, {"hellaswag": task({"acc": 0.3})})])
    path = _plant(run, kind)
    assert [d["step"] for d in rundir.read_evals(run)] in ([50], [50, 100])
    rc, out, err = cli(capsys, "report", run)
    assert rc == 0 and "\x1b" not in out + err and "1e+308" not in out
    assert "acc 0.3 at step 50" in out
    assert f"{path}: skipped, not a score document anneal eval writes" in caplog.text
    rc, out, err = cli(capsys, "plot", run)
    assert rc == 0 and (run / "plots" / "downstream.png").is_file()


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
