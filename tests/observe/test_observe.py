"""Seeing a run: a real (1-rank, tiny) run's TensorBoard events hold the expected tags, memory
as min, max and the rank of the max (per rank only on request), read by TensorBoard's own
reader; the one memory probe keeps a host peak until it is reset; its piped stdout gets plain
progress lines (tqdm's bar only on a terminal);
it writes its plots and health report at the end. Every plot is a valid PNG of a sensible size,
drawn with no display; the schedule plot reads a ds_config and asks for "auto" values; the
health report flags a synthetic bad run (flat loss near ln V, rising val loss, NaN grad norm) and
passes a good one; plots and reports of a run with no metrics yet say so clearly."""

from __future__ import annotations

import io
import json
import math
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.conftest import ROOT, env, run_process

PLOTS = ["loss.png", "lr.png", "grad_norm.png", "throughput.png"]


def anneal(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    e = env()
    e.pop("DISPLAY", None)
    e.pop("MPLBACKEND", None)
    return run_process(
        [sys.executable, "-m", "anneal.cli", *args], timeout_s=300, check=check, cwd=ROOT, env=e
    )


def cli(capsys, *args) -> tuple[int, str, str]:
    """``anneal ARGS`` in this process (exit status, stdout, stderr): the commands whose output
    is checked here, without a process start each; the plots drawn headless go through
    ``anneal`` above, in a process with no display."""
    from anneal.cli import main

    rc = main([str(a) for a in args])
    printed = capsys.readouterr()
    return rc, printed.out, printed.err


def png_size(path: Path) -> tuple[int, int]:
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    assert data[-8:-4] == b"IEND", f"{path}: truncated"
    return struct.unpack(">II", data[16:24])


def assert_sensible_png(path: Path) -> None:
    w, h = png_size(path)
    assert 400 <= w <= 2000 and 250 <= h <= 1500, (path, w, h)
    assert 5_000 < path.stat().st_size < 1_000_000, (path, path.stat().st_size)


def write_run(run: Path, train: list[dict], val=(), events=(), vocab=8192) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    config = {
        "model": {"vocab_size": vocab},
        "ds_config": {
            "gradient_clipping": 1.0,
            "optimizer": {"params": {"lr": 3e-3}},
            "scheduler": {
                "params": {
                    "total_num_steps": len(train),
                    "warmup_num_steps": 10,
                    "warmup_min_ratio": 0.0,
                    "cos_min_ratio": 0.1,
                }
            },
        },
    }
    (run / "config.json").write_text(json.dumps(config))
    rows = [{"kind": "train", **r} for r in train]
    rows += [{"kind": "val", **r} for r in val] + [{"kind": "event", **r} for r in events]
    rows.sort(key=lambda r: r["step"])
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def good_run(run: Path) -> Path:
    n = 100
    train = [
        {
            "step": s,
            "tokens": 1024 * s,
            "loss": 9.0 * math.exp(-s / 40) + 3.0,
            "lr": 1e-3,
            "grad_norm": 0.8 + 0.1 * math.sin(s),
            "tokens_per_s": 5000 + 10 * (s % 7),
            "mfu": 0.3,
            "data_wait_share": 0.001,
        }
        for s in range(1, n + 1)
    ]
    val = [{"step": s, "val_loss": 9.0 * math.exp(-s / 40) + 3.1} for s in (25, 50, 75, 100)]
    return write_run(run, train, val, events=[{"step": 50, "event": "checkpoint"}])


def bad_run(run: Path) -> Path:
    n = 100
    train = [
        {
            "step": s,
            "tokens": 1024 * s,
            "loss": math.log(8192) - 0.01 * (s / n),
            "lr": 1e-3,
            "grad_norm": None if s in (60, 61, 80) else 1.0,
            "tokens_per_s": 5000,
            "mfu": 0.3,
            "data_wait_share": 0.001,
        }
        for s in range(1, n + 1)
    ]
    for r in train:
        if r["grad_norm"] is None:
            r["nonfinite"] = ["grad_norm"]
    val = [{"step": s, "val_loss": v} for s, v in ((25, 8.9), (50, 9.0), (75, 9.2), (100, 9.4))]
    events = [{"step": 61, "event": "spike"}, {"step": 62, "event": "rewind"}]
    return write_run(run, train, val, events)


def test_health_report_passes_a_good_run(tmp_path):
    from anneal.observe.report import HEALTHY, health

    signals = {s.name: s for s in health(good_run(tmp_path / "good"))}
    assert {n: s.status for n, s in signals.items()} == dict.fromkeys(signals, HEALTHY)
    assert "ln(V) = 9.011" in signals["train loss"].detail


def test_health_report_flags_a_bad_run(tmp_path, capsys):
    from anneal.observe.report import PROBLEM, TPUT_DROP, format_table, health, throughput_signal

    run = bad_run(tmp_path / "bad")
    signals = {s.name: s for s in health(run)}
    assert signals["train loss"].status == PROBLEM
    assert "flat near the random baseline" in signals["train loss"].detail
    assert signals["val loss"].status == PROBLEM
    assert "rises while train loss falls" in signals["val loss"].detail
    assert signals["grad norm"].status == PROBLEM
    assert "non-finite at steps [60, 61, 80]" in signals["grad norm"].detail
    table = format_table(list(signals.values()), run_dir=run)
    assert table.count("PROBLEM") == 3 and "3 problem(s)" in table

    slow = [
        {
            "step": s,
            "tokens_per_s": 5000 if s < 90 else 5000 * TPUT_DROP / 2,
            "data_wait_share": 0.0,
        }
        for s in range(1, 101)
    ]
    assert throughput_signal(slow).status == PROBLEM
    stall = [{"step": s, "tokens_per_s": 5000, "data_wait_share": 0.4} for s in range(1, 101)]
    assert "stalls" in throughput_signal(stall).detail

    rc, out, _ = cli(capsys, "report", run, "--strict")
    assert rc == 1 and "PROBLEM" in out


@pytest.mark.parametrize("dark", [False, True])
def test_run_plots_are_valid_pngs_drawn_headless(tmp_path, dark):
    run = bad_run(tmp_path / "run")  # NaN grad norms and spike/rewind events must draw too
    done = anneal("plot", str(run), *(["--dark"] if dark else []))
    for name in PLOTS:
        assert f"wrote {run / 'plots' / name}" in done.stdout
        assert_sensible_png(run / "plots" / name)


def test_anneal_plot_of_a_blend_warns_nothing(tmp_path, capsys):
    """``anneal plot`` of a run whose validation is per source (the five charts): Matplotlib
    warns nothing (the per-source chart gave its line style twice, a UserWarning on every
    plot), and the charts are valid PNGs."""
    run = good_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r["kind"] == "val":
            r.update({"val_loss/prose": r["val_loss"] - 0.2, "val_bpb/prose": 1.1})
            r.update({"val_loss/code": r["val_loss"] + 0.2, "val_bpb/code": 1.3, "val_bpb": 1.2})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc, out, err = cli(capsys, "plot", run)
    assert rc == 0, err
    assert [str(w.message) for w in caught] == []
    for name in [*PLOTS, "val_sources.png"]:
        assert f"wrote {run / 'plots' / name}" in out
        assert_sensible_png(run / "plots" / name)


def test_schedule_plot_and_auto_values(tmp_path, capsys):
    """The shipped ds_configs leave the peak LR and warmup to the recipe ("auto"): the plot asks
    for them. A config with numbers needs only --steps."""
    out = tmp_path / "s.png"
    rc, _, err = cli(capsys, "plot", "--schedule", "zero3_bf16.json", "--steps", "100000")
    assert rc == 2 and '"auto"' in err and "--peak-lr" in err
    peak = ["--peak-lr", "6e-4", "--warmup-steps", "2000", "--dark", "--out", out]
    assert cli(capsys, "plot", "--schedule", "zero3_bf16.json", "--steps", "100000", *peak)[0] == 0
    assert_sensible_png(out)

    ds = json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text())
    ds["scheduler"]["params"]["warmup_num_steps"] = 20
    ds["optimizer"]["params"]["lr"] = 3e-4
    numeric = tmp_path / "numeric.json"
    numeric.write_text(json.dumps(ds))
    assert cli(capsys, "plot", "--schedule", numeric, "--steps", "1000", "--out", out)[0] == 0
    assert_sensible_png(out)
    rc, _, err = cli(capsys, "plot", "--schedule", numeric)
    assert rc == 2 and "--steps N" in err


def test_plot_and_report_of_a_run_without_metrics(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for cmd in ("plot", "report"):
        rc, _, err = cli(capsys, cmd, empty)  # a traceback would raise here
        assert rc == 2 and "no metrics.jsonl yet" in err, err
    (empty / "metrics.jsonl").write_text('{"kind": "event", "step": 0, "event": "resume"}\n')
    rc, _, err = cli(capsys, "plot", empty)
    assert rc == 2 and "no train rows yet" in err


def test_progress_bar_plain_lines_when_not_a_terminal():
    from anneal.observe.progress import ProgressBar

    out = io.StringIO()  # not a tty
    bar = ProgressBar(max_steps=25, log_every=10, stream=out, enabled=True)
    assert not bar.interactive
    for s in range(1, 26):
        bar.update(
            {
                "step": s,
                "loss": 5.0,
                "lr": 1e-3,
                "grad_norm": 0.5,
                "tokens_per_s": 1e4,
                "mfu": 0.1,
                "mem_max_gib": 1.5,
            }
        )
    bar.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(" |")[0] for ln in lines] == [
        "step  1/25",
        "step 10/25",
        "step 20/25",
        "step 25/25",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert all("ETA " in ln and "tok/s" in ln and "loss 5.0000" in ln for ln in lines)

    tty = io.StringIO()
    bar = ProgressBar(max_steps=3, log_every=10, stream=tty, interactive=True, enabled=True)
    for s in (1, 2):
        bar.update({"step": s, "loss": 5.0, "tokens_per_s": 1.0})
    bar.close()
    drawn = tty.getvalue()  # tqdm redraws in place; the last step stays as a plain line
    assert "\r" in drawn and drawn.splitlines()[-1].startswith("step 2/3 | loss 5.0000")


@pytest.fixture(scope="module")
def real_run(same_seed_runs):
    """The session's fp32 run (tests/conftest.py: 4 steps, validation at 2 and 4, a progress
    line every 2 steps) and its process."""
    return same_seed_runs["fp32"]


def test_tensorboard_reader_sees_the_expected_tags(real_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = real_run
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/mfu",
        "train/tokens",
        "train/mem_min_gib",
        "train/mem_max_gib",
        "train/mem_max_rank",
        "val/val_loss",
        "val/val_bpb",
    }
    assert expected <= tags, expected - tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert all(e.value > 0.05 for e in acc.Scalars("train/mem_max_gib"))  # RSS, GiB
    assert not any("mem_gib/rank" in t for t in tags)  # per rank only with memory_per_rank
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert all(r["mem_max_rank"] == 0 and "mem_gib" not in r for r in train)


def test_memory_is_summarised_unless_per_rank_is_asked_for():
    from anneal.hardware import GiB
    from anneal.train.step import memory_fields

    per_rank = [2 * GiB, 5 * GiB, 3 * GiB]
    assert memory_fields(per_rank) == {"mem_min_gib": 2.0, "mem_max_gib": 5.0, "mem_max_rank": 1}
    detail = memory_fields(per_rank, per_rank=True)
    assert detail["mem_gib"] == [2.0, 5.0, 3.0] and detail["mem_max_rank"] == 1


def test_the_memory_probe_keeps_the_host_peak_until_a_reset():
    """``anneal.hardware.peak_memory_bytes`` on the host: 256 MiB written and freed stay in
    the peak; on Linux, where ``/proc/self/clear_refs`` takes a reset, the next peak starts
    from the resident set."""
    import os

    from anneal.hardware import GiB, peak_memory_bytes, process_memory_bytes

    size, page = GiB // 4, os.sysconf("SC_PAGE_SIZE")
    before = process_memory_bytes()
    buffer = bytearray(size)
    buffer[::page] = b"\1" * len(range(0, size, page))  # every page resident
    del buffer
    peak = peak_memory_bytes(reset=True)
    assert peak > before + size * 0.9, (peak, before)
    if os.access("/proc/self/clear_refs", os.W_OK):
        assert peak_memory_bytes() < peak - size // 2


def test_run_prints_plain_progress_and_writes_plots_and_report(real_run):
    run, proc = real_run
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    progress = [ln for ln in lines if "tok/s" in ln]
    assert [ln.split(" |")[0] for ln in progress] == ["step 1/4", "step 2/4", "step 4/4"]
    assert all("ETA" in ln and "mem" in ln for ln in progress)
    assert "\r" not in proc.stdout
    for name in PLOTS:
        assert_sensible_png(run / "plots" / name)
    report = (run / "report.txt").read_text()
    assert "train loss" in report and "grad norm" in report and report in proc.stdout + "\n"


def _spans(ax) -> dict[str, list[tuple[float, float]]]:
    """The shaded phases of a chart: label -> [(x from, x to)] of each axvspan, unlabelled
    ones under the label of the last labelled one of the same colour."""
    from matplotlib.patches import Rectangle

    spans: dict[str, list[tuple[float, float]]] = {}
    by_colour: dict[tuple, str] = {}
    for p in ax.patches:
        if not isinstance(p, Rectangle):
            continue
        label = p.get_label()
        colour = tuple(p.get_facecolor())
        if label.startswith("_"):
            label = by_colour.get(colour, label)
        by_colour[colour] = label
        spans.setdefault(label, []).append((p.get_x(), p.get_x() + p.get_width()))
    return spans


def test_an_extended_wsd_runs_lr_chart_shows_its_old_decay_and_marks_the_resume(
    tmp_path, monkeypatch
):
    """A WSD run of 100 steps (warmup 10, decay from step 80) that finished and was resumed at
    step 100 with --max-steps 200: its steps 81-100 were trained at a decaying LR, so the
    chart shades them as decay (not "stable", which the 200-step schedule of config.json says),
    shades 100-160 stable and 160-200 decay again, and marks the resume at step 100."""
    from anneal.config.schedule import Schedule
    from anneal.observe import plots

    optim = {"schedule": "wsd", "decay_share": 0.2, "decay_shape": "linear"}
    sched = {"warmup_num_steps": 10, "cos_min_ratio": 0.0, "warmup_min_ratio": 0.0}
    old = Schedule.resolved({**sched, "total_num_steps": 100}, optim)
    new = Schedule.resolved({**sched, "total_num_steps": 200}, optim)
    assert (old.decay_start, new.decay_start) == (80, 160)
    train = [
        {
            "step": s,
            "tokens": 1024 * s,
            "loss": 5.0,
            "lr": 3e-3 * (old if s <= 100 else new).ratio(s),
        }
        for s in range(1, 201)
    ]
    events = [{"step": 50, "event": "checkpoint"}, {"step": 100, "event": "resume"}]
    run = write_run(tmp_path / "run", train, events=events)
    config = json.loads((run / "config.json").read_text())
    config["run"] = {"optim": optim}
    config["ds_config"]["scheduler"]["params"].update(sched, total_num_steps=200)
    (run / "config.json").write_text(json.dumps(config))
    drawn = {}
    real_save = plots.save

    def keep(fig, path):
        drawn[Path(path).name] = fig.axes[0]
        return real_save(fig, path)

    monkeypatch.setattr(plots, "save", keep)
    plots.plot_run(run)
    ax = drawn["lr.png"]
    spans = _spans(ax)
    assert spans["linear warmup"] == [(0, 10)]
    assert spans["stable (peak)"] == [(10, 80), (100, 160)]
    decay = sorted(x for label, xs in spans.items() if "decay" in label for x in xs)
    assert decay == [(80, 100), (160, 200)]
    resumes = [ln for ln in ax.lines if ln.get_label().startswith("resumed")]
    assert [ln.get_xdata()[0] for ln in resumes] == [100]
    assert "resumed at step 100" in resumes[0].get_label()
