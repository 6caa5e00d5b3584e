"""Tokenize+pack throughput of ``anneal data prepare`` against the tokenizer's own batch encode
(the limit) and against ``datasets.Dataset.map``, and its peak memory on an input ten times
larger than the memory it is allowed.

    python bench/bench_prepare.py                      # 5-12 minutes on 2 cores (busy or not)
    python bench/bench_prepare.py --only throughput --report frag.md   # 3-5 minutes
    python bench/bench_prepare.py --smoke              # under a minute: still works end to end

The limit: in a fresh process, the same input read by the same readers, cut into lines and
batches exactly as the pipeline does (not timed), then ``sp.encode(batch, num_threads=1)``
alone, timed in wall and CPU seconds. Anneal's tokenize+pack phase is timed by provenance.json
(``pack_seconds``, ``pack_cpu_seconds``: its own and its workers' CPU). Each repeat runs the
limit, then Anneal and ``datasets`` for every worker count, in turn; medians are reported.

Both sides get the same input (JSON Lines made by repeating the Python standard library's
source files), the same SentencePiece BPE model (8192 pieces, trained once on the stdlib) and
the same encode function on batches of the same size (``ENCODE_BATCH_CHARS`` characters).
``datasets`` is timed for ``Dataset.map`` alone (its JSON -> Arrow load is reported apart);
Anneal for its tokenize+pack phase (provenance.json ``pack_seconds``) and for the whole command.
Memory is the peak over the run of the proportional set size (PSS: a shared page is split
between the processes that share it) summed over the command's process tree, sampled every
20 ms. Prints one JSON line of results, and with ``--report PATH`` writes a Markdown fragment
for docs/benchmarks.md.

The record (``--json``, bench/results/prepare.json) has one part per kind of run,
``throughput`` and ``memory``, each with its own command, date, machine and load. A run with
``--only`` replaces its own part and keeps the other, which still says where it came from.

The parts: ``prepare_sides`` runs and measures each side in a fresh process, ``prepare_record``
keeps the record and writes the fragment; this file makes the input and the tokenizer, runs the
sides in turn and takes the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prepare_record import markdown, part_header, write_record  # noqa: E402
from prepare_sides import anneal_prepare, datasets_map, encode_limit  # noqa: E402

from anneal.data import tokenizer  # noqa: E402
from anneal.data.prepare import default_workers  # noqa: E402


def stdlib_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    return [t for t in (p.read_text(encoding="utf-8", errors="replace") for p in files) if t]


def write_jsonl(path: Path, mb: float, texts: list[str]) -> int:
    """JSON Lines of stdlib files, repeated until ``mb`` MB. Returns its size in bytes."""
    target, size = int(mb * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            for t in texts:
                line = json.dumps({"text": t}) + "\n"
                f.write(line)
                size += len(line.encode())
                if size >= target:
                    break
    return size


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _spread(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{min(values):.2f}-{max(values):.2f}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=24.0, help="throughput input size")
    parser.add_argument("--repeat", type=int, default=2, help="throughput runs per side")
    parser.add_argument(
        "--memory-cap-mb",
        type=float,
        default=128.0,
        help="memory Anneal is allowed (summed PSS, MiB); input is 10x this",
    )
    parser.add_argument("--only", choices=("throughput", "memory"), help="run one part")
    parser.add_argument("--workers", default="", help="comma list (default 1..cores)")
    parser.add_argument("--workdir", help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "prepare.json"))
    parser.add_argument("--report", help="also write a Markdown fragment here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks it still runs")
    args = parser.parse_args()
    if args.smoke:
        args.mb, args.repeat, args.only = 1.0, 1, "throughput"
    return args


def tokenizer_dir(work: Path, texts: list[str], *, smoke: bool) -> Path:
    """WORK/tok with the SentencePiece model both sides use, trained once (8192 pieces on the
    stdlib; 1024 on a sample for the smoke)."""
    tok_dir = work / "tok"
    tok_dir.mkdir(exist_ok=True)
    if not (tok_dir / "tokenizer.model").exists():
        sample, vocab = (texts[:80], 1024) if smoke else (texts, 8192)
        tokenizer.train_sentencepiece(
            sample, vocab_size=vocab, out_path=tok_dir / "tokenizer.model"
        )
    return tok_dir


def throughput_runs(inp: Path, tok_dir: Path, work: Path, workers: list[int], *, repeat: int, val):
    """Every side, ``repeat`` times, alternating (the limit, then Anneal and ``datasets`` for
    each worker count) so that the machine's noise falls on all of them alike."""
    runs: dict = {"limit": [], **{("anneal", w): [] for w in workers}}
    runs.update({("datasets", w): [] for w in workers})
    for _ in range(repeat):
        runs["limit"].append(encode_limit(inp, tok_dir))
        for w in workers:
            runs["anneal", w].append(
                anneal_prepare(inp, tok_dir / "tokenizer.model", work / "out", w, val)
            )
            runs["datasets", w].append(datasets_map(inp, tok_dir, w, work / f"hf_cache_{w}"))
            shutil.rmtree(work / f"hf_cache_{w}", ignore_errors=True)
    return runs


def summarize_throughput(tp: dict, runs: dict, workers: list[int]) -> None:
    """Medians into ``tp``: the limit, then one row per worker count (printed as it comes)."""
    if not runs["limit"]:
        return
    lim = runs["limit"]
    tp["limit"] = {
        "mb_s": _median(lim, "mb_s"),
        "mb_s_range": _spread(lim, "mb_s"),
        "mb_per_cpu_s": _median(lim, "mb_per_cpu_s"),
        "mb_per_cpu_s_range": _spread(lim, "mb_per_cpu_s"),
        "runs": lim,
    }
    for w in workers:
        row = worker_row(w, runs["anneal", w], runs["datasets", w], tp["limit"])
        tp["rows"].append(row)
        print(
            f"workers {w}: {row['per_worker_mb_s']:.2f} MB/s per worker "
            f"({row['of_limit']:.0%} of encode alone), {row['pack_mb_per_cpu_s']:.2f} MB per "
            f"CPU-s ({row['of_limit_cpu']:.0%}); datasets.map {row['datasets_map_mb_s']:.2f} "
            f"MB/s",
            file=sys.stderr,
            flush=True,
        )


def worker_row(w: int, a: list[dict], d: list[dict], limit: dict) -> dict:
    """One worker count's medians of Anneal (``a``) and ``datasets`` (``d``) runs, against the
    limit."""
    for r in a:
        r["per_worker_mb_s"] = r["pack_mb_s"] / w
    row = {
        "workers": w,
        "pack_mb_s": _median(a, "pack_mb_s"),
        "per_worker_mb_s": _median(a, "per_worker_mb_s"),
        "per_worker_range": _spread(a, "per_worker_mb_s"),
        "pack_mb_per_cpu_s": _median(a, "pack_mb_per_cpu_s"),
        "pack_mb_per_cpu_s_range": _spread(a, "pack_mb_per_cpu_s"),
        "wall_mb_s": _median(a, "wall_mb_s"),
        "peak_pss_mib": _median(a, "peak_pss_mib"),
        "datasets_map_mb_s": _median(d, "map_mb_s"),
        "datasets_mb_per_cpu_s": _median(d, "mb_per_cpu_s"),
        "anneal_runs": a,
        "datasets_runs": d,
    }
    row["of_limit"] = row["per_worker_mb_s"] / limit["mb_s"]
    row["of_limit_cpu"] = row["pack_mb_per_cpu_s"] / limit["mb_per_cpu_s"]
    row["vs_datasets"] = row["pack_mb_s"] / row["datasets_map_mb_s"]
    return row


def memory_part(work: Path, tok_dir: Path, texts: list[str], cap: float, cores: int) -> dict:
    """Anneal with every core on an input ten times ``cap`` MiB: its peak summed PSS."""
    m = part_header(cores)
    big = work / "big.jsonl"
    write_jsonl(big, 10 * cap * 1.048576, texts)
    m.update(anneal_prepare(big, tok_dir / "tokenizer.model", work / "out", cores))
    big.unlink()
    m["cap_mib"] = cap
    m["input_over_cap"] = m["mb"] / 1.048576 / cap
    m["loadavg_end"] = os.getloadavg()[0]
    return m


def summary(parts: dict) -> dict:
    """The JSON line printed at the end: the figures without the individual runs."""
    t, m = parts.get("throughput", {}), parts.get("memory", {})
    return {
        "input_mb": t.get("input_mb"),
        "limit_mb_s": t.get("limit", {}).get("mb_s"),
        "limit_mb_per_cpu_s": t.get("limit", {}).get("mb_per_cpu_s"),
        "rows": [
            {k: v for k, v in r.items() if not k.endswith("_runs")} for r in t.get("rows", [])
        ],
        "memory_peak_pss_mib": m.get("peak_pss_mib"),
        "loadavg": {name: [x["loadavg_start"], x["loadavg_end"]] for name, x in parts.items()},
    }


def main() -> None:
    args = parse_args()
    val = 0.0 if args.smoke else 0.01  # 1 MB may hold no validation window
    cores = default_workers()
    workers = (
        [int(w) for w in args.workers.split(",")] if args.workers else list(range(1, cores + 1))
    )
    work = Path(args.workdir or tempfile.mkdtemp(prefix="anneal-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    texts = stdlib_texts()
    tok_dir = tokenizer_dir(work, texts, smoke=args.smoke)
    inp = work / "input.jsonl"
    write_jsonl(inp, args.mb, texts)
    tp: dict = {**part_header(cores), "input_mb": inp.stat().st_size / 1e6, "rows": []}
    repeat = args.repeat if args.only != "memory" else 0
    runs = throughput_runs(inp, tok_dir, work, workers, repeat=repeat, val=val)
    summarize_throughput(tp, runs, workers)
    inp.unlink()
    parts: dict = {}
    if args.only != "memory":
        parts["throughput"] = {**tp, "loadavg_end": os.getloadavg()[0]}
    if args.only != "throughput":
        parts["memory"] = memory_part(work, tok_dir, texts, args.memory_cap_mb, cores)
    if not args.smoke:
        write_record(Path(args.json), parts)
    if args.report:
        Path(args.report).write_text(markdown(parts) + "\n")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(summary(parts)))


if __name__ == "__main__":
    main()
