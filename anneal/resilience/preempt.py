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
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from anneal import rundir
from anneal.dist import world_size
from anneal.resilience import checkpoint

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preempted(SystemExit):
    """Raised by every rank after the preemption checkpoint: exit status 75."""

    def __init__(self) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)


class Preemption:
    """Installed once per rank by ``anneal.train.Trainer``; see the module docstring."""

    def __init__(self, run_dir: Path) -> None:
        self.signum: int | None = None
        self.requested_by_any = False
        """Set on every rank by ``train_step``'s collective: some rank got a signal."""
        self._pid_file = rundir.preempt_dir(run_dir) / f"{socket.gethostname()}.{os.getpid()}.pid"
        self._pid_file.parent.mkdir(parents=True, exist_ok=True)
        self._pid_file.write_text(f"{os.getpid()}\n")
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # else: signals stay as they are
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            name = signal.Signals(signum).name
            log.warning("got %s: stopping after this step to checkpoint", name)

    @property
    def signalled(self) -> bool:
        """Whether this rank got a signal (local; no collective)."""
        return self.signum is not None

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
            "preempted (%s): checkpoint %s in %.1f s; exiting %d for requeue",
            name,
            tag_dir,
            save_s,
            PREEMPTED_EXIT_CODE,
        )
        self.close()
        raise Preempted()

    def close(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._pid_file.unlink(missing_ok=True)
