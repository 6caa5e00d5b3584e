"""Resuming a ZeRO-3 checkpoint on another number of ranks: the checkpoint is converted once to
DeepSpeed's universal format and loaded from there, and two things DeepSpeed's universal load
gets wrong are put right after it.

The conversion is the resuming run's own file: it is written under that run's
``checkpoints/.universal/`` (made in a hidden temporary directory and renamed when complete),
never into the checkpoint being converted, which may be another run's. It gets a manifest of
its own (each file's size and hash, and the hash of the source's manifest), and a later resume
reuses it only when both still hold; otherwise it is made again. DeepSpeed's converter runs as
a child process with every load forced into torch's weights-only loader
(``anneal.resilience.safeload``): ``python -m anneal.resilience.universal`` is that child.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from anneal.dist import barrier, is_main_process
from anneal.errors import UserError
from anneal.files import real_dir, write_atomic
from anneal.resilience import safeload
from anneal.resilience.manifest import HASH, MANIFEST, damaged_files, file_hash, read_manifest
from anneal.resilience.universal_stages import either_stage

log = logging.getLogger(__name__)

CACHE = ".universal"
"""Under the resuming run's ``checkpoints/``: one conversion per source checkpoint."""
FORMAT = 2
"""A conversion's format (its manifest's ``format``): 2 since ``either_stage``; an older one is
made again, not reused."""
MARK = ".anneal-conversion"
"""Written into a conversion's temporary folder when it is made (and kept in the finished
one): ``prune_run`` removes a ``.<name>.tmp`` folder only when it holds this file."""
PEAK_FACTOR = 3.5
"""The free space a conversion needs, in checkpoint sizes (``check_space``)."""


def load_universal(
    engine,
    tag_dir: Path,
    *,
    ckpt_dir: Path,
    saved: tuple[int, int, int],
    here: tuple[int, int, int],
):
    """Collective. ``engine.load_checkpoint``'s (path, client state) for a checkpoint saved by
    ``saved`` = (ranks, expert-parallel degree, tensor-parallel degree) into this job's
    ``here``, through its universal form under ``ckpt_dir`` (the resuming run's checkpoints
    directory). Called within ``safeload.loading()``."""
    with reading(ckpt_dir):
        return _load_universal(engine, tag_dir, ckpt_dir=ckpt_dir, saved=saved, here=here)


def _load_universal(engine, tag_dir: Path, *, ckpt_dir: Path, saved, here):
    universal = to_universal(tag_dir, ckpt_dir)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    # The launch's "resume: ..." note said what moves and why, once (rank 0, INFO); this line
    # only names the folder that is loaded.
    log.info("%s: loading its universal form %s", tag_dir, universal)
    clip = getattr(engine.optimizer, "clip_grad", None)  # ZeRO-1/2's load sets the saved one
    engine._config.load_universal_checkpoint = True  # for this one load
    try:
        loaded = engine.load_checkpoint(
            str(universal.parent),
            tag=universal.name,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
    finally:
        engine._config.load_universal_checkpoint = False
    if clip is not None:
        engine.optimizer.clip_grad = clip
    repair_universal_load(engine, hyper)
    return loaded


def source_hash(tag_dir: Path) -> str:
    """sha256 of the source checkpoint's manifest: it names every file's hash."""
    return hashlib.sha256((Path(tag_dir) / MANIFEST).read_bytes()).hexdigest()


def to_universal(tag_dir: Path, ckpt_dir: Path) -> Path:
    """Collective. ``ckpt_dir/.universal/<tag>-<source hash>``: the checkpoint in DeepSpeed's
    universal format, made by rank 0 the first time, reused while its manifest verifies; every
    rank then checks each of its files with the weights-only loader."""
    src = source_hash(tag_dir)
    out = Path(ckpt_dir) / CACHE / f"{tag_dir.name}-{src[:16]}"
    reusable = _reusable(out, src)
    if not reusable:
        check_space(tag_dir, Path(ckpt_dir))
    if is_main_process() and not reusable:
        if out.exists() or out.is_symlink():
            log.warning("%s does not verify against its manifest: converting again", out)
            _remove(out)
        tmp = out.with_name(f".{out.name}.tmp")
        _remove(tmp)
        tmp.mkdir(parents=True)
        (tmp / MARK).write_text(f"a conversion of {tag_dir}, being made\n")
        _convert(tag_dir, tmp)
        _write_manifest(tmp, source=tag_dir, source_sha256=src)
        tmp.rename(out)
    barrier()
    safeload.check_checkpoint(out)
    return out


def prune(ckpt_dir: Path, *, saved_step: int) -> list[Path]:
    """Rank 0, after a save at ``saved_step``: the conversions under ``ckpt_dir/.universal/``
    of checkpoints older than it, removed (and returned). The run has loaded them already and
    saved natively since, so a resume takes the newer checkpoint; one that falls back past it
    converts again. Only finished conversions (a verified manifest Anneal wrote) are
    touched, nothing else under the folder."""
    removed = []
    cache = Path(ckpt_dir) / CACHE
    if cache.is_symlink() or not cache.is_dir():
        return removed
    for out in sorted(cache.iterdir()):
        if out.name.startswith(".") or out.is_symlink() or not out.is_dir():
            continue
        manifest = read_manifest(out)
        if manifest is None or "source_manifest_sha256" not in manifest:
            continue
        if manifest["step"] < saved_step:
            shutil.rmtree(out)
            removed.append(out)
            log.info("removed %s: this run has saved step %d since", out, saved_step)
    return removed


@contextmanager
def reading(ckpt_dir: Path):
    """Every rank, while it converts and loads: a shared lock on ``ckpt_dir/.universal`` (made
    if missing), which ``prune_run`` takes exclusively, so that it never removes a conversion
    a job is writing or reading. An flock: the kernel drops it when the process ends, however
    it ends."""
    cache = Path(ckpt_dir) / CACHE
    cache.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def prune_run(run_dir: Path, *, everything: bool = False, dry_run: bool = False) -> list[dict]:
    """``anneal checkpoint prune-universal RUN``: the universal conversions under
    ``RUN/checkpoints/.universal/`` that no resume needs, removed (unless ``dry_run``), each as
    ``{"path", "bytes", "removed", "why"}``, the kept ones too (``removed`` False). Not needed:
    a conversion of a checkpoint older than the run's newest intact one (``--resume auto``
    takes that), a conversion whose source is gone, and a temporary folder a conversion that
    died left behind; with ``everything``, every conversion (a resume at another layout makes
    it again). Only a run is pruned (its config.json reads as a run's), through no link
    (``checkpoints/`` and ``.universal`` real directories of it, ``anneal.files.real_dir``),
    and only what Anneal made there is touched: a folder with a conversion manifest, or a
    hidden ``.<name>.tmp`` holding ``MARK``. Refused while a job holds the folder
    (``reading``)."""
    from anneal import rundir
    from anneal.resilience.resume import intact_checkpoints

    rundir.read_record(run_dir)  # a run's config.json, or one paragraph
    cache = real_dir(run_dir, rundir.CHECKPOINTS, CACHE)
    ckpt_dir = cache.parent
    if not cache.is_dir():
        return []
    intact = intact_checkpoints(ckpt_dir)
    newest = read_manifest(intact[-1])["step"] if intact else None
    fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"{cache}: a job is converting or loading a checkpoint there now (it holds the "
                f"folder's lock), so nothing is removed. Run this again once that job has "
                f"started training; its next save removes the conversions it no longer needs "
                f"by itself."
            ) from None
        found = [_verdict(out, newest, everything) for out in sorted(cache.iterdir())]
        found = [f for f in found if f is not None]
        for f in found:
            if f["removed"] and not dry_run:
                _remove(Path(f["path"]))
    finally:
        os.close(fd)
    return found


def _verdict(out: Path, newest: int | None, everything: bool) -> dict | None:
    """What ``prune_run`` does with one entry of the cache: None for one Anneal did not make."""
    if out.is_symlink() or not out.is_dir():
        return None
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and not p.is_symlink())
    entry = {"path": str(out), "bytes": size}
    if out.name.startswith("."):
        if not out.name.endswith(".tmp") or not _marked(out):
            return None
        return {**entry, "removed": True, "why": "left by a conversion that did not finish"}
    manifest = read_manifest(out)
    if manifest is None or "source_manifest_sha256" not in manifest:
        return None
    source = Path(manifest.get("source", ""))  # absolute since 2026-12-04
    if everything:
        why = "--all: a resume at another layout converts its checkpoint again"
    elif newest is not None and manifest["step"] < newest:
        why = f"step {manifest['step']}, older than this run's newest checkpoint (step {newest})"
    elif source.is_absolute() and not (source / MANIFEST).is_file():
        why = f"its checkpoint {source} is gone"
    else:
        return {**entry, "removed": False, "why": "a resume at another layout reuses it"}
    return {**entry, "removed": True, "why": why}


def _marked(out: Path) -> bool:
    """Whether ``out`` holds ``MARK`` as a file (not a link): a conversion's folder."""
    return (out / MARK).is_file() and not (out / MARK).is_symlink()


def check_space(tag_dir: Path, ckpt_dir: Path) -> None:
    """Every rank, before the conversion: the free space where it is written covers
    ``PEAK_FACTOR`` times the checkpoint's size. The finished conversion of a ZeRO-3 checkpoint
    held 2.00x its size (each parameter's fp32 weights and Adam moments in files of their own,
    and a copy of rank 0's optimizer states file), and while DeepSpeed's converter ran, with the
    ZeRO fragments it extracts first beside it, 2.94x (tiny) and 3.00x (125m) at the most
    (bench/bench_checkpoint.py, docs/benchmarks.md). Refused with the figures otherwise, before
    anything is written."""
    size = sum(p.stat().st_size for p in Path(tag_dir).rglob("*") if p.is_file())
    where = ckpt_dir
    while not where.exists() and where != where.parent:  # a new run's folders come later
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < PEAK_FACTOR * size:
        raise UserError(
            f"resuming {tag_dir} at another layout converts it to DeepSpeed's universal "
            f"checkpoint under {ckpt_dir / CACHE}, which needs about "
            f"{PEAK_FACTOR * size / 2**30:.2f} GiB while it is made ({PEAK_FACTOR} times the "
            f"checkpoint's {size / 2**30:.2f} GiB) and {where} has {free / 2**30:.2f} GiB free. "
            f"Free space there (`anneal checkpoint prune-universal RUN` removes the conversions "
            f"a run no longer needs), or resume at the layout the checkpoint was saved at.",
            every_rank=True,
        )


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _convert(tag_dir: Path, out: Path) -> None:
    """DeepSpeed's converter in a child process whose every ``torch.load`` is weights-only."""
    cmd = [sys.executable, "-m", __name__, "--input_folder", str(tag_dir)]
    cmd += ["--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    # ZeRO-1/2: the converter wants the client's universal-checkpoint info (Megatron writes it;
    # a Hugging Face model through DeepSpeed's engine has none), which for a model without
    # pipeline or Megatron-style tensor slices is its version alone.
    cmd += ["--inject_missing_state"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=safeload.forced_env())
    if done.returncode == 2 and "error: " in done.stderr:
        raise UserError(done.stderr.strip().splitlines()[-1].removeprefix("error: "))
    if done.returncode != 0:
        raise RuntimeError(
            f"converting {tag_dir} to a universal checkpoint failed ({done.returncode}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )


def _write_manifest(out: Path, *, source: Path, source_sha256: str) -> None:
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        "format": FORMAT,
        "step": read_manifest(source)["step"],
        "source": str(Path(source).resolve()),
        "source_manifest_sha256": source_sha256,
        "files": {
            str(p.relative_to(out)): {"size": p.stat().st_size, HASH: file_hash(p)} for p in files
        },
    }
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=2) + "\n", durable=True)


def _reusable(out: Path, src: str) -> bool:
    """A conversion made from this very source (its manifest's hash) whose files all match."""
    if out.is_symlink() or not out.is_dir():
        return False
    manifest = read_manifest(out)
    if manifest is None or manifest.get("source_manifest_sha256") != src:
        return False
    if manifest.get("format") != FORMAT:  # made before either_stage: made again
        return False
    return not damaged_files(out)


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


def _main() -> int:
    """The converter's child: DeepSpeed's ``ds_to_universal`` with every load weights-only."""
    import os

    from deepspeed.checkpoint import ds_to_universal

    if os.environ.get(safeload.FORCE_WEIGHTS_ONLY) != "1":
        print(f"error: {safeload.FORCE_WEIGHTS_ONLY} is not set", file=sys.stderr)
        return 2
    torch.serialization.add_safe_globals(safeload.safe_globals())
    args = ds_to_universal.parse_arguments()
    try:
        ds_to_universal.main(args)
        either_stage(Path(args.output_folder))  # anneal.resilience.universal_stages
    except pickle.UnpicklingError as e:
        print(
            f"error: {args.input_folder}: torch's weights-only loader refuses one of its files "
            f"({safeload.unpickler_refusal(e)}), so it is not converted to a universal "
            f"checkpoint, and loading it any other way could run code.",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main())
