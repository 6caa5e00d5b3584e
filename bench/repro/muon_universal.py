"""Minimal reproduction, for DeepSpeed's maintainers, of a Muon checkpoint that DeepSpeed's
universal-checkpoint converter cannot convert: the way to resume at another number of ranks or
another ZeRO stage.

A tiny model (two ``nn.Linear``: their weights on Muon, their biases on the auxiliary Adam)
trains one step with ``"optimizer": {"type": "Muon"}`` at the given ZeRO stage and saves;
``ds_to_universal`` then converts the checkpoint. DeepSpeed 0.19.8's converter reads
``exp_avg`` and ``exp_avg_sq`` from every parameter group's optimizer state
(``deepspeed/checkpoint/ds_to_universal.py``, ``extract_zero_shards`` at ZeRO-1/2 and
``extract_zero_shards_stage3`` at ZeRO-3), and a Muon group holds only ``momentum_buffer``, so
it stops with a ``KeyError``. (At ZeRO-1/2 the Muon momentum is also not a slice of the
partition but a buffer over the whole matrices that overlap it, which the universal format's
per-parameter slices could not carry as they are.) Anneal refuses a Muon resume that needs the
conversion before anything starts (``anneal.resolution.optimizer.check_muon_resume``;
docs/training.md, "Muon").

    python bench/repro/muon_universal.py [--stage 1|2|3]  (one process, CPU, gloo; about 90 s
                                                        here, most of it torch.compile)

Seen with DeepSpeed 0.19.8, torch 2.13.0 (CPU), 2026-12-07, at ZeRO-2 and ZeRO-3: ``KeyError:
'exp_avg'``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


def engine(stage: int):
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Muon", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_scatter": False},
    }
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return eng


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    args = p.parse_args()
    import deepspeed
    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    os.environ.update(LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    work = Path(tempfile.mkdtemp(prefix="muon-universal-"))
    try:
        saver = engine(args.stage)
        x = torch.randn(2, 16)
        saver.backward(saver(x).pow(2).mean())
        saver.step()
        saver.save_checkpoint(str(work / "ckpt"), tag="step1")
        state = saver.optimizer.optimizer.state
        kinds = sorted({k for s in state.values() for k in s})
        print(f"saved at ZeRO-{args.stage} with Muon; optimizer state keys: {kinds}")
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        cmd += ["--inject_missing_state", "--input_folder", str(work / "ckpt" / "step1")]
        cmd += ["--output_folder", str(work / "universal" / "step1")]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            print("ds_to_universal converted the Muon checkpoint")
            return 0
        tail = [line for line in done.stderr.splitlines() if line.strip()][-3:]
        print("ds_to_universal failed:\n  " + "\n  ".join(tail))
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
