"""Tokenize+pack throughput of ``anneal data prepare`` against the tokenizer's own batch encode
(the limit) and against ``datasets.Dataset.map``, and its peak memory on an input ten times
larger than the memory it is allowed.

    python bench/bench_prepare.py                      # 5-12 minutes on 2 cores (busy or not)
    python bench/bench_prepare.py --only throughput --report frag.md   # 3-5 minutes
    python bench/bench_prepare.py --smoke              # under a minute: still works end to end

The limit: in a fresh process, the same input read by the same readers, cut into lines and
batches exactly as the pipeline does (not timed), then ``sp.encode(batch, num_threads=1)``
alone, timed in wall and CPU seconds. Anneal's tokenize+pack phase is timed by meta.json
(``pack_seconds``, ``pack_cpu_seconds``: its own and its workers' CPU). Each repeat runs the
limit, then Anneal and ``datasets`` for every worker count, in turn; medians are reported.

Both sides get the same input (JSON Lines made by repeating the Python standard library's
source files), the same SentencePiece BPE model (8192 pieces, trained once on the stdlib) and
the same encode function on batches of the same size (``ENCODE_BATCH_CHARS`` characters).
``datasets`` is timed for ``Dataset.map`` alone (its JSON -> Arrow load is reported apart);
Anneal for its tokenize+pack phase (meta.json ``pack_seconds``) and for the whole command.
Memory is the peak over the run of the proportional set size (PSS: a shared page is split
between the processes that share it) summed over the command's process tree, sampled every
20 ms. Prints one JSON line of results, and with ``--report PATH`` writes a Markdown fragment
for docs/benchmarks.md.

The record (``--json``, bench/results/prepare.json) has one part per kind of run,
``throughput`` and ``memory``, each with its own command, date, machine and load. A run with
``--only`` replaces its own part and keeps the other, which still says where it came from.
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
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from anneal.data import tokenizer as toklib  # noqa: E402
from anneal.data.pack import ENCODE_BATCH_CHARS  # noqa: E402
from anneal.data.prepare import default_workers  # noqa: E402
from anneal.data.readers import Problems, ReadOptions, read_unit  # noqa: E402
from anneal.data.sources import list_units, parse_inputs  # noqa: E402
from anneal.files import write_atomic  # noqa: E402
from anneal.hardware import process_memory_bytes  # noqa: E402


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


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 once it has exited)."""
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def _tree(pid: int) -> list[int]:
    import psutil

    try:
        top = psutil.Process(pid)
        return [pid, *(c.pid for c in top.children(recursive=True))]
    except psutil.Error:
        return [pid]


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[float, float, dict, str]:
    """Run ``cmd``; return (wall seconds, peak summed PSS in MiB, CPU seconds of the top process
    and of the rest of its tree, stdout)."""
    start = time.time()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    peak = [0]
    cpu: dict[int, float] = {}

    def sample():
        while proc.poll() is None:
            tree = _tree(proc.pid)
            peak[0] = max(peak[0], process_memory_bytes(proc.pid, tree=True, pss=True) // 1024)
            for p in tree:
                cpu[p] = max(cpu.get(p, 0.0), _cpu_s(p))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    top = cpu.pop(proc.pid, 0.0)
    return time.time() - start, peak[0] / 1024, {"top": top, "rest": sum(cpu.values())}, out


def anneal_prepare(inp: Path, tok: Path, out: Path, workers: int, val: float = 0.01) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "anneal.cli",
        "data",
        "prepare",
        "--input",
        str(inp),
        "--tokenizer",
        str(tok),
        "--workers",
        str(workers),
        "--out",
        str(out),
        "--val-fraction",
        str(val),
        "--quiet",
    ]
    wall, peak, cpu, _ = run_measured(cmd, env={"PYTHONPATH": str(REPO)})
    meta = json.loads((out / "meta.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    mb = meta["input_bytes"] / 1e6
    return {
        "workers": workers,
        "mb": mb,
        "pack_s": meta["pack_seconds"],
        "wall_s": wall,
        "pack_mb_s": mb / meta["pack_seconds"],
        "wall_mb_s": mb / wall,
        "tokens": meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"],
        "peak_pss_mib": peak,
        "parent_cpu_s": cpu["top"],
        "children_cpu_s": cpu["rest"],
        "mb_per_cpu_s": mb / (cpu["top"] + cpu["rest"]),
        "pack_cpu_s": meta["pack_cpu_seconds"],
        "pack_mb_per_cpu_s": mb / meta["pack_cpu_seconds"],
    }


def encode_limit(inp: Path, tok_dir: Path) -> dict:
    """SentencePiece's batch encode alone on the same text, in a fresh process."""
    cmd = [sys.executable, __file__, "--encode-child", str(inp), str(tok_dir)]
    _, _, _, out = run_measured(cmd, env={"PYTHONPATH": str(REPO)})
    r = json.loads(out.strip().splitlines()[-1])
    return {**r, "mb_s": r["mb"] / r["wall_s"], "mb_per_cpu_s": r["mb"] / r["cpu_s"]}


def _encode_child(inp: str, tok_dir: str) -> None:
    """Read ``inp`` as prepare does (same readers and units), cut it into lines and batches of
    ``ENCODE_BATCH_CHARS`` per unit as the pipeline does, then time only ``sp.encode``."""
    import sentencepiece as spm

    opts, problems = ReadOptions(), Problems("stop")
    batches, nbytes = [], 0
    for source in parse_inputs([inp]):
        for unit in list_units(source, opts, problems):
            nbytes += unit.nbytes
            texts, chars = [], 0
            for rec in read_unit(unit, opts, problems):
                texts.append(rec.text)
                chars += len(rec.text)
                if chars >= ENCODE_BATCH_CHARS:
                    batches.append(toklib._lines(texts)[0])
                    texts, chars = [], 0
            if texts:
                batches.append(toklib._lines(texts)[0])
    sp = spm.SentencePieceProcessor(model_file=str(Path(tok_dir) / "tokenizer.model"))
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = 0
    for batch in batches:
        tokens += sum(map(len, sp.encode(batch, num_threads=1)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(json.dumps({"mb": nbytes / 1e6, "wall_s": wall, "cpu_s": cpu, "tokens": tokens}))


def datasets_map(inp: Path, tok_dir: Path, workers: int, cache: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--datasets-child",
        str(inp),
        str(tok_dir),
        str(workers),
        str(cache),
    ]
    wall, peak, cpu, out = run_measured(cmd, env={"PYTHONPATH": str(REPO)})
    result = json.loads(out.strip().splitlines()[-1])
    mb = inp.stat().st_size / 1e6
    return {
        **result,
        "workers": workers,
        "mb": mb,
        "wall_s": wall,
        "map_mb_s": mb / result["map_s"],
        "peak_pss_mib": peak,
        "mb_per_cpu_s": mb / max(cpu["top"] + cpu["rest"], 1e-9),
    }


def _datasets_child(inp: str, tok_dir: str, workers: int, cache: str) -> None:
    """In a fresh process: JSON -> Arrow, then Dataset.map with the same encode function."""
    import datasets

    datasets.disable_progress_bars()
    t0 = time.time()
    ds = datasets.load_dataset("json", data_files=inp, split="train", cache_dir=cache)
    load_s = time.time() - t0
    avg_chars = sum(len(t) for t in ds[:200]["text"]) / 200
    batch = max(1, round(ENCODE_BATCH_CHARS / avg_chars))
    tok = toklib.load(Path(tok_dir))

    def encode(rows):
        return {"input_ids": tok.encode_batch(rows["text"])}

    t0 = time.time()
    out = ds.map(
        encode,
        batched=True,
        batch_size=batch,
        num_proc=workers if workers > 1 else None,
        remove_columns=["text"],
        load_from_cache_file=False,
    )
    map_s = time.time() - t0
    tokens = sum(len(x) for x in out.with_format("numpy")["input_ids"][:10])
    print(
        json.dumps(
            {"load_s": load_s, "map_s": map_s, "batch_size": batch, "sample_tokens": int(tokens)}
        )
    )


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _spread(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{min(values):.2f}-{max(values):.2f}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--datasets-child":
        _datasets_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--encode-child":
        _encode_child(sys.argv[2], sys.argv[3])
        return
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
    val = 0.0 if args.smoke else 0.01  # 1 MB may hold no validation window
    cores = default_workers()
    workers = (
        [int(w) for w in args.workers.split(",")] if args.workers else list(range(1, cores + 1))
    )
    work = Path(args.workdir or tempfile.mkdtemp(prefix="anneal-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    texts = stdlib_texts()
    tok_dir = work / "tok"
    tok_dir.mkdir(exist_ok=True)
    if not (tok_dir / "tokenizer.model").exists():
        sample, vocab = (texts[:80], 1024) if args.smoke else (texts, 8192)
        toklib.train_sentencepiece(sample, vocab_size=vocab, out_path=tok_dir / "tokenizer.model")
    inp = work / "input.jsonl"
    write_jsonl(inp, args.mb, texts)
    tp: dict = {**part_header(cores), "input_mb": inp.stat().st_size / 1e6, "rows": []}
    runs: dict = {"limit": [], **{("anneal", w): [] for w in workers}}
    runs.update({("datasets", w): [] for w in workers})
    for _ in range(args.repeat if args.only != "memory" else 0):  # alternate: same noise
        runs["limit"].append(encode_limit(inp, tok_dir))
        for w in workers:
            runs["anneal", w].append(
                anneal_prepare(inp, tok_dir / "tokenizer.model", work / "out", w, val)
            )
            runs["datasets", w].append(datasets_map(inp, tok_dir, w, work / f"hf_cache_{w}"))
            shutil.rmtree(work / f"hf_cache_{w}", ignore_errors=True)
    if runs["limit"]:
        lim = runs["limit"]
        tp["limit"] = {
            "mb_s": _median(lim, "mb_s"),
            "mb_s_range": _spread(lim, "mb_s"),
            "mb_per_cpu_s": _median(lim, "mb_per_cpu_s"),
            "mb_per_cpu_s_range": _spread(lim, "mb_per_cpu_s"),
            "runs": lim,
        }
    for w in workers if runs["limit"] else []:
        a, d = runs["anneal", w], runs["datasets", w]
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
        row["of_limit"] = row["per_worker_mb_s"] / tp["limit"]["mb_s"]
        row["of_limit_cpu"] = row["pack_mb_per_cpu_s"] / tp["limit"]["mb_per_cpu_s"]
        row["vs_datasets"] = row["pack_mb_s"] / row["datasets_map_mb_s"]
        tp["rows"].append(row)
        print(
            f"workers {w}: {row['per_worker_mb_s']:.2f} MB/s per worker "
            f"({row['of_limit']:.0%} of encode alone), {row['pack_mb_per_cpu_s']:.2f} MB per "
            f"CPU-s ({row['of_limit_cpu']:.0%}); datasets.map {row['datasets_map_mb_s']:.2f} "
            f"MB/s",
            file=sys.stderr,
            flush=True,
        )
    inp.unlink()
    parts: dict = {}
    if args.only != "memory":
        parts["throughput"] = {**tp, "loadavg_end": os.getloadavg()[0]}
    if args.only != "throughput":
        m = part_header(cores)
        big = work / "big.jsonl"
        cap = args.memory_cap_mb
        write_jsonl(big, 10 * cap * 1.048576, texts)
        m.update(anneal_prepare(big, tok_dir / "tokenizer.model", work / "out", cores))
        big.unlink()
        m["cap_mib"] = cap
        m["input_over_cap"] = m["mb"] / 1.048576 / cap
        m["loadavg_end"] = os.getloadavg()[0]
        parts["memory"] = m
    if not args.smoke:
        write_record(Path(args.json), parts)
    if args.report:
        Path(args.report).write_text(markdown(parts) + "\n")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    t, m = parts.get("throughput", {}), parts.get("memory", {})
    summary = {
        "input_mb": t.get("input_mb"),
        "limit_mb_s": t.get("limit", {}).get("mb_s"),
        "limit_mb_per_cpu_s": t.get("limit", {}).get("mb_per_cpu_s"),
        "rows": [
            {k: v for k, v in r.items() if not k.endswith("_runs")} for r in t.get("rows", [])
        ],
        "memory_peak_pss_mib": m.get("peak_pss_mib"),
        "loadavg": {name: [x["loadavg_start"], x["loadavg_end"]] for name, x in parts.items()},
    }
    print(json.dumps(summary))


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


if __name__ == "__main__":
    main()
