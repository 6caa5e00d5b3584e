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
(``anneal.launch.parallel.check_resume_stage``; docs/resilience.md, "Resuming at another
layout").

    python bench/zero_stage_universal_repro.py [--from 2 --to 3] [--same]  (one process, CPU,
                                                                             gloo; about 20 s)

Seen with DeepSpeed 0.19.8, torch 2.13.0 (CPU).
"""

from __future__ import annotations

import argparse
import os
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


def neutral(d):
    """EXPERIMENT: make the universal folder loadable at either stage."""
    import shutil
    import torch
    z3 = d / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    z2 = d / "mp_rank_00_model_states.pt"
    if not z3.exists():
        shutil.copy(z2, z3)
    if not z2.exists():
        shutil.copy(z3, z2)
    osd = torch.load(d / "zero" / "optimizer_state.pt", weights_only=False)
    ms = torch.load(z2, weights_only=False)
    step = None
    for folder in sorted((d / "zero").iterdir()):
        if not folder.is_dir():
            continue
        if (folder / "step.pt").exists():
            step = torch.load(folder / "step.pt", weights_only=False)
    if step is None:
        step = osd["optimizer_state_dict"]["state"][0]["step"]
    for folder in sorted((d / "zero").iterdir()):
        if not folder.is_dir():
            continue
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            t = torch.load(folder / f"{key}.pt", weights_only=False)
            if torch.is_tensor(t):
                torch.save({"param": t, "cat_dim": 0}, folder / f"{key}.pt")
        if not (folder / "step.pt").exists():
            torch.save(step, folder / "step.pt")
    osd.setdefault("ds_version", ms["ds_version"])
    osd.setdefault("clip_grad", 1.0)
    osd.setdefault("optimizer_state_dict", {"state": {0: {"step": step}}, "param_groups": osd["param_groups"]})
    torch.save(osd, d / "zero" / "optimizer_state.pt")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="saved", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--to", dest="loaded", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--same", action="store_true", help="load at the saving stage (works)")
    p.add_argument("--rename", action="store_true", help="EXPERIMENT: copy the model states file to the loading stage's name")
    args = p.parse_args()
    loaded = args.saved if args.same else args.loaded

    import deepspeed
    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    os.environ.update(LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    work = Path(tempfile.mkdtemp(prefix="zero-stage-universal-"))

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

    if args.rename:
        neutral(work / "universal" / "step1")
    loader = engine(loaded, universal=True)
    try:
        path, _ = loader.load_checkpoint(str(work / "universal"), tag="step1")
    except AssertionError:
        traceback.print_exc()
        print(f"\nZeRO-{args.saved} -> ZeRO-{loaded}: the universal load failed (above).")
        return 1
    print(f"ZeRO-{args.saved} -> ZeRO-{loaded}: loaded from {path}")
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    for (n1, p1), (n2, p2) in zip(saver.module.named_parameters(), loader.module.named_parameters()):
        a, b = safe_get_full_fp32_param(p1), safe_get_full_fp32_param(p2)
        ea, eb = safe_get_full_optimizer_state(p1, "exp_avg"), safe_get_full_optimizer_state(p2, "exp_avg")
        sa, sb = safe_get_full_optimizer_state(p1, "exp_avg_sq"), safe_get_full_optimizer_state(p2, "exp_avg_sq")
        print(n1, (a - b).abs().max().item(), (ea - eb).abs().max().item(), (sa - sb).abs().max().item())
    print([{k: v for k, v in g.items() if k != "params"} for g in loader.optimizer.param_groups])
    print("steps", [v.get("step") for v in loader.optimizer.optimizer.state.values()])
    y1 = saver(x); y2 = loader(x)
    print("out diff", (y1 - y2).abs().max().item())
    return 0


if __name__ == "__main__":
    sys.exit(main())
