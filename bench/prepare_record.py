"""bench_prepare's record and report: the JSON record (bench/results/prepare.json) with one
part per kind of run, ``throughput`` and ``memory``, each saying which command, date, machine and
load it came from; the merge that lets a ``--only`` run replace its own part and keep the other;
and the Markdown fragment for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from anneal.files import write_atomic  # noqa: E402


def recorded_command(argv: list[str]) -> str:
    """The command as the record shows it: ``--report`` only says where a copy of the table went
    (often a scratch file), so it is left out; every option that shapes the run stays."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--report":
            skip = True
        elif not arg.startswith("--report="):
            kept.append(arg)
    return " ".join(["bench/bench_prepare.py", *kept])


def part_header(cores: int) -> dict:
    """What each part of the record says about its own run: a part kept from an earlier run
    (``--only`` runs the other) still names the command, date, machine and load it came from."""
    return {
        "command": recorded_command(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": cores,
            "python": platform.python_version(),
            "system": platform.platform(),
        },
        "loadavg_start": os.getloadavg()[0],
    }


PARTS = ("throughput", "memory")


def merge_record(old: dict | None, parts: dict) -> tuple[dict, list[str]]:
    """The record after a run of ``parts``: those replace their namesakes, and a part of ``old``
    that this run did not repeat is kept if it describes its own run (its command and date).
    Anything else of ``old`` is dropped and named in the second value, so that a record never
    passes figures from two runs off as one."""
    old = old if isinstance(old, dict) else {}
    record, dropped = {}, []
    for name in PARTS:
        if name in parts:
            record[name] = parts[name]
        elif name in old:
            kept = old[name]
            if isinstance(kept, dict) and "command" in kept and "date" in kept:
                record[name] = kept
            else:
                dropped.append(name)
    dropped += sorted(k for k in old if k not in PARTS)
    return record, dropped


def write_record(path: Path, parts: dict) -> None:
    """Merge ``parts`` into the JSON record at ``path`` and replace it whole, atomically."""
    try:
        old = json.loads(path.read_text())
    except FileNotFoundError:
        old = None
    except ValueError as e:
        print(f"bench_prepare: {path} is not JSON ({e}); it is replaced", file=sys.stderr)
        old = None
    record, dropped = merge_record(old, parts)
    if dropped:
        print(
            f"bench_prepare: dropped from {path}, as they do not say which run they came from: "
            + ", ".join(dropped),
            file=sys.stderr,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=2) + "\n")


def markdown(parts: dict) -> str:
    """The Markdown fragment for the parts this run made."""
    lines = ["### Data: tokenize + pack against the tokenizer's own batch encode"]
    t = parts.get("throughput")
    if t:
        rows, lim = t["rows"], t.get("limit")
        lines += ["", "```", t["command"], "```", ""]
        lines.append(
            f"{t['input_mb']:.1f} MB of JSON Lines (stdlib source), {t['machine']['cores']} "
            f"cores, load average {t['loadavg_start']:.1f} at the start and "
            f"{t['loadavg_end']:.1f} at the end; medians of {len(lim['runs']) if lim else 0} "
            f"alternating repeats (range in brackets)."
        )
    if t and lim:
        lines += [
            "",
            "| | MB/s per worker | of encode alone | MB per CPU-second | of encode alone "
            "| datasets.map MB/s | Anneal / datasets | peak PSS MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            f"| `sp.encode(lines, num_threads=1)` alone | {lim['mb_s']:.2f} "
            f"({lim['mb_s_range']}) | 100% | {lim['mb_per_cpu_s']:.2f} "
            f"({lim['mb_per_cpu_s_range']}) | 100% | | | |",
        ]
        for row in rows:
            lines.append(
                f"| Anneal, {row['workers']} worker{'s' * (row['workers'] > 1)} "
                f"| {row['per_worker_mb_s']:.2f} ({row['per_worker_range']}) "
                f"| {row['of_limit']:.0%} | {row['pack_mb_per_cpu_s']:.2f} "
                f"({row['pack_mb_per_cpu_s_range']}) | {row['of_limit_cpu']:.0%} "
                f"| {row['datasets_map_mb_s']:.2f} | {row['vs_datasets']:.2f} "
                f"| {row['peak_pss_mib']:.0f} |"
            )
        worst = min(min(x["of_limit"], x["of_limit_cpu"]) for x in rows)
        lines += [
            "",
            f"Per worker, tokenize+pack runs at {worst:.0%} or more of SentencePiece's batch "
            f"encode of the same lines (goal: 90%), "
            + ("met" if worst >= 0.9 else "not met")
            + "; per CPU-second is the steadier figure on a shared machine.",
        ]
    m = parts.get("memory")
    if m:
        if not t or m["command"] != t["command"]:
            lines += ["", "```", m["command"], "```"]
        lines += [
            "",
            f"Memory: {m['mb']:,.0f} MB of JSON Lines ({m['input_over_cap']:.1f}x a "
            f"{m['cap_mib']:g} MiB cap) with {m['workers']} workers: peak {m['peak_pss_mib']:.0f}"
            f" MiB summed PSS ({'within' if m['peak_pss_mib'] <= m['cap_mib'] else 'OVER'} the "
            f"cap), {m['pack_mb_s']:.2f} MB/s; load average {m['loadavg_start']:.1f} at the "
            f"start and {m['loadavg_end']:.1f} at the end.",
        ]
    return "\n".join(lines)
