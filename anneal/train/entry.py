"""A rank's way into training: ``run(cfg)`` checks everything, builds the engine and loads the
checkpoint before anything is written to the run directory (``anneal.rundir.RunDir``), then
hands the pieces to the Trainer (``anneal.train.trainer``), whose ``train`` is the loop.

Split from the Trainer by meaning: what happens once, before the first step and before the run
directory is claimed, lives here; what a run does step after step lives with the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from anneal import rundir
from anneal.config.run import RunConfig
from anneal.config.run_checks import check_ranges
from anneal.dist import print0, rank
from anneal.resilience import checkpoint
from anneal.resilience.guard import Guard
from anneal.resilience.preempt import Preempted
from anneal.rundir import RunDir
from anneal.train.engine import build_engine, resolve_run, setup_process
from anneal.train.trainer import Data, Trainer

log = logging.getLogger(__name__)


def run(cfg: RunConfig, overrides: list[str] = ()) -> dict:
    """Train per ``cfg``. Returns a summary (final losses, tokens/s, run directory).

    Everything is checked (``resolve_launch``), the engine built and the checkpoint loaded before
    anything is written to the run directory; a launch that fails after that but before its
    first step puts the directory back as it found it (``RunDir``), so the corrected relaunch
    starts cleanly instead of meeting the config of a run that never trained."""
    check_ranges(cfg)  # before the process group: collective_timeout_s goes there
    setup_process(cfg.train.collective_timeout_s)
    launch = resolve_run(cfg, overrides)
    log_notes(launch.notes, rank=rank())
    torch.manual_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    data = Data.open(launch)
    print0(launch.describe())
    engine = build_engine(launch)
    recompute = getattr(engine.module, "is_activation_checkpointing", False)
    print0(f"activation checkpointing {'on' if recompute else 'off'}")
    t0 = time.perf_counter()
    resume_from = launch.resume_from and checkpoint.verified_resume(
        launch.resume_from,
        fallback=launch.cfg.resume == "auto",  # a cooldown branch: its parent's tag
    )
    resumed = {"verify_s": round(time.perf_counter() - t0, 3)}
    guard = Guard(cfg.guard, run_dir=launch.out, resuming=resume_from is not None)
    client = None
    if resume_from is not None:
        t0 = time.perf_counter()
        client = checkpoint.load(
            engine,
            resume_from,
            ckpt_dir=rundir.checkpoints_dir(launch.out),
            expert_parallel=launch.layout.expert_parallel,
            tensor_parallel=launch.layout.tensor_parallel,
            zero_stage=launch.zero_stage,
        )
        resumed.update(checkpoint=str(resume_from), load_s=round(time.perf_counter() - t0, 3))
    run_dir = RunDir.for_launch(launch)
    try:
        return Trainer(launch, engine, guard, run_dir, data).train(client, resumed)
    except Preempted:  # stopped inside the first step: its checkpoint (step 0) is kept
        raise
    except BaseException:
        run_dir.undo()
        raise


ROUTINE_NOTES = ("resume: ",)
"""Notes of what the docs call routine (a resume at another layout: docs/resilience.md), logged
as INFO; every other note is a WARNING (something the user did not ask for)."""


def log_notes(notes: Sequence[str], *, rank: int) -> None:
    """What the launch changed or decided that the user did not write (``Launch.notes``), once:
    every rank resolves the same launch, so rank 0 says it for all."""
    if rank == 0:
        for note in notes:
            routine = note.startswith(ROUTINE_NOTES)
            log.log(logging.INFO if routine else logging.WARNING, note)
