"""`make bench` cannot rot: every benchmark runs end to end in its smoke mode (CI runs this)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def failed_sections(stdout: str) -> str:
    """The output of each script that exited non-zero (run_all prints each script's output in
    one piece, from its ``== NAME`` line to its ``== NAME: exit N`` line), so that a failure
    early in the log is not cut off by the tail."""
    found = re.finditer(
        r"^== (bench_\w+\.py)\b.*?^== \1: exit (-?\d+) in [^\n]*", stdout, re.M | re.S
    )
    return "".join(m.group(0)[-8000:] + "\n" for m in found if m.group(2) != "0")


def test_every_script_that_reads_the_corpus_is_handed_it():
    """A script that defaults to the repository's data/stdlib (through run_all's DEFAULT_DATA,
    itself or through a bench module it imports) is in run_all's TAKES_DATA, so that run_all
    hands it the corpus it prepared instead of letting it prepare data/stdlib in the checkout
    (in a clean clone, beside whatever else prepares it there)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from run_all import TAKES_DATA

    bench = ROOT / "bench"
    reads = set()
    for script in sorted(bench.glob("bench_*.py")):
        text = script.read_text()
        imported = re.findall(r"^(?:from|import) (\w+)", text, re.M)
        sources = [text] + [
            (bench / f"{name}.py").read_text()
            for name in imported
            if name != "run_all" and (bench / f"{name}.py").is_file()
        ]
        if any("DEFAULT_DATA" in s or '"data" / "stdlib"' in s for s in sources):
            reads.add(script.name)
    assert "bench_moe.py" in reads and "bench_train.py" in reads  # the rule sees through imports
    # bench_gpu.py imports bench_train for its rows but prepares its own corpus in --work.
    assert reads - {"bench_gpu.py"} == TAKES_DATA


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the suite's 1200 s ran out once, beside two more sessions at load 17
def test_every_benchmark_runs_in_smoke_mode(tmp_path):
    """About 8 minutes in `make test-all` (480 s there before this session's cuts of the
    bench_train and bench_sp smoke modes; bench_muon and bench_docmask add about 30 and 60 s),
    two scripts at a time: every script of bench/
    trains or measures for real, a few steps each, except bench_gpu.py, whose smoke mode is
    ``gpu.sh --cpu-smoke`` (36 s alone): tests/bench/test_bench_gpu.py runs that end to end, with a
    row made to fail, and its ``--smoke`` past the deadline. The smoke modes fork the ranks of
    their 2-rank runs from one import (tests/scripts/ranks.py; bench_demo keeps the deepspeed
    runner, as ``make demo``), which cut about 120 s of CPU from a run of the scripts here
    (docs/benchmarks.md, "Cheaper smoke modes")."""
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
    assert proc.returncode == 0, failed_sections(proc.stdout) + log[-3000:]
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
    assert sides == {(2, "torch DDP (gloo)"), (2, "recipe ZeRO-3")}  # smoke: 2 ranks
    assert all(r["tokens_per_s"] > 0 and r["step1_loss_diff"] < 1e-4 for r in train["rows"])
