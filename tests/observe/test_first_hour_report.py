"""The report as a new user reads it (issue 46, points 4 and 9): a long detail (the shipped
task's failure, whose end is the fix) wraps between words under its column and is never cut;
the shipped task's failure names ``--val-fraction``; the validation loss is "val loss" in the
report as in the console and the metrics; a report with problems says that its exit status is
0 and that ``--strict`` exits 1."""

from __future__ import annotations

import pytest

from tests.eval.test_eval_see import add_evals, cli, doc, task
from tests.observe.test_observe import bad_run, good_run


def test_the_shipped_task_names_val_fraction_when_val_is_too_small(tiny_data, tmp_path):
    """tiny_data's val split holds no Python: the refusal says how to hold out more."""
    from anneal.errors import UserError
    from anneal.eval import next_line

    with pytest.raises(UserError) as refused:
        next_line.build(tiny_data, tmp_path / "work")
    assert "--val-fraction 0.1" in str(refused.value) and "default is 0.02" in str(refused.value)


def test_a_long_failure_wraps_whole_and_no_line_is_cut(tmp_path, capsys):
    reason = "UserError: " + "its val split holds 2 Python functions, " * 8 + "use --val-fraction"
    run = good_run(tmp_path / "run")
    acc = {"acc": 0.3, "acc_stderr": 0.01}
    add_evals(
        run,
        [
            doc(50, {"arc": task(acc)}),
            doc(100, {"arc": task(acc)}, failed={"anneal_next_line": reason}),
        ],
    )
    rc, out, _ = cli(capsys, "report", run)
    lines = out.splitlines()
    assert rc == 0 and max(len(ln) for ln in lines) <= 100, lines
    assert " ".join(" ".join(lines).split()).count(reason) == 1  # whole, words unbroken
    [first] = [i for i, ln in enumerate(lines) if "downstream anneal_next_line" in ln]
    column = lines[first].index("never scored")
    assert lines[first + 1][:column].strip() == ""  # the rest goes on under its column
    assert lines[first + 1][column] != " "


def test_the_validation_loss_is_val_loss_and_exit_0_says_strict(tmp_path, capsys):
    from anneal.observe.report import health

    names = {s.name for s in health(good_run(tmp_path / "good"))}
    assert "val loss" in names and not any("dev" in n for n in names)
    rc, out, _ = cli(capsys, "report", bad_run(tmp_path / "bad"))
    assert rc == 0 and "  val loss" in out and "dev loss" not in out
    assert "`--strict` exits 1" in out.splitlines()[-1]
    rc, out, _ = cli(capsys, "report", bad_run(tmp_path / "bad"), "--strict")
    assert rc == 1 and "--strict" not in out
