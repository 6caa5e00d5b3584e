"""Preemption: SIGUSR1 or SIGTERM -> finish the step -> agree across ranks -> checkpoint -> exit
with ``PREEMPTED_EXIT_CODE`` so that the batch script requeues the job.

The signal handler only sets a flag. Every optimizer step's one collective (the all-gather of
``anneal.train.step``) carries each rank's flag, so a signal that reached one rank stops them
all after the same step. They then save a checkpoint at that step (unless the Trainer's regular
save just did) and raise ``Preempted``, a ``SystemExit`` with status 75 (``EX_TEMPFAIL``: try
again). DeepSpeed's per-node launcher and its runner pass that status on, ``srun`` returns it,
and ``launcher/templates/*.sbatch`` calls ``scontrol requeue`` for it and for nothing else. The
requeued job starts the same command with ``--resume auto`` (the default), which finds that
checkpoint.

A second signal during the save sets the flag again and nothing more: the save is never
interrupted from Python. (A SIGKILL still can be; the checkpoint manifest, written last, makes
such a save one that resume ignores.)

Which processes get the signal: Slurm's ``--signal=B:USR1@GRACE`` reaches the batch shell only,
and DeepSpeed's launcher kills its ranks on SIGTERM without waiting. So every rank writes
``RUN/preempt/<host>.<pid>.pid`` and the batch script's trap signals the ranks on its own host
(enough, since the ranks agree); ``scancel --signal=USR1 --batch JOB`` triggers the same trap.

A pid file holds ``PID START JOB``: the rank's process id, its start time (field 22 of
``/proc/PID/stat``, clock ticks since boot) and its Slurm job id (``-`` outside Slurm). A pid
alone is not a process: a rank killed with -9 never removes its file, and its pid may since
belong to another process. The trap signals a pid only while that process started at START and
the job is its own, and removes the file of a pid that is gone or reused; each rank, at its
start, removes such files of its host (``remove_stale``).
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from anneal import rundir
from anneal.dist import world_size
from anneal.files import write_atomic
from anneal.resilience import checkpoint

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (field 22 of ``/proc/PID/stat``: clock ticks since boot),
    or None where it does not exist (or there is no ``/proc``). With the pid, it names one
    process: a pid is reused, a pid and its start time are not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return int(fields[19]) if len(fields) > 19 and re.fullmatch(r"[0-9]+", fields[19]) else None


def pid_line(pid: int) -> str:
    """A pid file's text: ``PID START JOB`` (see the module docstring)."""
    start = start_time(pid)
    return f"{pid} {'-' if start is None else start} {os.environ.get('SLURM_JOB_ID') or '-'}\n"


def remove_stale(folder: Path) -> list[Path]:
    """Remove this host's pid files whose process is gone or is another one now (its start
    time differs), and those that do not parse; returns them. Files of other hosts are left:
    only their own host can tell. Nothing is removed where ``/proc`` cannot be read."""
    if start_time(os.getpid()) is None:
        return []
    removed = []
    for f in folder.glob(f"{socket.gethostname()}.*.pid"):
        try:
            fields = f.read_text(errors="replace").split()
        except OSError:  # removed meanwhile (another rank of this host), or not a file
            continue
        live = (
            len(fields) == 3
            and all(re.fullmatch(r"[0-9]{1,18}", x) for x in fields[:2])
            and start_time(int(fields[0])) == int(fields[1])
        )
        if not live:
            f.unlink(missing_ok=True)
            removed.append(f)
    return removed


class Preempted(SystemExit):
    """Raised by every rank after the preemption checkpoint: exit status 75."""

    def __init__(self) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)


class SignalFlag:
    """What a signal of ``SIGNALS`` does to this process: it sets a flag, nothing more, and
    ``on_signal`` (the signal's name) is called at the first; and this process's pid file in
    ``RUN/preempt/``, through which the batch script's trap finds it (see the module
    docstring), this host's stale ones removed first. The training ranks' ``Preemption`` and
    the eval watcher's stop (``anneal.eval.watch.Stop``) both stand on it. Signals are caught
    only on the main thread (elsewhere they stay as they are); ``close`` restores them and
    removes the pid file."""

    def __init__(self, run_dir: Path, on_signal: Callable[[str], None]) -> None:
        self.signum: int | None = None
        self._on_signal = on_signal
        folder = rundir.preempt_dir(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale(folder)
        self._pid_file = folder / f"{socket.gethostname()}.{os.getpid()}.pid"
        write_atomic(self._pid_file, pid_line(os.getpid()))
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # else: signals stay as they are
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self._on_signal(signal.Signals(signum).name)

    @property
    def signalled(self) -> bool:
        """Whether this rank got a signal (local; no collective)."""
        return self.signum is not None

    def close(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._pid_file.unlink(missing_ok=True)


class StopMidStep(Exception):
    """Raised by ``Preemption.micro_batch_boundary`` in a one-process run that was signalled
    inside a step: the step is abandoned at a micro-batch boundary (its weights and optimizer
    are still those of the last completed step) and its micro-batches are done again on
    resume (``anneal.train.Trainer.step``)."""


class Preemption(SignalFlag):
    """Installed once per rank by ``anneal.train.Trainer``; see the module docstring.

    Where the signal comes inside a long step: a one-process run stops at the next micro-batch
    boundary (``micro_batch_boundary`` raises ``StopMidStep``), since nothing but the
    accumulated gradients, which a resume recomputes, is lost by dropping the step. Several
    ranks would need a collective at every micro-batch to agree on which boundary, so they stop
    after the step; the signal's line then says how long that is at the measured micro-batch
    pace, with the last save's time, and warns where it is more than the grace time the job
    was given (``GRACE_ENV``, which launcher/templates/multinode.sbatch exports)."""

    def __init__(self, run_dir: Path) -> None:
        self.requested_by_any = False
        """Set on every rank by ``train_step``'s collective: some rank got a signal."""
        self.last_save_s: float | None = None
        """How long the last checkpoint took (``anneal.train.Trainer.checkpoint`` sets it)."""
        self._at: tuple[int, int, int] | None = None  # (completed steps, micro-batch, of n)
        self._boundary_t: float | None = None
        self._micro_s: float | None = None  # the last micro-batch's time, measured
        super().__init__(run_dir, self._announce)  # the handler reads the fields above

    def micro_batch_boundary(self, step: int, index: int, count: int) -> None:
        """Before micro-batch ``index`` of ``count`` of the step after ``step`` (every rank):
        its pace measured, and in a one-process run that was signalled, ``StopMidStep``."""
        now = time.perf_counter()
        if index > 0 and self._boundary_t is not None:
            self._micro_s = now - self._boundary_t
        self._at, self._boundary_t = (step, index, count), now
        if self.signalled and world_size() == 1:
            raise StopMidStep()

    def step_done(self, step: int, count: int) -> None:
        """After step ``step``'s last micro-batch and its collective (every rank): a signal from
        here to the next step's first boundary stops before that step (one process) or after
        it (several ranks), not inside the step just done."""
        self._at = (step, count, count)

    def _announce(self, name: str) -> None:
        """The signal's line: where it stops, how long that takes, against the grace time."""
        at, micro_s, save_s = self._at, self._micro_s, self.last_save_s
        save = f"the last save took {save_s:.1f} s" if save_s is not None else "no save yet"
        if at is None or micro_s is None:  # before the first micro-batch was timed
            where = "at the next micro-batch boundary" if world_size() == 1 else "after this step"
            log.warning("got %s: stopping %s to checkpoint (%s)", name, where, save)
            return
        step, index, count = at
        between = index == count  # step ``step`` done (``step_done``), the next not begun
        last = index + 1 == count  # no boundary left: the step ends, its collective stops it
        if world_size() > 1:
            left = count if between else count - index
            wait_s = left * micro_s
            where = (
                f"after {'the next' if between else 'this'} step: {left} of its {count} "
                f"micro-batches left, about {wait_s:.1f} s at the last one's pace, then the save "
                f"({save})"
            )
        else:
            pace, after = f"(about {micro_s:.1f} s at the last one's pace)", step + 1
            if between:
                wait_s, saved = 0.0, step
                where = f"before the first micro-batch of step {after} (step {step} is done)"
            elif last:
                wait_s, saved = micro_s, after
                where = f"at the end of step {after}, its last micro-batch {pace}"
            else:  # the step is dropped
                wait_s, saved = micro_s, step
                where = f"at the end of micro-batch {index + 1} of {count} of step {after} {pace}"
            redo = "nothing is done" if between or last else "the unfinished step is done"
            where += f", then saving step {saved}'s checkpoint ({save}); {redo} again on resume"
        log.warning("got %s: stopping %s", name, where)
        check_grace(wait_s + (save_s or 0.0))

    def requested(self, device: torch.device) -> bool:
        """Collective: True on every rank when any rank got a signal. The training loop gets
        the same answer from its per-step collective (``requested_by_any``) instead."""
        flag = self.signalled
        if world_size() > 1:
            t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t.item())
        return flag

    def stop(self, *, step: int, ckpt_dir: Path, save, events) -> None:
        """Collective: save at ``step`` unless that checkpoint exists, tell the run's observers
        (``events.on_event``: ``anneal.train.observers``), raise ``Preempted``."""
        start = time.perf_counter()
        tag_dir = Path(ckpt_dir) / checkpoint.tag_for(step)
        if not checkpoint.is_intact(tag_dir):
            save()
        save_s = time.perf_counter() - start
        size = sum(p.stat().st_size for p in tag_dir.rglob("*") if p.is_file())
        name = signal.Signals(self.signum).name if self.signum else "peer"
        events.on_event(
            step,
            "preempt",
            signal=name,
            save_s=round(save_s, 3),
            checkpoint_bytes=size,
            path=str(tag_dir),
        )
        log.warning(
            "preempted (%s): checkpoint %s in %.1f s; exiting %d for requeue. To go on, run the "
            "same command again (a scheduler's requeue does): it resumes from that checkpoint.",
            name,
            tag_dir,
            save_s,
            PREEMPTED_EXIT_CODE,
        )
        self.close()
        raise Preempted()


GRACE_ENV = "ANNEAL_GRACE_S"
"""The seconds between the preemption signal and the kill, where the job says them (the sbatch
template's ``--grace-s``)."""


def check_grace(need_s: float) -> None:
    """A warning when ``need_s`` (the wait and the save) is more than the job's grace time."""
    try:
        grace_s = float(os.environ.get(GRACE_ENV, ""))
    except ValueError:
        return
    if need_s > grace_s:
        log.warning(
            "that is about %.0f s, more than the %.0f s between the signal and the kill (%s, the "
            "job's --grace-s): the job may be killed before its checkpoint is written. Submit "
            "with --grace-s %d or more (docs/resilience.md).",
            need_s,
            grace_s,
            GRACE_ENV,
            math.ceil(1.5 * need_s) + 30,
        )
