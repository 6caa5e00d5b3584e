"""How much DeepSpeed 0.19.8's Muon under AutoTP (TP=2) departs from the same run at TP=1: the
measure behind Anneal's refusal of ``optim.optimizer=muon`` with ``tensor_parallel.autotp_size``
above 1 (``anneal.resolution.optimizer``). DeepSpeed directly, not through Anneal.

A 2-layer Llama (hidden 128, 4 heads, MLP 352, vocab 512, 0.53M parameters), fp32, gloo on CPU,
ZeRO-1, the same init (seed 0, AutoTP shards the whole model after it is built) and the same
batches (8 sequences of 64 tokens a step, each an arithmetic run ``start + k*i`` mod 512 that
the model can learn) at TP=1 on one rank and at TP=2 on two (one TP group, data-parallel size
1, so each rank sees every sequence). ``--steps`` optimizer steps of each of:

- AdamW (``torch_adam``, lr 1e-3): the control. AutoTP only changes the order of the
  reductions, so its difference is round-off.
- Muon (``muon_lr`` 0.02, DeepSpeed's default, ``adam_lr`` 1e-3): under AutoTP each rank
  orthogonalizes its own shard of a matrix (half the rows of q/k/v/gate/up, half the columns
  of o/down) and scales it by the shard's ``sqrt(max(1, rows/cols))``, which is another update
  than the whole matrix's.

Newton-Schulz runs eagerly and in fp32 as in every Anneal CPU run
(``anneal.train.muon_engine.cpu_newton_schulz``, imported: the only Anneal code used), so that
DeepSpeed's half-precision iteration on a CPU is not mistaken for TP's effect.

    .venv/bin/python bench/repro/muon_autotp.py [--steps 10]   (about a minute here)

Printed: per step, each optimizer's loss at TP=1 and TP=2 and their relative difference, and the
largest over the run. The figure is cited in the refusal and in docs/training.md.

Seen with DeepSpeed 0.19.8, torch 2.13.0 (CPU), 2026-12-07 (74 s, load average 4 to 8 from other
work): rank 0's q_proj is a [64, 128] shard at TP=2 ([128, 128] at TP=1), on Muon; AdamW's
losses at TP=2 within 1.6e-7 relative of TP=1's over the 10 steps; Muon's equal at step 1 (the
same init), then 3.0e-5 apart at step 2, 1.2e-4 at step 5 and 3.0e-4 at step 10, growing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ, BATCH = 512, 64, 8


def batches(steps: int):
    """``steps`` batches of learnable sequences, the same in every process (seeded)."""
    import torch

    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (BATCH, 1), generator=g)
        yield (start + stride * torch.arange(SEQ)) % VOCAB


def optimizer(kind: str) -> dict:
    if kind == "adamw":
        return {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    return {
        "type": "Muon",
        "params": {"muon_lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "torch_adam": True},
    }


def worker(kind: str, tp: int, steps: int, out: Path) -> None:
    """One rank: train ``steps`` steps and (rank 0) write the losses to ``out``."""
    import deepspeed
    import torch
    from deepspeed.utils import groups
    from transformers import LlamaConfig, LlamaForCausalLM

    from anneal.train.muon_engine import cpu_newton_schulz

    deepspeed.init_distributed(dist_backend="gloo")
    cpu_newton_schulz()
    ds = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": optimizer(kind),
        "zero_optimization": {"stage": 1},
    }
    if tp > 1:
        ds["tensor_parallel"] = {"autotp_size": tp}
        groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(config)
    engine, *_ = deepspeed.initialize(model=model, config=ds, mpu=groups if tp > 1 else None)
    q = engine.module.model.layers[0].self_attn.q_proj.weight
    shards = {"q_proj": list(q.shape), "muon": bool(getattr(q, "use_muon", False))}
    losses = []
    for x in batches(steps):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps({"losses": losses, **shards}))


def launch(kind: str, tp: int, steps: int, work: Path) -> list[float]:
    """``tp`` processes of ``worker``; rank 0's losses, its q_proj's shape and Muon tag."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / f"{kind}-tp{tp}.json"
    procs = []
    for rank in range(tp):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(tp))
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        cmd = [sys.executable, __file__, "--worker", kind, "--tp", str(tp)]
        cmd += ["--steps", str(steps), "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"{kind} at TP={tp} failed (its stderr is above)")
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--worker", choices=("adamw", "muon"), help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.tp, args.steps, Path(args.out))
        return 0
    largest = {}
    with tempfile.TemporaryDirectory(prefix="muon-autotp-") as tmp:
        for kind in ("adamw", "muon"):
            runs = [launch(kind, tp, args.steps, Path(tmp)) for tp in (1, 2)]
            for tp, r in zip((1, 2), runs, strict=True):  # AutoTP sharded it, Muon took it
                print(f"{kind} TP={tp}: rank 0's q_proj {r['q_proj']}, on Muon: {r['muon']}")
            one, two = (r["losses"] for r in runs)
            rel = [abs(b - a) / abs(a) for a, b in zip(one, two, strict=True)]
            for step, (a, b, r) in enumerate(zip(one, two, rel, strict=True), start=1):
                print(f"{kind:5} step {step:2}: loss TP=1 {a:.6f}  TP=2 {b:.6f}  rel diff {r:.2e}")
            largest[kind] = max(rel)
    print(json.dumps({"repro": "muon_autotp", "steps": args.steps, "largest_rel_diff": largest}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
