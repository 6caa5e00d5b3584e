"""Checkpoints: DeepSpeed ZeRO shards + client state + a manifest that marks them intact.

A tag directory counts as a checkpoint only once ``manifest.json`` is in it; the manifest is
written by rank 0 after every rank has finished ``engine.save_checkpoint``, and ``latest`` is
rewritten (atomically) after that. A save killed midway therefore leaves a directory that resume
ignores, and the previous checkpoint stays the newest.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from anneal.dist import is_main_process, rank, world_size
from anneal.errors import UserError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def tag_for(step: int) -> str:
    return f"step{step:08d}"


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
    if world_size() == 1:
        return [rng_state()]
    states: list = [None] * world_size()
    dist.all_gather_object(states, rng_state())
    return states


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def save(engine, ckpt_dir: Path, *, step: int, client_state: dict, keep_last: int) -> Path:
    """Collective: every rank calls it. Returns the tag directory."""
    tag = tag_for(step)
    client_state = {**client_state, "rng": gather_rng_states(), "world_size": world_size()}
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier() if dist.is_initialized() else None
    tag_dir = ckpt_dir / tag
    if is_main_process():
        files = {
            str(p.relative_to(tag_dir)): p.stat().st_size
            for p in sorted(tag_dir.rglob("*"))
            if p.is_file()
        }
        manifest = {
            "tag": tag,
            "step": step,
            "tokens": client_state.get("tokens"),
            "tokenizer_sha256": client_state.get("data", {}).get("tokenizer_sha256"),
            "world_size": world_size(),
            "files": files,
        }
        _atomic_write(tag_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        _atomic_write(ckpt_dir / "latest", tag)
        for old in intact_checkpoints(ckpt_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier() if dist.is_initialized() else None
    return tag_dir


def read_manifest(tag_dir: Path) -> dict | None:
    try:
        return json.loads((tag_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def check_tokenizer(tag_dir: Path, *, data_dir: Path, tokenizer_sha256: str | None) -> None:
    """ValueError when the checkpoint was trained on ids of another tokenizer than the data's.
    Read from the manifest, so resume refuses before any engine is built."""
    saved = (read_manifest(tag_dir) or {}).get("tokenizer_sha256")
    if saved and tokenizer_sha256 and saved != tokenizer_sha256:
        raise UserError(
            f"--data {data_dir}: its tokenizer ({tokenizer_sha256[:12]}...) is not the one "
            f"{tag_dir} was trained with ({saved[:12]}...). Resume with the original data "
            f"directory, or start a new run in a new --out."
        )


def is_intact(tag_dir: Path) -> bool:
    manifest = read_manifest(tag_dir)
    if manifest is None:
        return False
    return all(
        (tag_dir / name).is_file() and (tag_dir / name).stat().st_size == size
        for name, size in manifest["files"].items()
    )


def intact_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Intact tag directories, oldest first (by step)."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p for p in ckpt_dir.iterdir() if p.is_dir() and is_intact(p)]
    return sorted(tags, key=lambda p: read_manifest(p)["step"])


def find_resume(resume: str, ckpt_dir: Path) -> Path | None:
    """The tag directory to resume from, or None to start fresh.

    ``auto``: the newest intact checkpoint in ``ckpt_dir`` (none: start fresh). ``none``: start
    fresh. Otherwise a path: a tag directory, or a checkpoints directory (its newest intact tag).
    """
    if resume == "none":
        return None
    if resume == "auto":
        found = intact_checkpoints(ckpt_dir)
        skipped = (
            [p.name for p in ckpt_dir.iterdir() if p.is_dir() and not is_intact(p)]
            if ckpt_dir.is_dir()
            else []
        )
        if skipped:
            log.warning("ignoring incomplete checkpoints (no intact manifest): %s", skipped)
        return found[-1] if found else None
    path = Path(resume)
    if not path.exists():
        raise UserError(
            f"--resume {resume}: no such file or directory. Give a checkpoint tag "
            f"directory (RUN/checkpoints/stepNNNNNNNN), 'auto' or 'none'."
        )
    if is_intact(path):
        return path
    found = intact_checkpoints(path)
    if found:
        return found[-1]
    raise UserError(
        f"--resume {resume}: not an intact checkpoint (no valid {MANIFEST}) and "
        f"holds none. A save that was interrupted leaves such a directory; resume "
        f"from an older tag or use 'auto'."
    )


def load(engine, tag_dir: Path) -> dict:
    """Collective. Restores model, optimizer, scheduler and this rank's RNG; returns the client
    state (step, tokens, data position)."""
    manifest = read_manifest(tag_dir)
    if manifest["world_size"] != world_size():
        raise UserError(
            f"{tag_dir} was saved by {manifest['world_size']} ranks and this job has "
            f"{world_size()}. ZeRO shards are per rank: resume with the same number of ranks."
        )
    path, client = engine.load_checkpoint(
        str(tag_dir.parent),
        tag=tag_dir.name,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {tag_dir}.")
    set_rng_state(client["rng"][rank()])
    return client
