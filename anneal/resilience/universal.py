"""Resuming a ZeRO-3 checkpoint on another number of ranks: the checkpoint is converted once to
DeepSpeed's universal format (cached in ``<tag>/universal``, made in a hidden temporary directory
and renamed when complete) and loaded from there, and two things DeepSpeed's universal load gets
wrong are put right after it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from anneal.dist import barrier, is_main_process, world_size
from anneal.errors import UserError

log = logging.getLogger(__name__)

UNIVERSAL = "universal"


def load_universal(engine, tag_dir: Path, saved_ranks: int):
    """Collective. ``engine.load_checkpoint``'s (path, client state) for a checkpoint saved by
    ``saved_ranks`` ranks, through its universal form; refused below ZeRO-3."""
    stage = engine.zero_optimization_stage()
    if stage != 3:
        raise UserError(
            f"{tag_dir} was saved by {saved_ranks} ranks and this job has {world_size()}. "
            f"Resuming on another number of ranks is supported for ZeRO-3 (this run uses ZeRO "
            f"stage {stage}): resume with {saved_ranks} ranks.",
            every_rank=True,
        )
    universal = to_universal(tag_dir)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    log.warning(
        "%s was saved by %d ranks, this job has %d: loading its universal form %s",
        tag_dir,
        saved_ranks,
        world_size(),
        universal,
    )
    engine._config.load_universal_checkpoint = True  # for this one load
    try:
        loaded = engine.load_checkpoint(
            str(tag_dir), tag=UNIVERSAL, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    finally:
        engine._config.load_universal_checkpoint = False
    repair_universal_load(engine, hyper)
    return loaded


def to_universal(tag_dir: Path) -> Path:
    """Collective. ``<tag>/universal``: the checkpoint in DeepSpeed's universal format, made by
    rank 0 with ``python -m deepspeed.checkpoint.ds_to_universal`` the first time (into a
    temporary directory, renamed when complete)."""
    import subprocess
    import sys

    out = tag_dir / UNIVERSAL
    if is_main_process() and not out.is_dir():
        tmp = tag_dir / f".{UNIVERSAL}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(tag_dir),
            "--output_folder",
            str(tmp),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"converting {tag_dir} to a universal checkpoint failed ({done.returncode}):\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            )
        tmp.rename(out)
    barrier()
    return out


def repair_universal_load(engine, hyper: list[dict]) -> None:
    """Undo two things DeepSpeed 0.19.8's ZeRO-3 universal load gets wrong: it copies the first
    param group's hyperparameters into every group (the no-decay group would get weight decay)
    and gives every sub-group one shared Adam ``step`` tensor (stepped once per sub-group per
    optimizer step). ``hyper``: each group's hyperparameters before the load."""
    for group, before in zip(engine.optimizer.param_groups, hyper, strict=True):
        group.update({k: v for k, v in before.items() if k != "lr"})
    inner = engine.optimizer.optimizer
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    engine.lr_scheduler.scale_peak(1.0)  # the LR of every group from the restored schedule
    log.info(
        "param groups after the universal load: weight_decay %s",
        [g["weight_decay"] for g in engine.optimizer.param_groups],
    )
