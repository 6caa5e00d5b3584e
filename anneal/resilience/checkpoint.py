"""Checkpoints: DeepSpeed ZeRO shards + client state + a manifest that marks them intact.

A tag directory counts as a checkpoint only once ``manifest.json`` is in it. The manifest holds
each file's size and an xxh3-128 hash; every rank hashes the files it wrote itself, right after
writing them (still in its page cache), while a thread fsyncs them to the disk; rank 0 writes the
manifest (fsync'd) after every rank has finished, then rewrites ``latest`` (atomically), then
prunes old checkpoints. A save killed midway, or one that fails on a full disk, therefore leaves
a directory that resume ignores, and the previous checkpoint stays the newest; nothing older is
deleted before the new one is whole on the disk, so not even a power cut can leave a manifest
whose files were never written.

On resume, ``verify`` re-hashes the chosen checkpoint (the files spread over the ranks): a
checkpoint whose bytes changed after the save (a torn copy, a bad disk, a same-size truncation)
is reported and, with ``--resume auto``, the newest intact older one is used instead. Before
DeepSpeed unpickles anything, every pickle of the checkpoint is scanned
(``anneal.resilience.safeload``):
a file that names a global outside the allow-list stops the run, with no fallback.

Nothing read from a checkpoint directory is trusted as a path: every file name in a manifest
and the tag in ``latest`` go through :func:`confined`. A save never deletes a finished
checkpoint: a tag directory with a manifest that is in the way of a new save (a step saved
again after resuming from an older one) is moved to ``checkpoints/.superseded/``.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import random
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import numpy as np
import torch
import torch.distributed as dist

from anneal.dist import is_main_process, rank, world_size
from anneal.errors import UserError
from anneal.files import confined, fsync_path, write_atomic

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
HASH = "xxh3_128"
LATEST = "latest"
SUPERSEDED = ".superseded"
"""Where a save moves a finished checkpoint that is in the way (not a tag: names that begin
with a dot are never listed as checkpoints)."""
_CHUNK = 8 << 20
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_")


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
    return _all_gather(rng_state())


def _all_gather(obj) -> list:
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def file_hash(path: Path) -> str:
    """xxh3-128 of a file's bytes, hex (about 10 GB/s from the page cache)."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:  # no copy
            view = memoryview(m)
            for off in range(0, len(m), _CHUNK):
                h.update(view[off : off + _CHUNK])
            view.release()
    return h.hexdigest()


def owner_of(name: str, n_ranks: int) -> int:
    """The rank that hashes a file: the rank that wrote it (``zero_pp_rank_R_``), else rank 0."""
    m = _RANK_FILE.search(name)
    return int(m.group(1)) % n_ranks if m else 0


def _hash_share(tag_dir: Path, names: list[str]) -> dict[str, dict]:
    """{name: {size, hash}} for this rank's share of ``names``, each file fsync'd before this
    returns. The hashing reads the page cache while a thread waits on the disk, so the hashes
    cost nothing as long as the disk writes slower than xxh3 hashes."""
    mine = [n for n in names if owner_of(n, world_size()) == rank()]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsync") as pool:
        synced = [pool.submit(fsync_path, tag_dir / n) for n in mine]
        share = {
            n: {"size": (tag_dir / n).stat().st_size, HASH: file_hash(tag_dir / n)} for n in mine
        }
        for done in synced:
            done.result()  # an fsync error (EIO, ENOSPC) fails the save here
    return share


def _list_files(tag_dir: Path) -> list[str]:
    return sorted(
        str(p.relative_to(tag_dir))
        for p in tag_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    )


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
    step is a multiple of ``keep_every`` (0: none). ``model``: the model's shape, recorded in
    the manifest so that a resume with another shape is refused before anything loads.
    """
    tag = tag_for(step)
    tag_dir = ckpt_dir / tag
    if is_main_process() and (tag_dir.exists() or tag_dir.is_symlink()):
        # In the way: its files would mix with the new ones. A save that never finished (no
        # manifest) is removed; anything else, a finished checkpoint of an earlier timeline
        # (this run resumed from an older tag, or fell back past a damaged one), is kept aside.
        if tag_dir.is_dir() and not tag_dir.is_symlink() and not (tag_dir / MANIFEST).exists():
            shutil.rmtree(tag_dir)
        else:
            _move_aside(tag_dir)
    client_state = {**client_state, "rng": gather_rng_states(), "world_size": world_size()}
    _barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    _barrier()  # every rank's files are complete before any rank lists them
    shares = _all_gather(_hash_share(tag_dir, _list_files(tag_dir)))
    if is_main_process():
        files = {name: entry for share in shares for name, entry in share.items()}
        for d in {(tag_dir / name).parent for name in files}:
            fsync_path(d)  # the files' directory entries
        manifest = {
            "tag": tag,
            "step": step,
            "tokens": client_state.get("tokens"),
            "tokenizer_sha256": client_state.get("data", {}).get("tokenizer_sha256"),
            "world_size": world_size(),
            "files": dict(sorted(files.items())),
        }
        if model is not None:
            manifest["model"] = model
        write_atomic(tag_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n", durable=True)
        write_atomic(ckpt_dir / LATEST, tag, durable=True)
        for old in to_prune(intact_checkpoints(ckpt_dir), keep_last, keep_every):
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return tag_dir


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


def read_manifest(tag_dir: Path) -> dict | None:
    """The manifest of a tag directory; None when it has none, or one that is not a manifest
    Anneal writes (not JSON, or not its shape), so that the directory counts as a save that
    never finished. A file name in it that leaves the directory is refused (``confined``)."""
    path = Path(tag_dir) / MANIFEST
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not _well_formed(doc):
        return None
    for name in doc["files"]:
        confined(Path(tag_dir), name, where=str(path))
    return doc


def _well_formed(doc) -> bool:
    def count(v, low: int = 0) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    if not (
        isinstance(doc, dict) and count(doc.get("step")) and isinstance(doc.get("files"), dict)
    ):
        return False
    if "world_size" in doc and not count(doc["world_size"], 1):
        return False
    if not isinstance(doc.get("tokenizer_sha256") or "", str):
        return False
    entries = [e if isinstance(e, dict) else {"size": e} for e in doc["files"].values()]
    return all(count(e.get("size")) and isinstance(e.get(HASH, ""), str) for e in entries)


def read_latest(ckpt_dir: Path) -> Path | None:
    """The tag directory that ``ckpt_dir/latest`` names (DeepSpeed's own tools, such as
    ``zero_to_fp32.py``, follow it when given no tag); None without one. Refused unless it names
    a plain tag inside ``ckpt_dir``. Anneal itself picks checkpoints by their manifests."""
    path = Path(ckpt_dir) / LATEST
    try:
        name = path.read_text().strip()
    except (OSError, ValueError):
        return None
    if len(PurePosixPath(name).parts) != 1 or name.startswith(".") or "/" in name:
        raise UserError(
            f"{path}: names {name[:80]!r}, not a plain checkpoint tag (stepNNNNNNNN) inside "
            f"{ckpt_dir}. Anneal writes only a tag there; put the newest tag back in it, or "
            f"delete the file (resume picks checkpoints by their manifests)."
        )
    return confined(Path(ckpt_dir), name, where=str(path))  # and no link that leads out


def _entries(manifest: dict) -> dict[str, dict]:
    """name -> {size[, hash]}; manifests written before hashes held name -> size."""
    return {n: e if isinstance(e, dict) else {"size": e} for n, e in manifest["files"].items()}


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
    """Cheap check: a manifest, and every file in it present with its size (no hashing)."""
    manifest = read_manifest(tag_dir)
    if manifest is None:
        return False
    return all(
        (tag_dir / name).is_file() and (tag_dir / name).stat().st_size == e["size"]
        for name, e in _entries(manifest).items()
    )


def damaged_files(tag_dir: Path, *, share_of: tuple[int, int] | None = None) -> list[str]:
    """Files of an intact-looking checkpoint whose bytes no longer match the manifest's hash.

    ``share_of=(rank, n)``: check only the files ``owner_of`` gives that rank of ``n``."""
    entries = _entries(read_manifest(tag_dir))
    bad = []
    for name, e in entries.items():
        if share_of and owner_of(name, share_of[1]) != share_of[0]:
            continue
        path = tag_dir / name
        if not path.is_file() or path.stat().st_size != e["size"]:
            bad.append(name)
        elif HASH in e and file_hash(path) != e[HASH]:
            bad.append(name)
    return bad


def verify(tag_dir: Path) -> list[str]:
    """Collective: re-hash a checkpoint, each rank its share; the damaged files (all ranks get
    the same list)."""
    mine = damaged_files(tag_dir, share_of=(rank(), world_size()))
    return sorted(n for share in _all_gather(mine) for n in share)


def verified_resume(chosen: Path, *, fallback: bool) -> Path | None:
    """Collective. ``chosen`` if its hashes hold; else, with ``fallback`` (``--resume auto``),
    the newest older checkpoint that verifies, saying so (None when none does)."""
    candidates = [chosen]
    if fallback:
        older = [p for p in intact_checkpoints(chosen.parent) if _step(p) < _step(chosen)]
        candidates += older[::-1]
    for tag_dir in candidates:
        bad = verify(tag_dir)
        if not bad:
            if tag_dir != chosen:
                log.warning("resuming from %s, the newest checkpoint that verifies", tag_dir)
            return tag_dir
        msg = (
            f"checkpoint {tag_dir} is corrupt: {len(bad)} file(s) differ from its manifest "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
        )
        if not fallback:
            raise UserError(
                f"--resume {chosen}: {msg}. Resume from an older tag in {chosen.parent}, or "
                f"use --resume auto to take the newest intact one.",
                every_rank=True,
            )
        log.warning("%s; falling back to an older checkpoint", msg)
    log.warning("no checkpoint in %s verifies: starting from scratch", chosen.parent)
    return None


def _step(tag_dir: Path) -> int:
    return read_manifest(tag_dir)["step"]


def intact_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Intact tag directories (by ``is_intact``), oldest first (by step)."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p for p in _tag_dirs(ckpt_dir) if is_intact(p)]
    return sorted(tags, key=_step)


def _tag_dirs(ckpt_dir: Path) -> list[Path]:
    """The directories of ``ckpt_dir`` that may be checkpoints (not ``.superseded``)."""
    return [p for p in ckpt_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]


def find_resume(resume: str, ckpt_dir: Path) -> Path | None:
    """The tag directory to resume from, or None to start fresh.

    ``auto``: the newest intact checkpoint in ``ckpt_dir`` (none: start fresh). ``none``: start
    fresh. Otherwise a path: a tag directory, or a checkpoints directory (its newest intact tag).
    """
    if resume == "none":
        return None
    if resume == "auto":
        read_latest(ckpt_dir)  # refuses a `latest` that leads out of the directory
        found = intact_checkpoints(ckpt_dir)
        skipped = (
            [p.name for p in _tag_dirs(ckpt_dir) if not is_intact(p)] if ckpt_dir.is_dir() else []
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
    state (step, tokens, data position, guard state).

    A ZeRO-3 checkpoint written by another number of ranks is converted once to DeepSpeed's
    universal format (cached in ``<tag>/universal``) and loaded from there. DeepSpeed unpickles
    with ``weights_only=False``, so every pickle under ``tag_dir`` is scanned first."""
    scan(tag_dir)
    manifest = read_manifest(tag_dir)
    saved_ranks = manifest.get("world_size", world_size())
    if saved_ranks == world_size():
        path, client = engine.load_checkpoint(
            str(tag_dir.parent),
            tag=tag_dir.name,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
    else:
        path, client = _load_universal(engine, tag_dir, saved_ranks)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {tag_dir}.")
    rngs = client["rng"]
    set_rng_state(rngs[rank() % len(rngs)])
    return client


def scan(tag_dir: Path) -> None:
    """``anneal.resilience.safeload.scan_file`` for every ``*.pt`` under ``tag_dir`` (``universal/``
    included; not a hidden leftover such as an interrupted conversion's ``.universal.tmp``,
    which nothing loads), on every rank: each reads these files anyway, and the verdict is the
    same everywhere. A refusal stops the run: there is no fallback to an older checkpoint,
    because files whose hashes match their manifest were not damaged by a crash or a disk, they
    were written so."""
    from anneal.resilience import safeload

    tag_dir = Path(tag_dir)
    try:
        for path in sorted(tag_dir.rglob("*.pt")):
            if not any(part.startswith(".") for part in path.relative_to(tag_dir).parts):
                safeload.scan_file(path)
    except UserError as e:
        planted = "could run code" in str(e)
        why = (
            "This is not damage (its files match the manifest): someone put a file there that "
            "would run code when loaded. Treat the run directory as tampered with."
            if planted
            else "Its files match the manifest, so it was written that way."
        )
        raise UserError(
            f"checkpoint {tag_dir} was not loaded, and resume does not fall back to an older "
            f"one: {e} {why} Resume from a checkpoint you trust (--resume PATH), or start a "
            f"new run in a new --out.",
            every_rank=True,
        ) from None


UNIVERSAL = "universal"


def _load_universal(engine, tag_dir: Path, saved_ranks: int):
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
    _barrier()
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
