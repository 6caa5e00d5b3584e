"""The sides of the tokenize+pack benchmark, each measured in a fresh process: ``anneal data
prepare`` (the command a user runs), SentencePiece's batch encode alone (the limit) and
``datasets.Dataset.map`` with the same encode function. ``run_measured`` runs one command and
samples its process tree every 20 ms for the peak summed PSS and the CPU seconds.

The limit and ``datasets`` run this file as a script (``--encode-child``, ``--datasets-child``):
a fresh interpreter, so that neither side inherits the other's imports, threads or memory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from anneal.data import tokenizer  # noqa: E402
from anneal.data.pack import ENCODE_BATCH_CHARS  # noqa: E402
from anneal.data.prepared_dir import PreparedDir  # noqa: E402
from anneal.data.readers import Problems, ReadOptions  # noqa: E402
from anneal.data.sources import parse_inputs  # noqa: E402
from anneal.data.units import list_units, read_unit  # noqa: E402
from anneal.hardware import process_memory_bytes  # noqa: E402


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
    meta, made = PreparedDir(out).meta(), PreparedDir(out).provenance()
    shutil.rmtree(out, ignore_errors=True)
    mb = meta["input_bytes"] / 1e6
    return {
        "workers": workers,
        "mb": mb,
        "pack_s": made["pack_seconds"],
        "wall_s": wall,
        "pack_mb_s": mb / made["pack_seconds"],
        "wall_mb_s": mb / wall,
        "tokens": meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"],
        "peak_pss_mib": peak,
        "parent_cpu_s": cpu["top"],
        "children_cpu_s": cpu["rest"],
        "mb_per_cpu_s": mb / (cpu["top"] + cpu["rest"]),
        "pack_cpu_s": made["pack_cpu_seconds"],
        "pack_mb_per_cpu_s": mb / made["pack_cpu_seconds"],
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
                    batches.append(tokenizer._lines(texts)[0])
                    texts, chars = [], 0
            if texts:
                batches.append(tokenizer._lines(texts)[0])
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
    tok = tokenizer.load(Path(tok_dir))

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


if __name__ == "__main__":
    if sys.argv[1] == "--datasets-child":
        _datasets_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    elif sys.argv[1] == "--encode-child":
        _encode_child(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"{__file__}: a child of bench_prepare.py (--encode-child, --datasets-child)")
