"""`make bench` cannot rot: every benchmark runs end to end in its smoke mode (CI runs this)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_every_benchmark_runs_in_smoke_mode(tmp_path):
    """About 4 minutes on 2 cores, two scripts at a time: every script of bench/ trains or
    measures for real, a few steps each, except bench_gpu.py, whose smoke mode is
    ``gpu.sh --cpu-smoke`` (36 s alone): tests/test_bench_gpu.py runs that end to end, with a row
    made to fail, and its ``--smoke`` past the deadline."""
    # A corpus that does not exist yet, as in a fresh clone before `make demo` (CI's case; a
    # developer's data/stdlib would hide it): run_all prepares it and hands it to each script.
    data = tmp_path / "stdlib"
    before = (ROOT / "docs" / "benchmarks.md").read_text()
    scripts = sorted(
        p.name for p in (ROOT / "bench").glob("bench_*.py") if p.name != "bench_gpu.py"
    )
    proc = subprocess.run(
        [sys.executable, "bench/run_all.py", "--smoke", "--jobs", "2", "--data", str(data)]
        + ["--only", ",".join(s.removeprefix("bench_").removesuffix(".py") for s in scripts)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert f"== preparing {data}" in proc.stdout and (data / "meta.json").is_file()
    assert re.findall(r"^== (bench_\w+\.py): exit 0 in", proc.stdout, re.M) == scripts
    assert (ROOT / "docs" / "benchmarks.md").read_text() == before  # smoke writes nothing

    # The training comparison ran both sides on the same first batch and weights.
    train = next(
        json.loads(line)
        for line in proc.stdout.splitlines()
        if line.startswith("{") and '"bench": "train"' in line
    )
    sides = {(r["ranks"], r["run"]) for r in train["rows"]}
    assert sides == {
        (1, "plain loop"),
        (1, "recipe ZeRO-3"),
        (2, "torch DDP (gloo)"),
        (2, "recipe ZeRO-3"),
    }
    assert all(r["tokens_per_s"] > 0 and r["step1_loss_diff"] < 1e-4 for r in train["rows"])
