"""Time the main job (`make demo`): wall clock of scripts/demo.py end to end, and the training
throughput it logged. Prints one JSON line for docs/benchmarks.md.

    .venv/bin/python bench/bench_demo.py [--steps N] [--report F]   (default: the demo's steps)
    .venv/bin/python bench/bench_demo.py --smoke                    (CI: see below)

--smoke runs the demo's whole path (the deepspeed runner's 2 ranks, the downstream scoring
before the first step and after the last, a validation, two checkpoints, the export and the
sample) at 2 steps, validating on 16 windows instead of all 233 and scoring 16 items of the
task instead of 200 (``SMOKE_SETS``; 106 s of CPU before these two, docs/benchmarks.md).

--data is the prepared stdlib corpus, as `make demo` reads it (default data/stdlib, prepared if
missing).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from run_all import DEFAULT_DATA, ensure_data  # noqa: E402

from anneal.observe.metrics import read_metrics  # noqa: E402

SMOKE_SETS = ("train.val_samples=16", "train.eval_tasks_limit=16")
"""--smoke's overrides after the demo's own: the same validation and scoring code, on fewer
windows and items."""

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, help="optimizer steps (default: the demo's)")
parser.add_argument("--smoke", action="store_true", help="2 steps, to check the script works")
parser.add_argument("--report", help="write a markdown fragment of the figures here")
parser.add_argument("--data", default=str(DEFAULT_DATA), help="stdlib corpus (prepared if missing)")
args = parser.parse_args()
args.data = str(ensure_data(args.data))
if args.smoke:
    args.steps = 2
out = Path(tempfile.mkdtemp(prefix="anneal-bench-")) / "demo"
start = time.time()
subprocess.run(
    [sys.executable, "scripts/demo.py", "--out", str(out), "--data", args.data]
    + (["--steps", str(args.steps)] if args.steps else [])
    + (["--no-baseline-check"] if args.smoke else [])
    + [a for s in (SMOKE_SETS if args.smoke else ()) for a in ("--set", s)],
    cwd=ROOT,
    check=True,
    capture_output=True,
)
wall_s = time.time() - start
train = read_metrics(out, "train")
steady = sorted(r["tokens_per_s"] for r in train[len(train) // 10 :])
step_s = sum(train[-1]["tokens"] / len(train) / r["tokens_per_s"] for r in train)
wait_s = sum(r["data_wait_s"] for r in train)
result = {
    "bench": "demo",
    "steps": len(train),
    "wall_s": round(wall_s, 1),
    "train_s": round(step_s, 1),
    "startup_and_other_s": round(wall_s - step_s, 1),
    "median_tokens_per_s": round(steady[len(steady) // 2]),
    "data_wait_share": round(wait_s / step_s, 5),
    "final_val_bpb": read_metrics(out, "val")[-1]["val_bpb"],
    "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} cores",
}
print(json.dumps(result))
if args.report:
    Path(args.report).write_text(
        "### The main job, `make demo` (`bench/bench_demo.py`)\n\n"
        f"`.venv/bin/python bench/bench_demo.py{f' --steps {args.steps}' if args.steps else ''}`"
        "\n\n| wall clock | training | startup, validation, checkpoints, export | median "
        "tokens/s | data wait | final val bpb |\n|---:|---:|---:|---:|---:|---:|\n"
        f"| {result['wall_s']:.0f} s | {result['train_s']:.0f} s | "
        f"{result['startup_and_other_s']:.0f} s | {result['median_tokens_per_s']:,} | "
        f"{result['data_wait_share']:.2%} of step time | {result['final_val_bpb']:.3f} |\n"
    )
