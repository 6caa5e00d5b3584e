"""Hostile output paths for `anneal plot`: a chart replaces only a chart.

`anneal plot --schedule CONFIG --out FILE` overwrote any file, the config it read included, and
`anneal plot RUN --out DIR` wrote over any file named like a chart in DIR. Now each chart's path
must be new or hold a PNG that Matplotlib wrote (an earlier chart); anything else is refused
with exit 2 naming the file and the fix, before anything is drawn, and the surrounding tree is
hashed before and after. In-process through `anneal.cli.main`; about a second.

The end of a run (issue 27) draws the same charts and writes report.txt: a file of the user's
there (``anneal.rundir.written_by_anneal`` decides) is kept byte for byte and named in a
warning, never replaced and never a stack trace; the other charts and the report still come.
The child process that draws them prints a UserError as one paragraph with exit 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import tree
from tests.observe.test_observe import good_run

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE = [
    "plot",
    "--schedule",
    "cpu.json",
    "--steps",
    "100",
    "--peak-lr",
    "1e-3",
    "--warmup-steps",
    "10",
]


def cli(capsys, *argv) -> tuple[int, str]:
    from anneal.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, err


def test_schedule_out_replaces_only_a_chart(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    config = tmp_path / "cpu.json"
    shutil.copy(ROOT / "ds_configs" / "cpu.json", config)
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0\0\0\0IDAT" + b"\0" * 16)
    before = tree(tmp_path)
    for target in (notes, config, photo, tmp_path):
        rc, err = cli(capsys, *SCHEDULE, "--out", target)
        assert rc == 2 and str(target) in err and "not a chart Anneal drew" in err, err
        assert "Choose another --out" in err
    assert tree(tmp_path) == before
    chart = tmp_path / "schedule.png"
    assert cli(capsys, *SCHEDULE, "--out", chart)[0] == 0
    assert cli(capsys, *SCHEDULE, "--out", chart)[0] == 0  # its own chart: replaced


def test_run_charts_replace_only_charts(tmp_path, capsys):
    run = good_run(tmp_path / "run")
    out = tmp_path / "charts"
    out.mkdir()
    (out / "lr.png").write_text("a note that happens to share a chart's name")
    before = tree(tmp_path)
    rc, err = cli(capsys, "plot", run, "--out", out)
    assert rc == 2 and str(out / "lr.png") in err and "not a chart Anneal drew" in err, err
    assert tree(tmp_path) == before
    (out / "lr.png").unlink()
    assert cli(capsys, "plot", run, "--out", out)[0] == 0
    assert cli(capsys, "plot", run, "--out", out)[0] == 0  # its own charts: replaced
    assert sorted(p.name for p in out.iterdir()) == [
        "grad_norm.png",
        "loss.png",
        "lr.png",
        "throughput.png",
    ]


# --- issue 27: the end of a run never replaces, or stops at, a file of the user's -----------

JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00 a photo of mine, named like a chart"


def test_end_of_run_keeps_a_users_report_byte_for_byte(tmp_path, caplog, capsys):
    """A report.txt in the run directory that Anneal did not write was overwritten by the
    report at the end of the run. Now it stays as it was, a warning names it, and the report
    is still printed; Anneal's own report.txt is replaced by the next one, as before."""
    from anneal.observe.report import end_of_run, format_table, health, write_report

    run = good_run(tmp_path / "run")
    report = run / "report.txt"
    report.write_text("notes: the run I started on Monday\n")
    before = tree(report)
    end_of_run(run)
    assert tree(report) == before
    assert f"{report}: not a report Anneal wrote, so it is kept" in caplog.text
    assert "train loss" in capsys.readouterr().out
    report.unlink()
    write_report(run)  # Anneal's own report, then replaced by the next end of run
    ours = report.read_text()
    assert ours == format_table(health(run), run_dir=run) + "\n"
    report.write_text(ours.replace("healthy", "PROBLEM", 1))
    write_report(run)
    assert report.read_text() == ours


def test_end_of_run_keeps_a_users_chart_and_draws_the_others(tmp_path, caplog, capsys):
    """A plots/loss.png that Matplotlib did not write stopped the end-of-run report with a stack
    trace (the UserError of ``claim_pngs``, uncaught in the child). Now it stays byte for
    byte, a warning names it, the other charts are drawn and the report is written."""
    from anneal.files import is_matplotlib_png
    from anneal.observe.report import end_of_run

    run = good_run(tmp_path / "run")
    (run / "plots").mkdir()
    photo = run / "plots" / "loss.png"
    photo.write_bytes(JPEG)
    end_of_run(run)
    assert photo.read_bytes() == JPEG
    assert f"{photo}: not a chart Anneal drew" in caplog.text
    for name in ("lr.png", "grad_norm.png", "throughput.png"):
        assert is_matplotlib_png(run / "plots" / name), name
    assert (run / "report.txt").read_text().startswith(f"health of {run}")
    assert "Traceback" not in capsys.readouterr().err


def test_the_end_of_run_child_prints_a_users_error_as_one_paragraph(tmp_path, capfd, caplog):
    """The child process that a run starts after its last step (``finish_run``) printed a
    UserError (here a metrics.jsonl edited by hand) as a stack trace. Now one paragraph naming
    the file and line, exit 2, which the run logs; nothing is written."""
    from anneal.observe.progress import finish_run

    run = good_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join([lines[0], "not json\n", *lines[1:]]))
    before = tree(run)
    finish_run(run)
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    [line] = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert f"{run / 'metrics.jsonl'}, line 2: not a JSON object" in line
    assert "failed (exit 2)" in caplog.text  # finish_run's warning: the run itself goes on
    assert tree(run) == before
