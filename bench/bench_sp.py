"""Ulysses sequence parallelism (``ds.sequence_parallel_size``, ``anneal/train/sequence.py``) on
CPU: the peak memory per rank of a training step at a long sequence, SP=2 on 2 ranks against
SP=1 on 1 rank, for a micro model.

    python bench/bench_sp.py                        # seq 8192 and 256, SP 1 and 2: ~4 minutes
    python bench/bench_sp.py --seq 2048 --base-seq 128 --steps 1         # short: ~1 minute
    python bench/bench_sp.py --smoke     # CI: seq 32 alone, one step, SP=2's ranks forked by
                                         # tests/scripts/ranks.py (not the deepspeed runner)

(docs/benchmarks.md, "Sequence parallelism": peak memory on 2 shared cores.)

Each arm is a real launch through Anneal's own pieces (``resolve_launch``, ``build_engine``,
the token stream and ``train_step``, ZeRO-2, fp32, the chunked loss) on a prepared byte-level
corpus, one thread per rank, micro-batch 1: it takes ``--steps`` steps and each rank reports its
resident memory before the first step and its peak RSS (``getrusage``: large tensors are
mmapped and unmapped when freed, so the peak RSS follows the peak of live tensors; the arms run
with glibc's mmap threshold fixed at 128 KiB, as left to itself it rises after the first frees
and freed tensors then stay resident: two runs so read SP=2 / SP=1 activations of 0.558 and
0.579, both arms 1.5x larger, where two runs at the fixed threshold read 0.517 and 0.520). A step's
activations are the peak minus the memory before the first step; the same arm at ``--base-seq``
(a short sequence, whose activations are small) gives what that difference holds besides them
(the optimizer states made at the first step, the collectives' buffers), and is subtracted, so
``activations = (peak - before) at --seq - (peak - before) at --base-seq`` for each SP degree,
per rank (the largest rank's). The micro model is the ``tiny`` preset's width (256, 4 heads of
64), 2 layers, its vocabulary the corpus's (300).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from train_run import launcher  # noqa: E402 (bench/, the script's folder)

TINY = REPO / "recipes" / "pretrain_tiny.py"
SHAPE = [
    "model.hidden_size=256",
    "model.intermediate_size=688",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
]


def corpus(out: Path, *, tokens: int) -> Path:
    """A byte-level corpus of about ``tokens`` tokens (prepared once per directory)."""
    from anneal.data.prepare import prepare
    from anneal.data.prepared_dir import PreparedDir

    data = out / "data"
    if not PreparedDir(data).meta_file.exists():
        src = out / "text.txt"
        doc = "the quick brown fox jumps over the lazy dog; " * 40  # 1,800 characters
        n_docs = 3 * tokens // len(doc) + 1  # at least a token per 3 characters
        src.write_text("\n\n".join(f"doc {i}: {doc}" for i in range(n_docs)))
        prepare(inputs=[str(src)], out=data, vocab_size=300, val_fraction=0.0, progress=False)
    return data


def worker(args) -> None:
    """One rank of an arm: build the engine as a launch does, take the steps, print a row."""
    import numpy as np

    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.data.stream import PackedSplit, TokenStream
    from anneal.dist import rank, shutdown
    from anneal.hardware import process_memory_bytes
    from anneal.train.engine import build_engine, data_replica, resolve_run, setup_process
    from anneal.train.step import StepShape, TrainState, train_step

    argv = ["--out", args.run, "--data", args.data, "--max-steps", str(args.steps + 1)]
    for s in [
        *SHAPE,
        f"model.seq_len={args.seq}",
        "train.val_samples=0",
        "ds.train_micro_batch_size_per_gpu=1",
        "ds.gradient_accumulation_steps=1",
        "ds.zero_optimization.stage=2",
        f"ds.sequence_parallel_size={args.sp}",
    ]:
        argv += ["--set", s]
    cfg, overrides = config_from_args(argv, prog=str(TINY), on_cpu=True, **load_recipe(TINY))
    setup_process()
    launch = resolve_run(cfg, overrides)
    engine = build_engine(launch)
    dp_rank, dp_size = data_replica(engine)
    split = PackedSplit(Path(args.data), "train", seq_len=launch.seq_len)
    stream = TokenStream(split, seed=0, rank=dp_rank, world_size=dp_size, micro_batch=1)
    state, shape, losses = TrainState(), StepShape.of(launch), []
    before = process_memory_bytes()
    for _ in range(args.steps):
        losses.append(train_step(engine, stream, state, shape)["loss"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    stream.close()
    row = {"rank": rank(), "sp": args.sp, "seq": args.seq, "before": before, "peak": peak}
    row["losses"] = [float(np.float64(x)) for x in losses]
    with open(Path(args.run) / f"rank{rank()}.json", "w") as f:
        json.dump(row, f)
    shutdown()


def arm(args, *, sp: int, seq: int, tmp: Path) -> list[dict]:
    run = tmp / f"sp{sp}-seq{seq}"
    run.mkdir()
    flags = ["--worker", "--data", str(args.data), "--run", str(run)]
    flags += ["--sp", str(sp), "--seq", str(seq), "--steps", str(args.steps)]
    from anneal.dist import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # glibc mmaps blocks from 128 KiB and unmaps them when freed; left to itself it raises that
    # threshold (up to 32 MiB) after the first frees, and the freed tensors then stay resident
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    if sp == 1:  # a world of one, as a plain `python recipes/...` makes it
        env |= dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        env |= dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cmd = [sys.executable, __file__, *flags]
    else:  # --smoke: forked ranks (train_run.launcher), not the deepspeed runner's processes
        cmd = [*launcher("recipe", sp, args.smoke), __file__, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if done.returncode:
        sys.exit(f"arm SP={sp} seq={seq} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads((run / f"rank{r}.json").read_text()) for r in range(sp)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--base-seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--data", default="", help="a prepared corpus (default: made in a temp dir)")
    p.add_argument("--smoke", action="store_true", help="seq 32 alone, one step (CI)")
    p.add_argument("--report", help="write a markdown fragment for docs/benchmarks.md here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed runner's
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.seq, args.base_seq, args.steps = 32, 32, 1  # 2 launches: the script runs
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        args.data = args.data or str(corpus(tmp, tokens=(args.steps + 4) * (args.seq + 1)))
        rows = {
            (sp, seq): arm(args, sp=sp, seq=seq, tmp=tmp)
            for sp in (1, 2)
            for seq in dict.fromkeys((args.base_seq, args.seq))  # --smoke: one length
        }
    mib = 2**20
    result = {"machine": platform.platform(), "seq": args.seq, "base_seq": args.base_seq}
    for sp in (1, 2):
        seqs = (args.base_seq, args.seq)
        grow = {seq: max(r["peak"] - r["before"] for r in rows[sp, seq]) for seq in seqs}
        result[f"sp{sp}"] = {
            "peak_mib": round(max(r["peak"] for r in rows[sp, args.seq]) / mib, 1),
            "before_mib": round(max(r["before"] for r in rows[sp, args.seq]) / mib, 1),
            "base_growth_mib": round(grow[args.base_seq] / mib, 1),
            "activations_mib": round((grow[args.seq] - grow[args.base_seq]) / mib, 1),
            "losses": rows[sp, args.seq][0]["losses"],
        }
    base = result["sp1"]["activations_mib"]  # 0 under --smoke: one sequence length
    ratio = result["sp2"]["activations_mib"] / base if base else None
    result["activations_ratio"] = None if ratio is None else round(ratio, 3)
    print(json.dumps(result, indent=2))
    if args.report:
        Path(args.report).write_text(
            f"### bench_sp.py, seq {args.seq} against {args.base_seq}\n\n"
            "| | SP=1 | SP=2 (per rank) |\n|---|---:|---:|\n"
            + "".join(
                f"| {key} | {result['sp1'][key]} | {result['sp2'][key]} |\n"
                for key in ("activations_mib", "peak_mib", "before_mib")
            )
            + f"\nSP=2 / SP=1 activations: {result['activations_ratio']}\n"
        )


if __name__ == "__main__":
    main()
