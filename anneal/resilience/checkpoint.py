"""Checkpoints: DeepSpeed ZeRO shards + client state + a manifest that marks them intact; this
module saves them (with rotation) and loads them.

A tag directory counts as a checkpoint only once ``manifest.json`` is in it
(``anneal.resilience.manifest``: each file's size and xxh3-128 hash, hashed by the rank that
wrote it while a thread fsyncs it). A save writes the manifest (fsync'd) after every rank has
finished, then rewrites ``latest`` (atomically), then prunes old checkpoints. A save killed
midway, or one that fails on a full disk, therefore leaves a directory that resume ignores, and
the previous checkpoint stays the newest; nothing older is deleted before the new one is whole on
the disk, so not even a power cut can leave a manifest whose files were never written.

On resume (``anneal.resilience.resume``), ``verify`` re-hashes the chosen checkpoint (the files
spread over the ranks): a checkpoint whose bytes changed after the save (a torn copy, a bad disk,
a same-size truncation) is reported and, with ``--resume auto``, the newest intact older one is
used instead. No file is unpickled but by torch's weights-only loader
(``anneal.resilience.safeload``), and every file is checked with it before anything loads: a
file it refuses stops the run, with no fallback. A checkpoint saved by another number of ranks is
loaded through its universal form, made under the resuming run's own directory
(``anneal.resilience.universal``).

Nothing read from a checkpoint directory is trusted as a path: every file name in a manifest
and the tag in ``latest`` go through :func:`anneal.files.confined`. A save never deletes a
finished checkpoint: a tag directory with a manifest that is in the way of a new save (a step
saved again after resuming from an older one) is moved to ``checkpoints/.superseded/``.

The manifest's and resume's names that the trainer, the guard, the exporter and the tests use
are offered here too, so that ``checkpoint.read_manifest`` and the like keep working.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from anneal.dist import all_gather, barrier, is_main_process, rank, world_size
from anneal.errors import UserError
from anneal.files import write_atomic
from anneal.resilience import safeload
from anneal.resilience.manifest import (
    HASH,
    MANIFEST,
    damaged_files,
    file_hash,
    is_intact,
    moves_stage,
    read_manifest,
    saved_zero_stage,
    verify,
    write_manifest,
)
from anneal.resilience.resume import (
    LATEST,
    check_checkpoint_tokenizer,
    find_resume,
    intact_checkpoints,
    verified_resume,
)
from anneal.resilience.universal import load_universal
from anneal.resilience.universal import prune as prune_universal

__all__ = [
    "HASH",
    "MANIFEST",
    "SUPERSEDED",
    "check_checkpoint_tokenizer",
    "damaged_files",
    "file_hash",
    "find_resume",
    "gather_rng_states",
    "intact_checkpoints",
    "is_intact",
    "load",
    "read_manifest",
    "rng_state",
    "save",
    "check",
    "check_loaded_state",
    "set_rng_state",
    "step_of_tag",
    "tag_for",
    "to_prune",
    "verified_resume",
    "verify",
]

log = logging.getLogger(__name__)

SUPERSEDED = ".superseded"
"""Where a save moves a finished checkpoint that is in the way (not a tag: names that begin
with a dot are never listed as checkpoints)."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def step_of_tag(name: str) -> int | None:
    """The step a tag directory's name says (``tag_for``'s ``stepNNNNNNNN``, any number of
    digits); None for another name."""
    named = re.fullmatch(r"step(\d+)", name)
    return int(named[1]) if named else None


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng_states() -> list[dict]:
    """RNG states of every rank (client state is written by rank 0 only)."""
    return all_gather(rng_state())


def save(
    engine,
    ckpt_dir: Path,
    *,
    step: int,
    client_state: dict,
    keep_last: int,
    keep_every: int = 0,
    model: dict | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the tag directory.

    Keeps the newest ``keep_last`` intact checkpoints plus, as permanent milestones, those whose
    step is a multiple of ``keep_every`` (0: none), and removes the universal conversions of
    older checkpoints (``anneal.resilience.universal.prune``). ``model``: the model's shape,
    recorded in the manifest so that a resume with another shape is refused before anything
    loads.
    """
    tag_dir = clear_tag(ckpt_dir, step)
    client_state = full_client_state(client_state)
    barrier()
    engine.save_checkpoint(
        str(ckpt_dir), tag=tag_dir.name, client_state=client_state, save_latest=False
    )
    barrier()  # every rank's files are complete before any rank lists them
    write_manifest(tag_dir, step=step, client_state=client_state, model=model)
    publish(ckpt_dir, tag_dir, step=step, keep_last=keep_last, keep_every=keep_every)
    return tag_dir


def clear_tag(ckpt_dir: Path, step: int) -> Path:
    """The tag directory of a save at ``step``, cleared by rank 0 of what is in the way (no
    collective): its files would mix with the new ones. A save that never finished (no
    manifest) is removed; anything else, a finished checkpoint of an earlier timeline (this run
    resumed from an older tag, or fell back past a damaged one), is kept aside."""
    tag_dir = ckpt_dir / tag_for(step)
    if is_main_process() and (tag_dir.exists() or tag_dir.is_symlink()):
        if tag_dir.is_dir() and not tag_dir.is_symlink() and not (tag_dir / MANIFEST).exists():
            shutil.rmtree(tag_dir)
        else:
            _move_aside(tag_dir)
    return tag_dir


def full_client_state(client_state: dict) -> dict:
    """Collective: the Trainer's client state with every rank's RNG and the world size, as a
    checkpoint holds it."""
    return {**client_state, "rng": gather_rng_states(), "world_size": world_size()}


def publish(ckpt_dir: Path, tag_dir: Path, *, step: int, keep_last: int, keep_every: int) -> None:
    """Collective, once ``tag_dir``'s manifest is written: rank 0 points ``latest`` at it, then
    removes what keep-K and the universal conversions no longer need; a barrier ends it."""
    if is_main_process():
        write_atomic(ckpt_dir / LATEST, tag_dir.name, durable=True)
        for old in to_prune(intact_checkpoints(ckpt_dir), keep_last, keep_every):
            shutil.rmtree(old, ignore_errors=True)
        prune_universal(ckpt_dir, saved_step=step)
    barrier()


def _move_aside(tag_dir: Path) -> Path:
    """Move ``tag_dir`` to ``<checkpoints>/.superseded/<tag>.<time>`` and say so."""
    dest = tag_dir.parent / SUPERSEDED / f"{tag_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}"
    if dest.exists():
        dest = dest.with_name(f"{dest.name}.{os.getpid()}")
    dest.parent.mkdir(exist_ok=True)
    tag_dir.rename(dest)
    log.warning("%s was in the way of a new save at that step: moved to %s", tag_dir, dest)
    return dest


def to_prune(intact: list[Path], keep_last: int, keep_every: int) -> list[Path]:
    """Of the intact checkpoints (oldest first), those neither among the newest ``keep_last``
    nor a milestone (step a multiple of ``keep_every``)."""
    if keep_last <= 0:
        return []
    return [
        p
        for p in intact[:-keep_last]
        if not (keep_every > 0 and read_manifest(p)["step"] % keep_every == 0)
    ]


def load(
    engine,
    tag_dir: Path,
    *,
    ckpt_dir: Path,
    expert_parallel: int = 1,
    tensor_parallel: int = 1,
    zero_stage: int | None = None,
) -> dict:
    """Collective. Restores model, optimizer, scheduler and this rank's RNG; returns the client
    state (step, tokens, data position, guard state).

    Every file is read by torch's weights-only loader (``anneal.resilience.safeload``): each is
    checked first, on every rank, so that a refusal stops every rank before anything loads;
    DeepSpeed then reads them through that loader too. A checkpoint written by another number
    of ranks, at another expert-parallel or tensor-parallel degree than ``expert_parallel`` and
    ``tensor_parallel``, or at ZeRO-1/2 for a
    job at ZeRO-3 (``zero_stage``) or the other way, is converted once to DeepSpeed's universal
    format, under ``ckpt_dir`` (the checkpoints directory of the run that resumes, never the
    source's), and loaded from there."""
    check(tag_dir)
    manifest = read_manifest(tag_dir)
    saved_ranks = manifest.get("world_size", world_size())
    saved_ep = manifest.get("expert_parallel_size", 1)
    saved_tp = manifest.get("tensor_parallel_size", 1)
    same = (saved_ranks, saved_ep, saved_tp) == (world_size(), expert_parallel, tensor_parallel)
    safeload.install(engine)
    with safeload.loading():
        if same and not moves_stage(saved_zero_stage(manifest), zero_stage):
            path, client = engine.load_checkpoint(
                str(tag_dir.parent),
                tag=tag_dir.name,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )
        else:
            path, client = load_universal(
                engine,
                tag_dir,
                ckpt_dir=ckpt_dir,
                saved=(saved_ranks, saved_ep, saved_tp),
                here=(world_size(), expert_parallel, tensor_parallel),
            )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {tag_dir}.")
    check_loaded_state(tag_dir, manifest, client)
    rngs = client["rng"]
    set_rng_state(rngs[rank() % len(rngs)])
    return client


def check_loaded_state(tag_dir: Path, manifest: dict, client: dict) -> None:
    """UserError (every rank) unless the state DeepSpeed loaded holds the step and tokens that
    the manifest records. Resume chooses a checkpoint, and a cooldown branch its start and its
    length, by the manifest's step; a manifest edited to agree with a renamed tag, over the
    files of another step, would otherwise continue from the files' step (a branch from a
    later one has nothing left to train and exits 0)."""
    diffs = [
        f"{key} {str(manifest[key])[:40]} there, {str(client.get(key))[:40]} in the state"
        for key in ("step", "tokens")
        if manifest.get(key) is not None and client.get(key) != manifest[key]
    ]
    if diffs:
        raise UserError(
            f"checkpoint {tag_dir}: the training state loaded from its files is not the one its "
            f"{MANIFEST} records ({'; '.join(diffs)}): the manifest was edited, or the files "
            f"come from another checkpoint, and the run would go on from another step than the "
            f"one it chose; it stops before any step from there. Resume (or branch) from a "
            f"checkpoint as its run saved it, or restore this one.",
            every_rank=True,
        )


def check(tag_dir: Path) -> None:
    """``anneal.resilience.safeload.check_checkpoint`` for every ``*.pt`` under ``tag_dir`` (not
    a hidden leftover, which nothing loads), on every rank: each reads these files anyway, and
    the verdict is the same everywhere. A refusal stops the run: there is no fallback to an older
    checkpoint, because files whose hashes match their manifest were not damaged by a crash or a
    disk, they were written so."""
    tag_dir = Path(tag_dir)
    try:
        safeload.check_checkpoint(tag_dir, skip_hidden=True)
    except UserError as e:
        raise UserError(
            f"checkpoint {tag_dir} was not loaded, and resume does not fall back to an older "
            f"one: {e} Its files match the manifest, so this is no damage from a crash or a "
            f"disk: the file was written so, or put there; treat the run directory as tampered "
            f"with. Resume from a checkpoint you trust (--resume PATH), or start a new run in a "
            f"new --out.",
            every_rank=True,
        ) from None
