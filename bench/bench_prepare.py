"""Tokenize+pack throughput of ``anneal data prepare`` against ``datasets.Dataset.map``, and its
peak memory on an input ten times larger than the memory it is allowed.

    python bench/bench_prepare.py                      # 5-12 minutes on 2 cores (busy or not)
    python bench/bench_prepare.py --mb 8 --memory-cap-mb 32    # a quick look

Both sides get the same input (JSON Lines made by repeating the Python standard library's
source files), the same SentencePiece BPE model (8192 pieces, trained once on the stdlib) and
the same encode function on batches of the same size (``ENCODE_BATCH_CHARS`` characters).
``datasets`` is timed for ``Dataset.map`` alone (its JSON -> Arrow load is reported apart);
Anneal for its tokenize+pack phase (meta.json ``pack_seconds``) and for the whole command.
Memory is the peak over the run of the proportional set size (PSS: a shared page is split
between the processes that share it) summed over the command's process tree, sampled every
20 ms. Writes a JSON report and prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


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
            peak[0] = max(peak[0], sum(_pss_kb(p) for p in tree))
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


def anneal_prepare(inp: Path, tok: Path, out: Path, workers: int) -> dict:
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
        "0.01",
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
    }


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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--datasets-child":
        _datasets_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
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
    parser.add_argument("--report", default=str(REPO / "bench" / "results" / "prepare.json"))
    args = parser.parse_args()
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
        toklib.train_sentencepiece(texts, vocab_size=8192, out_path=tok_dir / "tokenizer.model")
    inp = work / "input.jsonl"
    write_jsonl(inp, args.mb, texts)
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": cores,
            "python": platform.python_version(),
            "system": platform.platform(),
        },
        "input_mb": inp.stat().st_size / 1e6,
        "throughput": [],
    }
    for w in workers if args.only != "memory" else []:
        runs_a, runs_d = [], []
        for _ in range(args.repeat):  # alternate, keep the best of each: less noise
            runs_a.append(anneal_prepare(inp, tok_dir / "tokenizer.model", work / "out", w))
            runs_d.append(datasets_map(inp, tok_dir, w, work / f"hf_cache_{w}"))
            shutil.rmtree(work / f"hf_cache_{w}", ignore_errors=True)
        a = max(runs_a, key=lambda x: x["pack_mb_s"])
        d = max(runs_d, key=lambda x: x["map_mb_s"])
        row = {
            "workers": w,
            "anneal": a,
            "datasets": d,
            "ratio": a["pack_mb_s"] / d["map_mb_s"],
            "ratio_cpu": max(x["mb_per_cpu_s"] for x in runs_a)
            / max(x["mb_per_cpu_s"] for x in runs_d),
        }
        report["throughput"].append(row)
        print(
            f"workers {w}: anneal {a['pack_mb_s']:.2f} MB/s (whole command "
            f"{a['wall_mb_s']:.2f}), datasets.map {d['map_mb_s']:.2f} MB/s "
            f"(+ JSON load {d['load_s']:.1f} s): ratio {row['ratio']:.2f}",
            flush=True,
        )
    inp.unlink()
    if args.only == "throughput":
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
        print(markdown(report))
        return
    big = work / "big.jsonl"
    cap = args.memory_cap_mb
    write_jsonl(big, 10 * cap * 1.048576, texts)
    m = anneal_prepare(big, tok_dir / "tokenizer.model", work / "out", cores)
    big.unlink()
    m["cap_mib"] = cap
    m["input_over_cap"] = m["mb"] / 1.048576 / cap
    report["memory"] = m
    print(
        f"memory: {m['mb']:.0f} MB input ({m['input_over_cap']:.1f}x the {cap:.0f} MiB cap), "
        f"{cores} workers: peak {m['peak_pss_mib']:.0f} MiB PSS in all, "
        f"{m['pack_mb_s']:.2f} MB/s",
        flush=True,
    )
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(markdown(report))


def markdown(r: dict) -> str:
    rows = r["throughput"]
    base = rows[0]["anneal"]["pack_mb_s"] if rows else 1.0
    lines = [
        "| workers | Anneal MB/s | per worker | speed-up | MB per CPU-second | parent CPU "
        "| whole command MB/s | datasets.map MB/s | Anneal / datasets (wall) "
        "| Anneal / datasets (CPU) | peak PSS MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        a, d, w = row["anneal"], row["datasets"], row["workers"]
        share = a["parent_cpu_s"] / (a["parent_cpu_s"] + a["children_cpu_s"])
        lines.append(
            f"| {w} | {a['pack_mb_s']:.2f} | {a['pack_mb_s'] / w:.2f} | "
            f"{a['pack_mb_s'] / base:.2f}x | {a['mb_per_cpu_s']:.2f} | {share:.0%} | "
            f"{a['wall_mb_s']:.2f} | {d['map_mb_s']:.2f} | {row['ratio']:.2f} | "
            f"{row['ratio_cpu']:.2f} | {a['peak_pss_mib']:.0f} |"
        )
    m = r.get("memory")
    if m:
        lines += [
            "",
            f"Memory: {m['mb']:,.0f} MB of JSON Lines ({m['input_over_cap']:.1f}x a "
            f"{m['cap_mib']:.0f} MiB cap) with {m['workers']} workers: peak {m['peak_pss_mib']:.0f}"
            f" MiB summed PSS ({'within' if m['peak_pss_mib'] <= m['cap_mib'] else 'OVER'} the "
            f"cap), {m['pack_mb_s']:.2f} MB/s.",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
