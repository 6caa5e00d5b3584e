"""Part 2 of the checkpoint benchmark, in separate processes: the recipe as a user runs it,
cold and then with ``--resume auto`` on the same run directory, each timed from launch to its
first train row in metrics.jsonl (polled every 20 ms) and split into its parts with the marks
``checkpoint_driver`` leaves and the ``resume`` event's ``verify_s`` and ``load_s``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from checkpoint_io import SEQ_LEN

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "checkpoint_driver.py"
"""Runs the recipe in place of ``python recipes/...``, leaving wall-clock marks on the way."""
# Set in this process by part 1's world of one; a child must make its own.
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    return {**env, "PYTHONPATH": str(ROOT)}


def first_train_row(run_dir: Path, after_rows: int, proc: subprocess.Popen) -> float:
    """time.time() when metrics.jsonl first holds a train row beyond the first ``after_rows``."""
    path = run_dir / "metrics.jsonl"
    while True:
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if sum(row["kind"] == "train" for row in rows) > after_rows:
                return time.time()
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode} before its first step")
        time.sleep(0.02)


def recipe_argv(args, run_dir: Path, stop_at_step: int, resume: str) -> list[str]:
    """The recipe's command line (after ``python``): tiny steps on cpu.json, no evaluation, a
    save at ``stop_at_step`` only, where it stops."""
    return [
        f"recipes/pretrain_{args.preset}.py",
        "--out",
        str(run_dir),
        "--data",
        args.data,
        "--max-steps",
        "4",
        "--save-every",
        "1000",
        "--resume",
        resume,
        "--ds-config",
        "cpu.json",
        "--set",
        f"model.seq_len={SEQ_LEN}",
        "--set",
        f"optim.global_batch_tokens={4 * SEQ_LEN}",
        "--set",
        "train.val_samples=0",
        "--set",
        f"train.stop_at_step={stop_at_step}",
    ]


def leg(args, run_dir: Path, stop_at_step: int, resume: str) -> dict:
    """One recipe process up to step ``stop_at_step`` (saved there); its startup, in parts."""
    from anneal.observe.metrics import read_metrics

    recipe = recipe_argv(args, run_dir, stop_at_step, resume)
    marks_file = run_dir.parent / f"{run_dir.name}-{stop_at_step}.marks.json"
    env = {**child_env(), "ANNEAL_BENCH_MARKS": str(marks_file)}
    with open(run_dir.parent / f"{run_dir.name}-{stop_at_step}.log", "w") as log:
        launch = time.time()
        proc = subprocess.Popen(
            [sys.executable, str(DRIVER), *recipe],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            first_row = first_train_row(run_dir, stop_at_step - 1, proc)
        finally:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"{recipe} exited {proc.returncode}; see {log.name}")
    m = json.loads(marks_file.read_text())
    events = [e for e in read_metrics(run_dir, "event") if e["event"] == "resume"]
    verify_s, load_s = (events[0]["verify_s"], events[0]["load_s"]) if events else (0.0, 0.0)
    row = read_metrics(run_dir, "train")[-1]
    return {
        "total_s": first_row - launch,
        "interpreter_s": m["start"] - launch,
        "imports_s": m["imported"] - m["start"],
        "setup_s": m["build_start"] - m["imported"],  # argv, distributed init, plan, data
        "build_s": m["build_end"] - m["build_start"],
        "verify_s": verify_s,
        "load_s": load_s,
        "step_s": row["tokens"] / row["step"] / row["tokens_per_s"],
        # from the engine (or the load) to the first row, less the step itself
        "rest_s": first_row
        - m["build_end"]
        - verify_s
        - load_s
        - row["tokens"] / row["step"] / row["tokens_per_s"],
    }


PARTS = (
    "total_s",
    "interpreter_s",
    "imports_s",
    "setup_s",
    "build_s",
    "verify_s",
    "load_s",
    "step_s",
    "rest_s",
)


def startup_part(args, work: Path) -> dict:
    """Cold start, then ``--resume auto`` on the same run directory, ``startup_repeats`` times."""
    r = {"cold": {k: [] for k in PARTS}, "resume": {k: [] for k in PARTS}}
    for i in range(args.startup_repeats):
        run_dir = work / f"startup{i}"
        run_dir.mkdir()
        for kind, stop_at_step, resume in (("cold", 1, "none"), ("resume", 2, "auto")):
            for k, v in leg(args, run_dir, stop_at_step, resume).items():
                r[kind][k].append(v)
        shutil.rmtree(run_dir)
    return r
