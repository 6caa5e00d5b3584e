"""Save-time cost of checkpoint integrity: DeepSpeed's save alone (what a save cost before the
manifest had hashes) against ``anneal.checkpoint.save`` (the same save, then every rank hashing
its own files and rank 0 writing the manifest), alternated, on one real engine after one
optimizer step. Prints one JSON line for docs/benchmarks.md.

    PYTHONPATH=. .venv/bin/python bench/bench_checkpoint.py --data data/stdlib [--preset 125m]
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from anneal import checkpoint
from anneal.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from anneal.data.stream import PackedSplit, TokenStream
from anneal.recipe import _single_process_env
from anneal.train import _setup_process, build_engine, next_token_loss, plan_run

parser = argparse.ArgumentParser()
parser.add_argument("--data", required=True)
parser.add_argument("--preset", default="125m")
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()

out = Path(tempfile.mkdtemp(prefix="anneal-bench-ckpt-"))
cfg = RunConfig(
    out=str(out / "run"),
    ds_config="cpu.json",
    resume="none",
    model=ModelConfig(preset=args.preset, seq_len=64),
    data=DataConfig(path=args.data),
    train=TrainConfig(max_steps=10, eval_samples=0),
)
_single_process_env()
_setup_process()
plan = plan_run(cfg, ["ds.gradient_accumulation_steps=1"])
engine = build_engine(plan)
stream = TokenStream(PackedSplit(Path(args.data), "train", seq_len=64), seed=1, rank=0,
                     world_size=1, micro_batch=plan.micro_batch, prefetch=0)  # fmt: skip
x, y = stream.next_batch()
engine.backward(next_token_loss(engine(input_ids=x).logits, y))
engine.step()  # the optimizer state exists from here on

before, after = [], []


def plain(ckpt):
    os.sync()  # each save starts with no dirty pages of the one before
    t0 = time.perf_counter()
    engine.save_checkpoint(str(ckpt / "plain"), tag="step1", client_state={}, save_latest=False)
    before.append(time.perf_counter() - t0)


def hashed(ckpt):
    os.sync()
    t0 = time.perf_counter()
    tag_dir = checkpoint.save(engine, ckpt / "hashed", step=1, keep_last=3,
                              client_state={"step": 1, "tokens": 0, "data": {}})  # fmt: skip
    after.append(time.perf_counter() - t0)
    return tag_dir


for i in range(args.repeats):  # alternate the order: the second save of a pair is not favoured
    ckpt = out / f"ckpt{i}"
    if i % 2:
        tag_dir = hashed(ckpt)
        plain(ckpt)
    else:
        plain(ckpt)
        tag_dir = hashed(ckpt)
    size = sum(p.stat().st_size for p in tag_dir.iterdir())
    t0 = time.perf_counter()
    assert checkpoint.verify(tag_dir) == []
    verify_s = time.perf_counter() - t0
    shutil.rmtree(ckpt)
print(
    json.dumps(
        {
            "bench": "checkpoint_save",
            "preset": args.preset,
            "checkpoint_mb": round(size / 1e6, 1),
            "save_s": [round(t, 3) for t in before],
            "save_hashed_s": [round(t, 3) for t in after],
            "verify_s": round(verify_s, 3),
            "overhead": round(statistics.median(after) / statistics.median(before) - 1, 4),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        }
    )
)
