"""Asynchronous saves (``train.async_save``): the loop waits only for a host copy of the state;
the files are written behind the training and the checkpoint is committed once every rank's
files are written, fsync'd and hashed.

A save (``AsyncSaves.save``, collective) clears its tag directory as a synchronous save does,
takes this rank's snapshot (``anneal.resilience.snapshot.take``: DeepSpeed's own
``save_checkpoint``, its writes recorded as host copies) and hands it to one thread
(``BackgroundWrite``, at a lower CPU priority), which writes each file under a hidden temporary
name, hashes it from the page cache, fsyncs it and renames it into place. Nothing marks the
tag a checkpoint yet: it has no ``manifest.json``, so resume, export, the eval watcher and keep-K
pruning do not see it.

The commit is collective and happens in the training thread, at the first of these points
where every rank's write has finished: after each step (``poll``: one all-reduce of two numbers
per step while a write is in flight, none otherwise), before the next save (at most one save in
flight: the second waits, and says so), before a guard rewind, at a preemption and at the end
of the run (``finish``). There the ranks' hashes are gathered, rank 0 writes the manifest
(``anneal.resilience.manifest.write_manifest_of``), points ``latest`` at the tag and prunes
(``anneal.resilience.checkpoint.publish``), exactly as a synchronous save ends, and only then
is the checkpoint told to the run's observers (the export-every-save observer among them).

A write that fails on any rank (a full disk, an I/O error) is seen by every rank at that
point: the uncommitted tag is removed, the previous checkpoint is untouched, and the run stops
with one paragraph that names the rank, the file and the error. A rank that dies during a
write never reaches the commit: the others stop on the heartbeat, and resume takes the previous
checkpoint, since the tag has no manifest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from anneal.dist import all_gather, barrier, is_main_process, world_size
from anneal.errors import UserError
from anneal.files import fsync_path
from anneal.resilience import checkpoint, snapshot
from anneal.resilience.manifest import HASH, file_hash, write_manifest_of

log = logging.getLogger(__name__)


def write_file(path: Path, state, *, zipfile: bool = True) -> dict:
    """``torch.save`` of ``state`` to ``path`` through a hidden temporary name beside it
    (removed if anything fails), hashed while it is in the page cache, fsync'd, then renamed
    into place: ``{"size", hash}`` for the manifest."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        torch.save(state, tmp, _use_new_zipfile_serialization=zipfile)
        digest = file_hash(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"size": path.stat().st_size, HASH: digest}


class BackgroundWrite:
    """One rank's files of one save, written by a thread of their own (``write_file`` each).
    ``share``: the manifest's entries of the files written; ``error``: what failed (the file
    and the exception), None if nothing did; ``write_s``: how long the thread took. ``fault``:
    ``anneal.resilience.faults.Faults`` (drills only)."""

    def __init__(
        self,
        tag_dir: Path,
        files: list,
        *,
        step: int,
        buffers: snapshot.HostBuffers,
        zipfile: bool = True,
        fault=None,
    ):
        self.tag_dir, self.step, self.fault, self.zipfile = tag_dir, step, fault, zipfile
        self.buffers = buffers
        self.share: dict[str, dict] = {}
        self.error: str | None = None
        self.write_s: float | None = None
        self.copied = threading.Event()  # set once nothing refers to the live state
        self._thread = threading.Thread(
            target=self._run, args=(files,), name=f"save-{tag_dir.name}", daemon=True
        )
        self._thread.start()

    def _run(self, files: list) -> None:
        start, path = time.perf_counter(), self.tag_dir
        try:
            try:
                if self.fault is not None:
                    self.fault.before_snapshot_copy(self.step)
                files[:] = snapshot.copied(files, self.buffers)
            finally:
                self.copied.set()  # a failed copy is an error of the write: never a hang
            _yield_cpu()
            for i, (path, state) in enumerate(files):
                if self.fault is not None:
                    self.fault.before_save_write(self.step, i)
                name = str(path.relative_to(self.tag_dir))
                self.share[name] = write_file(path, state, zipfile=self.zipfile)
        except Exception as e:
            self.error = f"{path}: {type(e).__name__}: {e}"
        finally:
            files.clear()  # the snapshot's containers; its buffers stay for the next save
            self.write_s = time.perf_counter() - start

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()


def _yield_cpu() -> None:
    """Lower the calling thread's CPU priority (nice 10; on Linux a thread's nice value is its
    own): where the training keeps every core busy, as on a CPU run, the write takes what the
    training leaves. Nothing where that is not allowed."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


@dataclasses.dataclass
class SaveTimes:
    """What one save cost: ``blocking_s`` the loop waited for it (for an asynchronous save:
    the snapshot, ``waited_s`` of it for the write before it, and any wait of the next step
    for the snapshot's host copy), ``write_s`` its files took behind the training, the host
    copy included (0 for a synchronous save)."""

    blocking_s: float
    write_s: float = 0.0
    waited_s: float = 0.0

    def fields(self) -> dict:
        return {k: round(v, 3) for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass
class _InFlight:
    tag_dir: Path
    step: int
    client_state: dict
    model: dict | None
    write: BackgroundWrite
    times: SaveTimes


class AsyncSaves:
    """The asynchronous saves of one run (every rank has one; every method is collective).
    ``on_commit(tag_dir, step, times)`` is called on every rank once a save is committed;
    ``before_commit()`` before its pruning (the export of an older tag is waited for)."""

    def __init__(
        self,
        engine,
        ckpt_dir: Path,
        *,
        keep_last: int,
        keep_every: int,
        on_commit: Callable[[Path, int, SaveTimes], None],
        before_commit: Callable[[], None] = lambda: None,
        fault=None,
    ):
        self.engine, self.ckpt_dir, self.fault = engine, Path(ckpt_dir), fault
        self.keep_last, self.keep_every, self.on_commit = keep_last, keep_every, on_commit
        self.before_commit = before_commit
        self.buffers = snapshot.HostBuffers(pinned=engine.device.type == "cuda")
        self.in_flight: _InFlight | None = None
        self._fenced = False

    def fence(self) -> None:
        """Before anything changes the engine's state: wait until the save in flight has its
        host copy (``snapshot.copied``; at once where ``take`` copied already). The wait counts
        in the save's ``blocking_s``."""
        pending = self.in_flight
        if pending is None or pending.write.copied.is_set():
            return
        start = time.perf_counter()
        pending.write.copied.wait()
        pending.times.blocking_s += time.perf_counter() - start

    def _fence_the_engine(self) -> None:
        """Route the engine's ``backward``, ``step`` and ``load_checkpoint`` through ``fence``:
        DeepSpeed changes a saved tensor only in those (``anneal.resilience.snapshot``), and
        every caller (the step, a rewind, a drill) goes through them."""
        for name in ("backward", "step", "load_checkpoint"):
            own = getattr(self.engine, name)

            def fenced(*args, _own=own, **kwargs):
                self.fence()
                return _own(*args, **kwargs)

            setattr(self.engine, name, fenced)
        self._fenced = True

    def save(self, *, step: int, client_state: dict, model: dict | None = None) -> Path:
        """The snapshot of this step; its files are written behind the training. A save still
        in flight is waited for (and committed) first."""
        start = time.perf_counter()
        if not self._fenced:
            self._fence_the_engine()
        waited_s = self._wait_for_previous(step) if self.in_flight else 0.0
        tag_dir = checkpoint.clear_tag(self.ckpt_dir, step)
        client_state = checkpoint.full_client_state(client_state)
        barrier()
        files = snapshot.take(
            self.engine,
            self.ckpt_dir,
            tag=tag_dir.name,
            client_state=client_state,
            buffers=self.buffers,
        )
        zipfile = snapshot.zipfile_serialization(self.engine)
        write = BackgroundWrite(
            tag_dir, files, step=step, buffers=self.buffers, zipfile=zipfile, fault=self.fault
        )
        times = SaveTimes(blocking_s=time.perf_counter() - start, waited_s=waited_s)
        self.in_flight = _InFlight(tag_dir, step, client_state, model, write, times)
        return tag_dir

    def _wait_for_previous(self, step: int) -> float:
        pending = self.in_flight
        start = time.perf_counter()
        if not pending.write.done():
            log.warning(
                "save of step %d: the background write of step %d is still in progress; "
                "waiting for it (one save in flight at a time)",
                step,
                pending.step,
            )
        self.finish()
        return time.perf_counter() - start

    def poll(self) -> None:
        """After a step: commit the save in flight if every rank's write has finished (one
        small all-reduce while one is in flight; nothing otherwise)."""
        if self.in_flight is not None and self._all_done():
            self._commit()

    def finish(self) -> None:
        """Wait for the save in flight (if any) on this rank, then commit it."""
        if self.in_flight is not None:
            self.in_flight.write.wait()
            self._commit()

    def _all_done(self) -> bool:
        done = self.in_flight.write.done()
        if world_size() == 1:
            return done
        flag = torch.tensor([int(not done)], dtype=torch.int32, device=self.engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0

    def _commit(self) -> None:
        pending, self.in_flight = self.in_flight, None
        pending.times.write_s = pending.write.write_s
        outcomes = all_gather((pending.write.error, pending.write.share))
        errors = [(r, err) for r, (err, _) in enumerate(outcomes) if err is not None]
        if errors:
            self._fail(pending, errors)
        self.before_commit()
        write_manifest_of(
            pending.tag_dir,
            [share for _, share in outcomes],
            step=pending.step,
            client_state=pending.client_state,
            model=pending.model,
        )
        checkpoint.publish(
            self.ckpt_dir,
            pending.tag_dir,
            step=pending.step,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
        )
        self.on_commit(pending.tag_dir, pending.step, pending.times)

    def _fail(self, pending: _InFlight, errors: list[tuple[int, str]]) -> None:
        """Every rank: remove the uncommitted tag (rank 0) and stop with one paragraph."""
        barrier()
        if is_main_process():
            shutil.rmtree(pending.tag_dir, ignore_errors=True)
        intact = checkpoint.intact_checkpoints(self.ckpt_dir)
        previous = (
            f"the previous checkpoint, {intact[-1]}, is intact and the one a resume takes"
            if intact
            else "there is no earlier checkpoint: a resume starts from step 0"
        )
        failed = "; ".join(f"rank {r}: {err}" for r, err in errors)
        raise UserError(
            f"the asynchronous save of step {pending.step} ({pending.tag_dir}) failed in its "
            f"background write ({failed}). That save was not committed and its files are "
            f"removed; {previous}. The run stops here rather than train on without "
            f"checkpoints. Free space (or fix the disk) under {self.ckpt_dir} and run the same "
            f"command again: it resumes from there.",
            every_rank=True,
        )


def sync_times(started: float) -> SaveTimes:
    """A synchronous save's times: the loop waited for all of it."""
    return SaveTimes(blocking_s=time.perf_counter() - started)
