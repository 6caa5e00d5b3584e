"""Minimal reproduction, for DeepSpeed's maintainers, of a universal checkpoint not loading at
another ZeRO stage than the one that saved it: ZeRO-2 -> ZeRO-3, or ZeRO-3 -> ZeRO-2.

A tiny model trains one step at the saving stage and saves; ``ds_to_universal`` converts the
checkpoint (``--inject_missing_state``: a plain ``nn.Module`` writes no universal-checkpoint
info); an engine at the other stage then loads it with ``"checkpoint": {"load_universal":
true}``. DeepSpeed 0.19.8 stops in ``engine.load_checkpoint`` at ``assert len(self.ckpt_list) >
0`` (``deepspeed/runtime/state_dict_factory.py``, ``check_ckpt_list``): the universal folder
keeps the saving stage's model-state file names (``mp_rank_00_model_states.pt`` for ZeRO-1/2,
``zero_pp_rank_0_mp_rank_00_model_states.pt`` for ZeRO-3), and the loading stage looks for its
own. ``--same`` loads at the saving stage instead, which works: the universal folder itself is
sound. Anneal refuses such a resume before anything starts
(``anneal.resolution.parallel.check_resume_stage``; docs/resilience.md, "Resuming at another
layout").

    python bench/repro/zero_stage_universal.py [--from 2 --to 3] [--same | --repaired]
                                                           (one process, CPU, gloo; about 20 s)

``--repaired`` adds what the other stage's loader looks for first
(``anneal.resilience.universal_stages.either_stage``); the load then succeeds, with the
weights, Adam moments and step of the engine that saved.

Seen with DeepSpeed 0.19.8, torch 2.13.0 (CPU).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path


def engine(stage: int, *, universal: bool):
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "checkpoint": {"load_universal": universal},
    }
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return eng


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="saved", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--to", dest="loaded", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--same", action="store_true", help="load at the saving stage (works)")
    p.add_argument(
        "--repaired",
        action="store_true",
        help="first make the folder loadable at both stages, as Anneal does "
        "(anneal.resilience.universal_stages.either_stage), and compare the loaded state",
    )
    args = p.parse_args()
    loaded = args.saved if args.same else args.loaded

    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    os.environ.update(LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    work = Path(tempfile.mkdtemp(prefix="zero-stage-universal-"))
    try:
        return run(args, loaded, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, loaded: int, work: Path) -> int:
    import torch

    saver = engine(args.saved, universal=False)
    x = torch.randn(2, 16)
    saver.backward(saver(x).pow(2).mean())
    saver.step()
    saver.save_checkpoint(str(work / "ckpt"), tag="step1")
    print(f"saved at ZeRO-{args.saved}: {sorted(os.listdir(work / 'ckpt' / 'step1'))}")

    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state"]
    cmd += ["--input_folder", str(work / "ckpt" / "step1")]
    cmd += ["--output_folder", str(work / "universal" / "step1")]
    subprocess.run(cmd, check=True, capture_output=True)
    print(f"universal folder: {sorted(os.listdir(work / 'universal' / 'step1'))}")

    if args.repaired:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from anneal.resilience.universal_stages import either_stage

        either_stage(work / "universal" / "step1")
    loader = engine(loaded, universal=True)
    try:
        path, _ = loader.load_checkpoint(str(work / "universal"), tag="step1")
    except AssertionError:
        traceback.print_exc()
        print(f"\nZeRO-{args.saved} -> ZeRO-{loaded}: the universal load failed (above).")
        return 1
    print(f"ZeRO-{args.saved} -> ZeRO-{loaded}: loaded from {path}")
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    worst = 0.0
    for p1, p2 in zip(saver.module.parameters(), loader.module.parameters(), strict=True):
        worst = max(
            worst, (safe_get_full_fp32_param(p1) - safe_get_full_fp32_param(p2)).abs().max()
        )
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = safe_get_full_optimizer_state(p1, key), safe_get_full_optimizer_state(p2, key)
            worst = max(worst, (a - b).abs().max())
    steps = {float(v["step"]) for v in loader.optimizer.optimizer.state.values()}
    print(f"largest difference in weights and Adam moments: {float(worst)}; Adam step {steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
