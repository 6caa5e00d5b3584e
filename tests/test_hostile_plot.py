"""Hostile output paths for `anneal plot`: a chart replaces only a chart.

`anneal plot --schedule CONFIG --out FILE` overwrote any file, the config it read included, and
`anneal plot RUN --out DIR` wrote over any file named like a chart in DIR. Now each chart's path
must be new or hold a PNG that Matplotlib wrote (an earlier chart); anything else is refused
with exit 2 naming the file and the fix, before anything is drawn, and the surrounding tree is
hashed before and after. In-process through `anneal.cli.main`; about a second.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import tree
from tests.test_observe import good_run

ROOT = Path(__file__).resolve().parent.parent
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
