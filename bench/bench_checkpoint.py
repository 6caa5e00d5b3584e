"""Checkpoint speed, in one run on one disk: save and load of a real engine's checkpoint against a
plain sequential write and read of the same number of bytes, and launch-to-first-step against
``--resume auto``-to-first-step.

Part 1 (one process, one rank, ZeRO-3 fp32 ``cpu.json`` after one optimizer step), per repeat in
alternating order:
- anneal save: ``anneal.resilience.checkpoint.save`` (DeepSpeed's save, hashes, manifest,
  ``latest``); timed
  to its return and to "durable", after this script fsyncs every file of the tag directory
  (nearly free when the save already did).
- plain write: the same number of bytes written in 32 MiB chunks to one file in the same
  directory, timed to the last write and to durable (after fsync).
- after both are fsync'd their pages are dropped from the page cache (``posix_fadvise``
  DONTNEED), then, in alternating order: anneal load (``verified_resume`` + ``load``, timed
  apart) and a plain sequential read of the plain file in 32 MiB chunks.
- a resume at another layout's extra work: the checkpoint converted to DeepSpeed's universal
  format (``universal.to_universal``, cold cache; its size against the checkpoint's) and
  loaded from the conversion (``universal.load_universal``, cold cache, its verification
  included), against the native load.
Every save starts after ``os.sync()``, so no dirty page of another is flushed on its clock.

Part 2 (separate processes, the recipe as a user runs it): a cold ``python recipes/...`` that
stops (and saves) after step 1, then ``--resume auto`` on the same run directory up to step 2;
each timed from launch to its first train row in metrics.jsonl (polled every 20 ms). The resume
is split with the ``resume`` event's ``verify_s`` and ``load_s``, the step time of the row,
the engine build timed in part 1, and the wall time of a process that only imports.

    PYTHONPATH=. .venv/bin/python bench/bench_checkpoint.py [--preset 125m] [--repeats 4]
        [--report PATH] [--smoke]

Prints one JSON line; ``--report`` also writes a markdown fragment for docs/benchmarks.md.

The parts: ``checkpoint_io`` (part 1), ``checkpoint_startup`` (part 2) and
``checkpoint_driver`` (the script part 2 runs the recipe through); this file takes the
summary and writes the fragment.
"""

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checkpoint_io import io_part  # noqa: E402
from checkpoint_startup import startup_part  # noqa: E402
from run_all import DEFAULT_DATA, ensure_data  # noqa: E402

from anneal.resilience.universal import PEAK_FACTOR  # noqa: E402


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summary(io: dict, st: dict | None) -> dict:
    gb = io["bytes"] / 1e9
    out = {
        "bench": "checkpoint",
        "checkpoint_gb": round(gb, 3),
        "build_s": round(io["build_s"], 2),
        **{k: [round(v, 3) for v in vs] for k, vs in io.items() if isinstance(vs, list)},
        # per pair (same repeat), then the median: the machine's noise moves both sides
        "save_vs_write_durable": statistics.median(
            w / s for s, w in zip(io["save_durable_s"], io["write_durable_s"], strict=True)
        ),
        "universal_gb": round(statistics.median(io["universal_bytes"]) / 1e9, 3),
        "universal_vs_checkpoint_size": statistics.median(io["universal_bytes"]) / io["bytes"],
        "universal_peak_vs_checkpoint_size": max(io["universal_peak_bytes"]) / io["bytes"],
        "load_vs_read": statistics.median(
            rd / (v + ld)
            for v, ld, rd in zip(io["verify_s"], io["load_s"], io["read_s"], strict=True)
        ),
    }
    if st is not None:
        for kind, parts in st.items():
            out[kind] = {k: [round(v, 3) for v in vs] for k, vs in parts.items()}
        out["resume_vs_cold"] = statistics.median(
            r / c for c, r in zip(st["cold"]["total_s"], st["resume"]["total_s"], strict=True)
        )
    out["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    out["machine"] = f"{platform.machine()} {platform.processor() or ''}".strip()
    return out


def fmt(xs: list[float], unit: str = "s", scale: float | None = None) -> str:
    """'median (min-max)'; with ``scale``: GB/s = scale / seconds."""
    if scale is not None:
        xs = [scale / x for x in xs]
    s = stats(xs)
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) {unit}"


def markdown(args, res: dict, io: dict, st: dict | None) -> str:
    gb = io["bytes"] / 1e9
    both = [v + ld for v, ld in zip(io["verify_s"], io["load_s"], strict=True)]
    cmd = (
        f"PYTHONPATH=. .venv/bin/python bench/bench_checkpoint.py --preset {args.preset} "
        f"--repeats {args.repeats} --startup-repeats {args.startup_repeats}"
    )
    lines = [
        f"### Checkpoint save, load and resume ({args.preset}, {gb:.2f} GB)",
        "",
        f"```\n{cmd}\n```",
        "",
        f"Load average at the end: {' '.join(res['loadavg'])}. Medians (min-max) of "
        f"{args.repeats} alternating repeats; GB/s = checkpoint bytes / seconds.",
        "",
        "| what | seconds | GB/s |",
        "|---|---|---|",
        f"| anneal save, to return | {fmt(io['save_s'])} | {fmt(io['save_s'], '', gb)} |",
        f"| anneal save, durable (fsync'd) | {fmt(io['save_durable_s'])} | "
        f"{fmt(io['save_durable_s'], '', gb)} |",
        f"| plain write, to last write | {fmt(io['write_s'])} | {fmt(io['write_s'], '', gb)} |",
        f"| plain write, durable (fsync'd) | {fmt(io['write_durable_s'])} | "
        f"{fmt(io['write_durable_s'], '', gb)} |",
        f"| anneal load: hash verification (cold cache) | {fmt(io['verify_s'])} | |",
        f"| anneal load: DeepSpeed load | {fmt(io['load_s'])} | |",
        f"| anneal load, both | {fmt(both)} | {fmt(both, '', gb)} |",
        f"| plain read (cold cache) | {fmt(io['read_s'])} | {fmt(io['read_s'], '', gb)} |",
        "",
        f"Durable save rate / durable plain write rate (per pair, median): "
        f"{res['save_vs_write_durable']:.0%} (goal: at least 50%). Load rate / plain read rate: "
        f"{res['load_vs_read']:.0%}.",
        "",
        "A resume at another layout (another number of ranks or degree) converts once and loads "
        "from the conversion (docs/resilience.md):",
        "",
        "| what | seconds | GB/s of the checkpoint |",
        "|---|---|---|",
        f"| conversion to the universal format (`universal.to_universal`, cold cache) | "
        f"{fmt(io['convert_s'])} | {fmt(io['convert_s'], '', gb)} |",
        f"| load from the conversion (`universal.load_universal`, its verification included) "
        f"| {fmt(io['universal_load_s'])} | {fmt(io['universal_load_s'], '', gb)} |",
        "",
        f"The conversion holds {res['universal_gb']:.2f} GB: "
        f"{res['universal_vs_checkpoint_size']:.2f}x the checkpoint's {gb:.2f} GB; while it "
        f"was made, with DeepSpeed's temporary fragments beside it, at most "
        f"{res['universal_peak_vs_checkpoint_size']:.2f}x (sampled every 50 ms; a resume "
        f"asks for {PEAK_FACTOR}x free, `anneal.resilience.universal.check_space`).",
    ]
    if st is not None:
        lines += startup_lines(args, res, st)
    return "\n".join(lines) + "\n"


def startup_lines(args, res: dict, st: dict) -> list[str]:
    """The fragment's second table: cold start against ``--resume auto``, part by part."""
    names = {
        "total_s": "**launch to the first train row**",
        "interpreter_s": "interpreter start",
        "imports_s": "imports (anneal, deepspeed, transformers' Llama)",
        "setup_s": "arguments, distributed init, plan, data",
        "build_s": "engine build (model under zero.Init, init, `deepspeed.initialize`)",
        "verify_s": "hash verification (`resume` event's `verify_s`)",
        "load_s": "DeepSpeed load (`resume` event's `load_s`)",
        "step_s": "the first step itself",
        "rest_s": "the rest (guard, data stream, metrics row)",
    }
    return [
        "",
        f"| startup ({args.startup_repeats} pairs, seconds) | cold start | `--resume auto` |",
        "|---|---|---|",
        *(
            f"| {name} | {fmt(st['cold'][k])} | {fmt(st['resume'][k])} |"
            for k, name in names.items()
        ),
        "",
        f"Resume / cold start (per pair, median): {res['resume_vs_cold']:.2f}x (goal: under 2x).",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DEFAULT_DATA), help="stdlib corpus (prepared if missing)")
    p.add_argument("--preset", default="125m")
    p.add_argument("--repeats", type=int, default=4, help="save/load pairs")
    p.add_argument("--startup-repeats", type=int, default=2, help="cold/resume pairs (0: skip)")
    p.add_argument("--dir", help="where to write (default: a new temporary directory)")
    p.add_argument("--report", help="also write a markdown fragment here")
    p.add_argument("--smoke", action="store_true", help="tiny preset, one repeat of each")
    args = p.parse_args()
    if args.smoke:
        args.preset, args.repeats, args.startup_repeats = "tiny", 2, 1
    args.data = str(ensure_data(args.data))
    work = Path(tempfile.mkdtemp(prefix="anneal-bench-ckpt-", dir=args.dir))
    try:
        io = io_part(args, work)
        st = startup_part(args, work) if args.startup_repeats > 0 else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = summary(io, st)
    print(json.dumps(res))
    if args.report:
        Path(args.report).write_text(markdown(args, res, io, st))


if __name__ == "__main__":
    main()
