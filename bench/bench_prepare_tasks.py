"""``anneal data prepare`` split into tasks against one node, side by side in one run.

    python bench/bench_prepare_tasks.py                  # about 2-4 minutes on 2 busy cores
    python bench/bench_prepare_tasks.py --smoke          # 4 MB, one repeat, nothing written

On one input (JSON Lines of the Python standard library's source, repeated to ``--mb``) and one
SentencePiece BPE model (8192 pieces, trained once; every side reuses it with ``--tokenizer``,
so tokenizer training is in none of the times), cut into the default work units of 4 MB and
written in shards of 2M ids (``SHARD_TOKENS``), each repeat runs, in turn, each a fresh
process:

- ``one1``: one node, ``--workers 1``: its tokenize+pack phase (provenance.json
  ``pack_seconds``, ``pack_cpu_seconds``);
- ``tasks``: the plan, then 4 tasks of ``--workers 1`` started at once, then ``cp -r`` of the
  parts' shard files to a fresh directory on the same disk (the same bytes the merge reads),
  then ``--merge`` (its copy, ``merge_seconds``, and its verification, ``verify_seconds``); per
  task, MB per second of its tokenize+pack and per CPU-second (its marker's ``seconds`` and
  ``pack_cpu_seconds``);
- ``one4``: one node, ``--workers 4``: the whole command's wall time.

Compared, medians over the repeats: a task's MB per CPU-second against ``one1``'s (per core;
the acceptance asks at least 90%), the merge's MB/s against ``cp``'s (at least half), and the
wall time of the plan + 4 tasks + merge against ``one4``'s whole command (at most 1.1x), with
the tasks' phase alone against ``one4``'s pack phase beside it. Every merged tree's sha256 is
checked against the one-node tree's. Prints one JSON line; ``--json`` writes the record
(default bench/results/prepare_tasks.json, with the command, date, machine and load), and
``--report`` a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_prepare import stdlib_texts, write_jsonl  # noqa: E402
from prepare_record import part_header  # noqa: E402
from prepare_sides import run_measured  # noqa: E402

from anneal.data import tokenizer  # noqa: E402
from anneal.data.prepared_dir import PreparedDir  # noqa: E402
from anneal.files import write_atomic  # noqa: E402

TASKS = 4
SHARD_TOKENS = 1 << 21
"""Ids per shard on every side (4 MiB at uint16): a 48 MB input then makes about 7 shards, so
the merge's threads have more than one shard to share (real corpora have thousands)."""
ENV = {"PYTHONPATH": str(REPO)}


def prepare_cmd(inp: Path, tok: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "anneal.cli",
        "data",
        "prepare",
        "--input",
        str(inp),
        "--tokenizer",
        str(tok),
        "--out",
        str(out),
        "--val-fraction",
        "0.01",
        "--quiet",
        "--shard-tokens",
        str(SHARD_TOKENS),
        *extra,
    ]


def one_node(inp: Path, tok: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    wall, _, cpu, _ = run_measured(prepare_cmd(inp, tok, out, "--workers", str(workers)), ENV)
    meta, made = PreparedDir(out).meta(), PreparedDir(out).provenance()
    mb = meta["input_bytes"] / 1e6
    tokens = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    return {
        "mb": mb,
        "tokens": tokens,
        "pack_tokens_per_cpu_s": tokens / made["pack_cpu_seconds"],
        "wall_s": wall,
        "pack_s": made["pack_seconds"],
        "pack_mb_s": mb / made["pack_seconds"],
        "pack_mb_per_cpu_s": mb / made["pack_cpu_seconds"],
        "sha256": PreparedDir(out).content_sha256(),
    }


def in_tasks(inp: Path, tok: Path, out: Path, scratch: Path) -> dict:
    """The plan, 4 tasks at once, ``cp`` of the parts, the merge."""
    parts = out.with_name(out.name + ".parts")
    for p in (out, parts, scratch):
        shutil.rmtree(p, ignore_errors=True)
    base = prepare_cmd(inp, tok, out, "--tasks", str(TASKS))
    t0 = time.time()
    plan_s = run_measured(base, ENV)[0]
    t_tasks = time.time()
    procs = [
        subprocess.Popen([*base, "--task", str(i), "--workers", "1"], env={**os.environ, **ENV})
        for i in range(TASKS)
    ]
    if any(p.wait() != 0 for p in procs):
        raise RuntimeError("a task failed")
    tasks_s = time.time() - t_tasks
    markers = [json.loads((parts / f"task-{i:05d}.done.json").read_text()) for i in range(TASKS)]
    markers = [m for m in markers if m["units"]]  # a task without units measures nothing
    dirs = [parts / f"task-{i:05d}" for i in range(TASKS)]
    cp_bytes = sum(p.stat().st_size for d in dirs for p in d.rglob("*") if p.is_file())
    scratch.mkdir()
    t_cp = time.time()
    subprocess.run(["cp", "-r", *map(str, dirs), str(scratch)], check=True)
    cp_s = time.time() - t_cp
    shutil.rmtree(scratch)
    t_merge = time.time()
    run_measured([*base, "--merge"], ENV)
    merge_wall = time.time() - t_merge
    made = PreparedDir(out).provenance()
    return {
        "plan_s": plan_s,
        "tasks_s": tasks_s,
        "merge_wall_s": merge_wall,
        "total_s": time.time() - t0,
        "task_mb_per_cpu_s": statistics.median(
            m["input_bytes"] / 1e6 / m["pack_cpu_seconds"] for m in markers
        ),
        "task_mb_s": statistics.median(m["input_bytes"] / 1e6 / m["seconds"] for m in markers),
        "task_tokens_per_cpu_s": statistics.median(
            m["tokens"] / m["pack_cpu_seconds"] for m in markers
        ),
        "merge_mb": made["merge_bytes"] / 1e6,
        "merge_mb_s": made["merge_mb_per_s"],
        "merge_verify_mb_s": made["merge_bytes"]
        / 1e6
        / (made["merge_seconds"] + made["verify_seconds"]),
        "cp_mb": cp_bytes / 1e6,
        "cp_mb_s": cp_bytes / 1e6 / cp_s,
        "sha256": made["content_sha256"],
    }


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "sha256"}


def summary(one1: dict, tasks: dict, one4: dict) -> dict:
    return {
        "task_per_core_vs_one_node": tasks["task_mb_per_cpu_s"] / one1["pack_mb_per_cpu_s"],
        "task_mb_s_vs_one_node": tasks["task_mb_s"] / one1["pack_mb_s"],
        "merge_vs_cp": tasks["merge_mb_s"] / tasks["cp_mb_s"],
        "merge_and_verify_vs_cp": tasks["merge_verify_mb_s"] / tasks["cp_mb_s"],
        "wall_4x1_vs_1x4": tasks["total_s"] / one4["wall_s"],
        "tasks_phase_vs_pack_phase": tasks["tasks_s"] / one4["pack_s"],
    }


def markdown(record: dict) -> str:
    one1, tasks, one4, ratio = (record[k] for k in ("one1", "tasks", "one4", "ratios"))
    m = record["machine"]
    return "\n".join(
        [
            f"{record['mb']:.1f} MB of JSON Lines, {record['repeat']} repeats (medians), "
            f"{m['cores']} cores ({m['cpu']}), Python {m['python']}, load average "
            f"{record['loadavg_start']:.1f} at the start and {record['loadavg_end']:.1f} at the "
            f"end, {record['date']}:",
            "",
            "```",
            record["command"],
            "```",
            "",
            "| | measured | against | ratio | asked |",
            "|---|---:|---:|---:|---:|",
            f"| a task's tokenize+pack, MB per CPU-second (1 worker) | "
            f"{tasks['task_mb_per_cpu_s']:.2f} | one node, 1 worker: "
            f"{one1['pack_mb_per_cpu_s']:.2f} | {ratio['task_per_core_vs_one_node']:.2f} | "
            f">= 0.90 |",
            f"| a task's tokenize+pack, MB/s (1 worker, 4 tasks on the cores) | "
            f"{tasks['task_mb_s']:.2f} | one node, 1 worker: {one1['pack_mb_s']:.2f} | "
            f"{ratio['task_mb_s_vs_one_node']:.2f} | |",
            f"| a task's tokens per CPU-second | {tasks['task_tokens_per_cpu_s']:,.0f} | one "
            f"node: {one1['pack_tokens_per_cpu_s']:,.0f} | "
            f"{tasks['task_tokens_per_cpu_s'] / one1['pack_tokens_per_cpu_s']:.2f} | |",
            f"| the merge's copy, MB/s ({tasks['merge_mb']:.1f} MB) | {tasks['merge_mb_s']:.0f} | "
            f"`cp -r` of the parts: {tasks['cp_mb_s']:.0f} | {ratio['merge_vs_cp']:.2f} | >= 0.5 |",
            f"| the merge's copy and verification, MB/s | {tasks['merge_verify_mb_s']:.0f} | "
            f"`cp -r`: {tasks['cp_mb_s']:.0f} | {ratio['merge_and_verify_vs_cp']:.2f} | |",
            f"| plan + 4 tasks x 1 worker + merge, wall s | {tasks['total_s']:.1f} | one node, "
            f"4 workers: {one4['wall_s']:.1f} | {ratio['wall_4x1_vs_1x4']:.2f} | <= 1.1 |",
            f"| the 4 tasks alone against the pack phase, wall s | {tasks['tasks_s']:.1f} | "
            f"{one4['pack_s']:.1f} | {ratio['tasks_phase_vs_pack_phase']:.2f} | |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=16.0, help="input size")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "prepare_tasks.json"))
    parser.add_argument("--report", help="also write the Markdown table here")
    parser.add_argument(
        "--smoke", action="store_true", help="4 MB, one repeat, no --json record (CI)"
    )
    args = parser.parse_args()
    if args.smoke:
        args.mb, args.repeat = 4.0, 1
    header = part_header(os.cpu_count() or 1)
    header["command"] = " ".join(["bench/bench_prepare_tasks.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory(prefix="bench-tasks-") as tmp:
        work = Path(tmp)
        inp = work / "input.jsonl"
        texts = stdlib_texts()
        write_jsonl(inp, args.mb, texts)
        tok = work / "tokenizer.model"
        tokenizer.train_sentencepiece(texts[:400], vocab_size=8192, out_path=tok)
        runs: dict[str, list] = {"one1": [], "tasks": [], "one4": []}
        for _ in range(args.repeat):
            runs["one1"].append(one_node(inp, tok, work / "one1", 1))
            runs["tasks"].append(in_tasks(inp, tok, work / "tasks", work / "scratch"))
            runs["one4"].append(one_node(inp, tok, work / "one4", 4))
        shas = {r["sha256"] for side in runs.values() for r in side}
        assert len(shas) == 1, f"the merged tree differs from one node's: {shas}"
    record = {
        **header,
        "mb": runs["one1"][0]["mb"],
        "repeat": args.repeat,
        "sha256_equal": True,
        **{side: medians(r) for side, r in runs.items()},
        "loadavg_end": os.getloadavg()[0],
    }
    record["ratios"] = summary(record["one1"], record["tasks"], record["one4"])
    print(json.dumps(record))
    if not args.smoke:  # a smoke run's figures mean nothing: the record stays
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(args.json), json.dumps(record, indent=2) + "\n")
    if args.report:
        Path(args.report).write_text(markdown(record) + "\n")


if __name__ == "__main__":
    main()
