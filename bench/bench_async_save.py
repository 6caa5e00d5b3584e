"""Asynchronous against synchronous saves (``train.async_save``), side by side in one run: the
125m recipe at ZeRO-3 (``cpu.json``, fp32) on 2 ranks (``tests/scripts/ranks.py``), sequence
64, one micro-batch per rank and step, 9 steps, saving every 3 (``--save-every``: a save's
background write, about 7 s here, fits between two saves, which therefore never wait for each
other), once with each kind of save, the two launches alternating (``--repeats`` pairs).

From each launch's metrics.jsonl: every ``checkpoint`` event's ``blocking_s`` (what the loop
waited: for an asynchronous save, the snapshot and the next update's wait for its host copy),
``waited_s`` (the part of it spent waiting for the save before) and ``write_s`` (its files,
written behind the training), the step times (tokens per step / ``tokens_per_s``) of the
steps right after a save and of the others (the first step left out: it is slow on every
launch), and the largest per-rank memory of a train row (``mem_max_gib``: host RSS on a CPU).

    PYTHONPATH=. .venv/bin/python bench/bench_async_save.py [--data DIR] [--preset 125m]
        [--steps 9] [--save-every 3] [--repeats 1] [--report PATH] [--smoke]

``--smoke``: the tiny preset, 3 steps, a save every 2 (a few seconds of compute; the code path
only). Prints one
JSON line; ``--report`` also writes a markdown fragment for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from run_all import DEFAULT_DATA, ensure_data  # noqa: E402

SEQ_LEN = 64
RANKS = 2


def recipe_args(args, out: Path, *, asynchronous: bool) -> list[str]:
    preset = "tiny" if args.smoke else args.preset
    return [
        sys.executable,
        str(ROOT / "tests" / "scripts" / "ranks.py"),
        str(RANKS),
        f"recipes/pretrain_{preset}.py",
        *("--out", str(out), "--data", args.data, "--max-steps", str(args.steps)),
        *("--save-every", str(args.save_every), "--val-every", "0", "--ds-config", "cpu.json"),
        *("--set", f"model.seq_len={SEQ_LEN}"),
        *("--set", f"optim.global_batch_tokens={4 * RANKS * SEQ_LEN}"),
        *("--set", "train.val_samples=0", "--set", "train.log_every=1"),
        *("--set", f"train.async_save={'true' if asynchronous else 'false'}"),
    ]


def one_launch(args, work: Path, name: str, *, asynchronous: bool) -> dict:
    out = work / name
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        done = subprocess.run(
            recipe_args(args, out, asynchronous=asynchronous),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        tail = (work / f"{name}.log").read_text()[-3000:]
        raise SystemExit(f"{name} exited {done.returncode}:\n{tail}")
    wall_s = time.perf_counter() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    saves = [r for r in rows if r.get("event") == "checkpoint"]
    saved_at = {r["step"] for r in saves}
    tokens = 4 * RANKS * SEQ_LEN
    step_s = {s: tokens / r["tokens_per_s"] for s, r in train.items()}
    after = [step_s[s] for s in step_s if s - 1 in saved_at]
    others = [step_s[s] for s in step_s if s > 1 and s - 1 not in saved_at]
    newest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    size = sum(p.stat().st_size for p in newest.rglob("*.pt"))
    return {
        "asynchronous": asynchronous,
        "wall_s": round(wall_s, 2),
        "blocking_s": [r["blocking_s"] for r in saves],
        "waited_s": [r.get("waited_s", 0.0) for r in saves],
        "write_s": [r.get("write_s", 0.0) for r in saves],
        "step_after_save_s": after,
        "other_step_s": others,
        "mem_max_gib": max(r["mem_max_gib"] for r in train.values()),
        "checkpoint_gb": round(size / 1e9, 3),
    }


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def summary(launches: list[dict]) -> dict:
    out = {}
    for side in (False, True):
        mine = [x for x in launches if x["asynchronous"] == side]

        def pick(key: str, mine: list[dict] = mine) -> list[float]:
            return [v for x in mine for v in x[key]]

        out["async" if side else "sync"] = {
            "blocking_s": median(pick("blocking_s")),
            "blocking_s_all": pick("blocking_s"),
            "waited_s_all": pick("waited_s"),
            "write_s": median(pick("write_s")),
            "step_after_save_s": median(pick("step_after_save_s")),
            "other_step_s": median(pick("other_step_s")),
            "mem_max_gib": max(x["mem_max_gib"] for x in mine),
            "wall_s": [x["wall_s"] for x in mine],
        }
    sync, asyn = out["sync"], out["async"]
    out["blocking_ratio"] = round(asyn["blocking_s"] / sync["blocking_s"], 4)
    slower = asyn["step_after_save_s"] - sync["step_after_save_s"]
    out["step_after_save_slower_s"] = round(slower, 3)
    out["write_not_hidden_s"] = round(max(0.0, asyn["write_s"] - sync["step_after_save_s"]), 3)
    return out


def report(result: dict, path: Path) -> None:
    s, a = result["sync"], result["async"]
    lines = [
        "| per save (median) | synchronous | asynchronous |",
        "|---|---|---|",
        f"| the loop waited (`blocking_s`) | {s['blocking_s']} | {a['blocking_s']} |",
        f"| written behind the training (`write_s`) | - | {a['write_s']} |",
        f"| the step after a save | {s['step_after_save_s']} | {a['step_after_save_s']} |",
        f"| the other steps | {s['other_step_s']} | {a['other_step_s']} |",
        f"| peak memory of a rank, GiB | {s['mem_max_gib']} | {a['mem_max_gib']} |",
        "",
        f"Asynchronous blocking / synchronous: {result['blocking_ratio']:.2%}.",
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(DEFAULT_DATA), help="stdlib corpus (prepared if missing)")
    p.add_argument("--preset", default="125m")
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="pairs of launches")
    p.add_argument("--report", type=Path)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.save_every = 3, 2
    args.data = str(ensure_data(args.data))
    work = Path(tempfile.mkdtemp(prefix="anneal-async-save-"))
    try:
        launches = []
        for i in range(args.repeats):
            order = (False, True) if i % 2 == 0 else (True, False)
            for side in order:
                name = f"{'async' if side else 'sync'}-{i}"
                launches.append(one_launch(args, work, name, asynchronous=side))
        result = {
            "preset": "tiny" if args.smoke else args.preset,
            "ranks": RANKS,
            "steps": args.steps,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus",
            "load_avg": os.getloadavg(),
            "launches": launches,
            **summary(launches),
        }
        print(json.dumps(result))
        if args.report:
            report(result, args.report)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
