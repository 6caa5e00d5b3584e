"""`make demo`: pretrain the tiny preset on the embedded stdlib corpus with the real
DeepSpeed launcher (2 CPU ranks with ZeRO-3, or every GPU present), then summarise.

Usage: python scripts/demo.py [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from anneal.data.prepared import unigram_entropy_bits_per_byte  # noqa: E402
from anneal.dist import free_port  # noqa: E402
from anneal.observe.metrics import read_metrics  # noqa: E402

DEFAULT_STEPS = 50
"""Optimizer steps of the demo: 50 x 16,384 tokens, a quarter of an epoch of the corpus."""


def demo_command(*, n_procs: int, steps: int, out: str, data: str, port: int) -> list[str]:
    """The exact ``deepspeed`` command ``make demo`` runs (tested on the GPU path too)."""
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
        "--eval-every",
        str(max(1, steps // 4)),
        "--save-every",
        str(max(1, steps // 2)),
    ]


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
    parser.add_argument("--out", default=f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()

    import torch

    n_procs = torch.cuda.device_count() or 2
    cmd = demo_command(
        n_procs=n_procs, steps=args.steps, out=args.out, data=args.data, port=free_port()
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
    print(
        f"\n== demo summary ({time.time() - start:.0f} s) ==\n"
        f"steps {train[-1]['step']}, tokens {train[-1]['tokens']:,} on {n_procs} ranks\n"
        f"final train loss {train[-1]['loss']:.4f} nats/token\n"
        f"final val loss   {val[-1]['val_loss']:.4f} nats/token, "
        f"val bpb {val[-1]['val_bpb']:.4f} bits/byte\n"
        f"unigram baseline {base_nats:.4f} nats/token, {base_bpb:.4f} bits/byte "
        f"(entropy of the val split's token frequencies)\n"
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
