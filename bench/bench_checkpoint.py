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
Every save starts after ``os.sync()``, so no dirty page of another is flushed on its clock.

Part 2 (separate processes, the recipe as a user runs it): a cold ``python recipes/...`` that
stops (and saves) after step 1, then ``--resume auto`` on the same run directory up to step 2;
each timed from launch to its first train row in metrics.jsonl (polled every 20 ms). The resume
is split with the ``resume`` event's ``verify_s`` and ``load_s``, the step time of the row,
the engine build timed in part 1, and the wall time of a process that only imports.

    PYTHONPATH=. .venv/bin/python bench/bench_checkpoint.py [--preset 125m] [--repeats 4]
        [--report PATH] [--smoke]

Prints one JSON line; ``--report`` also writes a markdown fragment for docs/benchmarks.md.
"""

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

from anneal.files import fsync_path  # noqa: E402

CHUNK = 32 << 20
SEQ_LEN = 64
# Set in this process by part 1's world of one; a child must make its own.
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    return {**env, "PYTHONPATH": str(ROOT)}


def fsync_tree(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        fsync_path(p)


def drop_cache(path: Path) -> None:
    """Evict a file's (or a tree's) clean pages, so the next read comes from the disk."""
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def plain_write(path: Path, n_bytes: int) -> tuple[float, float]:
    """Seconds to write ``n_bytes`` (random, 32 MiB chunks) and to have them fsync'd."""
    buf = memoryview(os.urandom(CHUNK))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = n_bytes
        while left:
            left -= f.write(buf[: min(CHUNK, left)])
        f.flush()
        written = time.perf_counter() - t0
        os.fsync(f.fileno())
    return written, time.perf_counter() - t0


def plain_read(path: Path) -> float:
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def io_part(args, work: Path) -> dict:
    from anneal.cli.recipe import _single_process_env
    from anneal.config.run import DataConfig, ModelConfig, RunConfig, TrainConfig
    from anneal.data.stream import PackedSplit, TokenStream
    from anneal.resilience import checkpoint
    from anneal.train import build_engine, next_token_loss, resolve_run, setup_process

    cfg = RunConfig(
        out=str(work / "run"),
        ds_config="cpu.json",
        resume="none",
        model=ModelConfig(preset=args.preset, seq_len=SEQ_LEN),
        data=DataConfig(path=args.data),
        train=TrainConfig(max_steps=10, eval_samples=0),
    )
    _single_process_env()
    setup_process()
    plan = resolve_run(cfg, ["ds.gradient_accumulation_steps=1"])
    t0 = time.perf_counter()
    engine = build_engine(plan)
    build_s = time.perf_counter() - t0
    stream = TokenStream(
        PackedSplit(Path(args.data), "train", seq_len=SEQ_LEN),
        seed=1,
        rank=0,
        world_size=1,
        micro_batch=plan.micro_batch,
        prefetch=0,
    )
    x, y = stream.next_batch()
    engine.backward(next_token_loss(engine(input_ids=x).logits, y))
    engine.step()  # the optimizer state exists from here on

    r = {
        k: []
        for k in (
            "save_s",
            "save_durable_s",
            "write_s",
            "write_durable_s",
            "verify_s",
            "load_s",
            "read_s",
        )
    }
    n_bytes = 0
    for i in range(args.repeats):
        ckpt, plain = work / f"ckpt{i}", work / f"plain{i}.bin"
        ckpt.mkdir()

        def save(ckpt=ckpt):
            nonlocal n_bytes
            os.sync()
            t0 = time.perf_counter()
            client = {"step": 1, "tokens": 0, "data": {}}
            tag_dir = checkpoint.save(engine, ckpt, step=1, keep_last=3, client_state=client)
            r["save_s"].append(time.perf_counter() - t0)
            fsync_tree(ckpt)
            r["save_durable_s"].append(time.perf_counter() - t0)
            n_bytes = tree_bytes(ckpt)
            return tag_dir

        def write(plain=plain):
            os.sync()
            written, durable = plain_write(plain, n_bytes)
            r["write_s"].append(written)
            r["write_durable_s"].append(durable)

        def load(tag_dir):
            t0 = time.perf_counter()
            assert checkpoint.verified_resume(tag_dir, fallback=False) == tag_dir
            t1 = time.perf_counter()
            checkpoint.load(engine, tag_dir)
            r["verify_s"].append(t1 - t0)
            r["load_s"].append(time.perf_counter() - t1)

        def read(plain=plain):
            r["read_s"].append(plain_read(plain))

        if i % 2 == 0:  # alternate the order: neither side always goes first
            tag_dir = save()
            write()
        else:  # the same size as repeat 0's, checked below
            write()
            tag_dir = save()
        assert tree_bytes(ckpt) == plain.stat().st_size
        drop_cache(ckpt)
        drop_cache(plain)
        if i % 2 == 0:
            load(tag_dir)
            read()
        else:
            read()
            load(tag_dir)
        shutil.rmtree(ckpt)
        plain.unlink()
    return {"bytes": n_bytes, "build_s": build_s, **r}


# Runs a recipe (argv[1:]) as ``python recipes/...`` would, noting wall-clock marks on the way:
# interpreter up, heavy imports done, engine build begun and ended (build_engine wrapped).
DRIVER = """
import json, os, runpy, sys, time
marks = {"start": time.time()}
import anneal.cli.recipe, anneal.train, deepspeed, transformers.models.llama.modeling_llama
marks["imported"] = time.time()
build_engine = anneal.train.engine.build_engine
def timed_build(plan):
    marks["build_start"] = time.time()
    engine = build_engine(plan)
    marks["build_end"] = time.time()
    with open(os.environ["ANNEAL_BENCH_MARKS"], "w") as f:
        json.dump(marks, f)
    return engine
anneal.train.engine.build_engine = timed_build
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


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


def leg(args, run_dir: Path, stop_at_step: int, resume: str) -> dict:
    """One recipe process up to step ``stop_at_step`` (saved there); its startup, in parts."""
    from anneal.observe.metrics import read_metrics

    recipe = [
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
        "train.eval_samples=0",
        "--set",
        f"train.stop_at_step={stop_at_step}",
    ]
    marks_file = run_dir.parent / f"{run_dir.name}-{stop_at_step}.marks.json"
    env = {**child_env(), "ANNEAL_BENCH_MARKS": str(marks_file)}
    with open(run_dir.parent / f"{run_dir.name}-{stop_at_step}.log", "w") as log:
        launch = time.time()
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, *recipe],
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
    ]
    if st is not None:
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
        lines += [
            "",
            f"| startup ({args.startup_repeats} pairs, seconds) | cold start | `--resume auto` |",
            "|---|---|---|",
            *(
                f"| {name} | {fmt(st['cold'][k])} | {fmt(st['resume'][k])} |"
                for k, name in names.items()
            ),
            "",
            f"Resume / cold start (per pair, median): {res['resume_vs_cold']:.2f}x (goal: under "
            f"2x).",
        ]
    return "\n".join(lines) + "\n"


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
