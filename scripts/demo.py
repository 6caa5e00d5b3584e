"""`make demo`: pretrain the tiny preset on the embedded stdlib corpus with the real
DeepSpeed launcher (2 CPU ranks with ZeRO-3, or every GPU present), then summarise.

Usage: python scripts/demo.py [--steps N] [--out DIR] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from anneal.data.checks import (  # noqa: E402
    compressor_bits_per_byte,
    unigram_entropy_bits_per_byte,
)
from anneal.dist import free_port  # noqa: E402
from anneal.observe.metrics import read_metrics  # noqa: E402
from anneal.rundir import read_evals  # noqa: E402

DEFAULT_STEPS = 320
"""Optimizer steps of the demo: 320 x 2,048 tokens (``BATCH_TOKENS``), 655,360 tokens, a fifth
of an epoch of the corpus, ending at 1.739 validation bits per byte (xz -9e: 1.763). On a fresh
clone 340 steps took 307 s at a median 2,358 tokens/s and their first 320 took 288 s, under
the 5 minutes (docs/benchmarks.md, "Beating the compressors", has the runs that chose it)."""

VAL_WINDOWS = 1_000_000
"""Validation windows: more than the val split holds, so the model is scored on all of it (233
windows of 256 tokens from the stdlib corpus), as the compressors are."""

BATCH_TOKENS = 8 * 256
"""The demo's global batch: 8 sequences of 256 tokens, an eighth of the tiny recipe's 64 (which
splits evenly over the shipped hostfiles' 16 ranks). On the demo's budget of under a million
tokens, more, smaller steps learn more from the same tokens (all at peak LR 3e-3): 340 steps of
8 sequences ended at 1.791 validation bits per byte where 180 of 16, 8% more tokens, ended at
1.843; 400 of 8 at 1.740 where 220 of 16, 10% more tokens, ended at 1.751."""

PEAK_LR = 7e-4
"""The demo's peak LR, measured at this batch and length (340 steps of 8 sequences, WSD): 3e-3,
2e-3, 1.5e-3, 1e-3, 7e-4 and 5e-4 ended at 1.791, 1.761, 1.745, 1.730, 1.715 and 1.739
validation bits per byte. The recipe's 3e-3 was chosen for its batch of 64 sequences."""

SCHEDULE = "wsd"
"""Warmup-stable-decay with the 20% (1 - sqrt) cooldown to 0 (docs/training.md): a cooldown
to 0 that ends the run is what lets a short run reach its lowest loss (tests/train/test_wsd.py: 2.8%
below cosine to 0.1 x peak at the same length)."""


DS_CONFIG = "zero2_bf16.json"
"""ZeRO-2 (fp32 on a CPU): for this 7.4M-parameter model on 2 CPU ranks, ZeRO-3's per-layer
parameter gathers cost more than they save; 80 steps of the demo took 35.5 and 37.6 s at
ZeRO-2 against 41.7 and 41.2 s at ZeRO-3, the same losses (docs/benchmarks.md)."""

MICRO_BATCH = 4
"""Sequences per rank per micro-batch: the 8 of ``BATCH_TOKENS`` over 2 ranks, no accumulation
(zero2_bf16.json's own 8 would round the global batch up to 16)."""

TASK = "anneal_next_line"
"""The downstream task the demo scores before its first step and after its last: the true next
line of a function among four, built from the val split (docs/evaluation.md); chance 25%."""


def demo_command(
    *, n_procs: int, steps: int, out: str, data: str, port: int, sets: Sequence[str] = ()
) -> list[str]:
    """The exact ``deepspeed`` command ``make demo`` runs (tested on the GPU path too);
    ``sets``: more ``--set`` overrides, after the demo's own (the later of two wins)."""
    return [
        str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus",
        str(n_procs),
        "--master_port",
        str(port),
        "recipes/pretrain_tiny.py",
        "--out",
        out,
        "--data",
        data,
        "--max-steps",
        str(steps),
        "--ds-config",
        DS_CONFIG,
        "--set",
        f"ds.train_micro_batch_size_per_gpu={MICRO_BATCH}",
        "--val-every",
        str(steps),
        "--save-every",
        str(max(1, steps // 2)),
        "--set",
        f"train.val_samples={VAL_WINDOWS}",
        "--set",
        f"train.eval_tasks={TASK}",
        "--set",
        "train.eval_tasks_every=0",
        "--set",
        f"optim.schedule={SCHEDULE}",
        "--set",
        f"optim.global_batch_tokens={BATCH_TOKENS}",
        "--set",
        f"optim.lr={PEAK_LR}",
        *(a for s in sets for a in ("--set", s)),
    ]


def downstream(run: Path) -> str:
    """The shipped task's accuracy before the first step and after the last, from the run's
    ``evals/step-N.json`` (the in-loop scorings)."""
    docs = [d for d in read_evals(run) if TASK in d.get("tasks", {})]
    if len(docs) < 2:
        failed = {k: v for d in read_evals(run) for k, v in d.get("failed", {}).items()}
        return f"{TASK}: not scored ({failed.get(TASK, 'no scoring found')})"
    first, last = (d["tasks"][TASK] for d in (docs[0], docs[-1]))
    acc = lambda e: f"{100 * e['metrics']['acc']:.1f}%"  # noqa: E731
    return (
        f"{TASK} (the true next line among 4, {last['n_samples']} items of the val split): "
        f"accuracy {acc(first)} at step {docs[0]['step']} -> {acc(last)} at step "
        f"{docs[-1]['step']} (chance {100 * (last['chance'] or 0.25):.0f}%), "
        f"{docs[-1]['seconds']:.1f} s a scoring"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument(
        "--no-baseline-check",
        action="store_true",
        help="do not fail when the model has not beaten the unigram baseline (runs of a few "
        "steps, e.g. bench/bench_demo.py --smoke)",
    )
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override after the demo's own, repeatable (bench/bench_demo.py --smoke: "
        "a shorter validation and scoring)",
    )
    parser.add_argument("--out", default=f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()

    import torch

    n_procs = torch.cuda.device_count() or 2
    cmd = demo_command(
        n_procs=n_procs,
        steps=args.steps,
        out=args.out,
        data=args.data,
        port=free_port(),
        sets=args.set,
    )
    print("$", " ".join(cmd), flush=True)
    start = time.time()
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc != 0:
        print(f"demo: training failed (exit {rc})", file=sys.stderr)
        return rc
    train = read_metrics(ROOT / args.out, "train")
    val = read_metrics(ROOT / args.out, "val")
    meta = json.loads((ROOT / args.data / "meta.json").read_text())
    split = meta["splits"]["val"]
    base_bpb = unigram_entropy_bits_per_byte(ROOT / args.data, "val")
    base_nats = base_bpb * math.log(2) * split["bytes"] / split["tokens"]
    tok_s = sorted(r["tokens_per_s"] for r in train[len(train) // 10 :])
    scored = downstream(ROOT / args.out)
    packed = compressor_bits_per_byte(ROOT / args.data, "val")
    model_bpb = val[-1]["val_bpb"]
    against = "\n".join(
        f"  {name:<8} {bpb:.4f} bits/byte; the model's {model_bpb:.4f} is "
        f"{100 * abs(1 - model_bpb / bpb):.1f}% {'lower' if model_bpb < bpb else 'HIGHER'}"
        for name, bpb in packed.items()
    )
    print(
        f"\n== demo summary ({time.time() - start:.0f} s) ==\n"
        f"steps {train[-1]['step']}, tokens {train[-1]['tokens']:,} on {n_procs} ranks\n"
        f"final train loss {train[-1]['loss']:.4f} nats/token\n"
        f"final val loss   {val[-1]['val_loss']:.4f} nats/token, "
        f"val bpb {val[-1]['val_bpb']:.4f} bits/byte\n"
        f"unigram baseline {base_nats:.4f} nats/token, {base_bpb:.4f} bits/byte "
        f"(entropy of the val split's token frequencies)\n"
        f"compressors on the val split's {split['bytes']:,} bytes:\n{against}\n"
        f"{scored}\n"
        f"median throughput {tok_s[len(tok_s) // 2]:,.0f} tokens/s\n"
        f"run directory {args.out}"
    )
    cli = [sys.executable, "-m", "anneal.cli"]  # hand it on: a verified HF export, a sample
    hf = str(Path(args.out) / "hf")
    if subprocess.call([*cli, "export", args.out, "--out", hf, "--force"], cwd=ROOT) != 0:
        return 1
    print("\n== sample ==", flush=True)
    subprocess.call([*cli, "generate", hf, "--prompt", "def ", "--max-new-tokens", "48"], cwd=ROOT)
    if val[-1]["val_bpb"] >= base_bpb and not args.no_baseline_check:
        print("demo: the model did not beat the unigram baseline", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
