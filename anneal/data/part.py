"""Step 2 of a preparation in tasks (:mod:`anneal.data.task_split`): ``--task I`` tokenizes and
packs the work units the plan gives task I, with every core of its node, into its part.

A part is written into ``task-0000I.partial-HOST-PID/`` and renamed to ``task-0000I/`` when
complete; then its completion marker ``task-0000I.done.json`` is written (atomically, and
flushed to the disk), holding the sha256 of the plan and of the part's ``part.json``, which in
turn holds the sha256 of every file of the part. A task that dies leaves no marker, and the
next run of that task removes what it left; a task that has its marker is not run again.

The part of a task is a prepared directory's ``train/`` and ``val/`` for the sources its units
belong to, with one shard per (split, source) (``SS_00000.bin``, its document ends in
``SS_docs.bin`` counted from the part's start): what the merge appends, in task order, to the
shards of the one-node layout.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path

import numpy as np

from anneal.data.merge_copy import check_chunk, piece_hashes
from anneal.data.pack import ShardWriter, pack_units
from anneal.data.prepare_config import PrepareConfig
from anneal.data.prepare_progress import Progress
from anneal.data.prepared_dir import SPLITS
from anneal.data.readers import Problems
from anneal.data.task_split import (
    TOKENIZER,
    done_file,
    load_split,
    parts_dir,
    task_dir,
)
from anneal.errors import UserError
from anneal.files import sha256_file, write_atomic

log = logging.getLogger(__name__)

PART = "part.json"
TASK_MARKER = ".anneal-prepare-task"
ONE_SHARD = 1 << 62
"""A part's shard size: one shard per (split, source); the merge cuts the real ones."""


def read_done(parts: Path, task: int) -> dict | None:
    """Task ``task``'s completion marker as a JSON object, or None when it has none (or one
    that cannot be read: the task did not finish writing it)."""
    try:
        done = json.loads(done_file(parts, task).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return done if isinstance(done, dict) else None


def run_task(cfg: PrepareConfig, task: int, tasks: int) -> dict:
    """Step 2: task ``task`` of ``tasks``. Returns its completion marker; a task already
    complete under this plan is not run again (``"again": False``). One process at a time runs
    a task (``task_lock``); a second one is refused and changes nothing."""
    plan, plan_sha, sources, units = load_split(cfg, tasks)
    if not 0 <= task < tasks:
        raise UserError(f"--task {task}: give 0 to {tasks - 1} (--tasks {tasks}).")
    parts = parts_dir(cfg.out)
    with task_lock(parts, task):
        return _run_locked(cfg, task, plan, plan_sha, sources, units, parts)


@contextlib.contextmanager
def task_lock(parts: Path, task: int):
    """Holds ``OUT.parts/.task-0000I.lock`` (``flock``, which the kernel releases when the
    process ends, however it ends; over NFS through its lock manager) while task I runs, its
    host and pid written in it. UserError, naming them, when another process holds it: two
    runs of one task would remove each other's part and marker."""
    path = parts / f".{task_dir(parts, task).name}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:  # a link, a directory: not what this command made
        raise UserError(
            f"--task {task}: {path} cannot be opened as the task's lock ({e.strerror}). Remove "
            f"it (it is made afresh) and run the task again. Nothing was written."
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            said = os.pread(fd, 200, 0).decode(errors="replace")
            holder = "".join(c for c in said.strip() if c.isprintable()) or "unknown"
            raise UserError(
                f"--task {task}: task {task} is being run by another process now ({holder}; "
                f"it holds {path}). One process runs a task at a time: wait for it (a rerun "
                f"then says the task is complete already), or stop it and run the task again. "
                f"Nothing was written."
            ) from None
        except OSError as e:  # a file system without locks (some Lustre mounts)
            log.warning("%s cannot be locked (%s): run each task once", path, e.strerror)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _run_locked(cfg: PrepareConfig, task: int, plan, plan_sha, sources, units, parts) -> dict:
    from anneal.data.prepare import cpu_seconds, default_workers

    done = read_done(parts, task)
    if done is not None and done.get("plan_sha256") == plan_sha:
        log.info("task %d is complete already (%s): not run again", task, done_file(parts, task))
        return {**done, "again": False}
    done_file(parts, task).unlink(missing_ok=True)  # of another plan, or unreadable
    _remove_leftovers(parts, task)
    partial = parts / f"{task_dir(parts, task).name}.partial-{_host()}-{os.getpid()}"
    partial.mkdir()
    (partial / TASK_MARKER).write_text(f"anneal data prepare --task {task}\n")
    try:
        t0, cpu0 = time.time(), cpu_seconds()
        start, end = plan["ranges"][task]
        mine = [u for s in sources for u in units[s.index]][start:end]
        touched = sorted({u.source for u in mine})
        dtype = np.dtype(plan["tokenizer"]["dtype"])
        writers = {
            (split, s): ShardWriter(partial / split, source=s, dtype=dtype, shard_tokens=ONE_SHARD)
            for split in SPLITS
            for s in touched
        }
        problems = Problems(cfg.read.on_error)
        workers = cfg.workers or default_workers()
        progress = Progress(sum(u.nbytes for u in mine), enabled=cfg.progress, workers=workers)
        initargs = (str(parts / TOKENIZER), cfg.read, cfg.val_fraction, dtype.name)
        smallest = pack_units(
            iter(mine), writers, problems, progress, workers=workers, initargs=initargs
        )
        progress.close()
        chunk = check_chunk(cfg.shard_tokens * dtype.itemsize)
        pieces = {
            split: {
                str(s): _piece(partial / split, writers[split, s].close(), chunk) for s in touched
            }
            for split in SPLITS
        }
        part = {
            "plan_sha256": plan_sha,
            "task": task,
            "units": [start, end],
            "input_bytes": progress.done,
            "pieces": pieces,
            "smallest": {str(s): list(v) for s, v in sorted(smallest.items())},
            "skipped": problems.skipped,
            "examples": problems.examples,
        }
        (partial / PART).write_text(json.dumps(part, indent=1) + "\n")
        (partial / TASK_MARKER).unlink()
        partial.rename(task_dir(parts, task))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    done = {
        "plan_sha256": plan_sha,
        "part_sha256": sha256_file(task_dir(parts, task) / PART),
        "task": task,
        "host": socket.gethostname(),
        "units": end - start,
        "input_bytes": progress.done,
        "tokens": sum(p["tokens"] for split in pieces.values() for p in split.values()),
        "seconds": round(time.time() - t0, 2),
        "pack_cpu_seconds": round(cpu_seconds() - cpu0, 2),
        "workers": workers,
    }
    write_atomic(done_file(parts, task), json.dumps(done, indent=1) + "\n", durable=True)
    return {**done, "again": True}


def _piece(directory: Path, written: dict, chunk: int) -> dict:
    """What part.json records of one (split, source): the writer's counts, its one shard, and
    the document index's size and sha256, and an xxh3-128 of every ``chunk`` bytes of its ids
    (what the merge checks while it copies them: :mod:`anneal.data.merge_copy`)."""
    docs = directory / written["doc_index"] if written["doc_index"] else None
    ids = [directory / shard["file"] for shard in written["shards"]]
    return {
        **written,
        "docs_bytes": docs.stat().st_size if docs else 0,
        "docs_sha256": sha256_file(docs) if docs else None,
        "xxh3_128": piece_hashes(ids[0], chunk) if ids else [],
        "xxh3_128_chunk": chunk,
    }


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.\-]", "_", socket.gethostname())[:64] or "host"


def _remove_leftovers(parts: Path, task: int) -> None:
    """What an earlier run of this task left without finishing: its part directory (no marker
    beside it) and its partial directories on this host whose process is gone. A partial of a
    live process, or of another host, is left alone."""
    whole = task_dir(parts, task)
    if whole.is_dir() and not whole.is_symlink():
        log.warning("removing %s, left by a run of task %d that did not finish", whole, task)
        shutil.rmtree(whole)
    prefix = f"{whole.name}.partial-{_host()}-"
    for p in parts.glob(f"{whole.name}.partial-*"):
        pid = p.name[len(prefix) :] if p.name.startswith(prefix) else ""
        if not pid.isdigit() or not (p / TASK_MARKER).is_file() or p.is_symlink():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            log.warning("removing %s, left by an interrupted run of task %d", p, task)
            shutil.rmtree(p, ignore_errors=True)
        except OSError:
            continue
