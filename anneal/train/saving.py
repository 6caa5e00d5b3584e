"""The run's checkpoint saves, synchronous or asynchronous (``train.async_save``), and what
each tells the run's observers.

A synchronous save (``anneal.resilience.checkpoint.save``) is complete when ``save`` returns.
An asynchronous one (``anneal.resilience.background_save``) returns after its snapshot: a
``snapshot`` event then (the moe sums are cut there, as at a checkpoint), and the
``checkpoint`` event and ``on_checkpoint`` only once it is committed, at ``poll`` after a later
step or at ``finish``. Either way the ``checkpoint`` event carries what the save cost: the
seconds the loop waited (``blocking_s``) and, for an asynchronous save, the seconds its files
took behind the training (``write_s``), and a console line says both.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from anneal import rundir
from anneal.dist import print0
from anneal.resilience import checkpoint
from anneal.resilience.background_save import AsyncSaves, SaveTimes, sync_times
from anneal.resilience.preempt import Preemption
from anneal.resolution.resolve import Launch
from anneal.train import observers


class Saves:
    """Every rank's saves; every method is collective. ``events``: the run's observers (set by
    the Trainer once they exist); ``before_commit``: called before a save prunes (the export
    of an older tag is waited for); ``fault``: ``anneal.resilience.faults.Faults`` (drills)."""

    def __init__(
        self, launch: Launch, engine, preemption: Preemption, *, before_commit, fault=None
    ):
        train = launch.cfg.train
        self.engine, self.preemption, self.before_commit = engine, preemption, before_commit
        self.ckpt_dir = rundir.checkpoints_dir(launch.out)
        self.keep_last, self.keep_every = train.keep_last, train.keep_every
        self.model = dataclasses.asdict(launch.preset)
        self.events: observers.Observer = observers.Observers([])
        self.last: Path | None = None
        self.background = None
        if train.async_save:
            self.background = AsyncSaves(
                engine,
                self.ckpt_dir,
                keep_last=train.keep_last,
                keep_every=train.keep_every,
                on_commit=self.committed,
                before_commit=before_commit,
                fault=fault,
            )

    def save(self, step: int, client_state: dict, *, wait: bool = False) -> None:
        """A checkpoint of ``step``; with ``wait``, committed before this returns."""
        if self.background is None:
            started = time.perf_counter()
            self.before_commit()
            tag_dir = checkpoint.save(
                self.engine,
                self.ckpt_dir,
                step=step,
                client_state=client_state,
                keep_last=self.keep_last,
                keep_every=self.keep_every,
                model=self.model,
            )
            self.committed(tag_dir, step, sync_times(started))
            return
        tag_dir = self.background.save(step=step, client_state=client_state, model=self.model)
        taken = self.background.in_flight.times.fields()  # its write_s comes at the commit
        taken.pop("write_s")
        self.events.on_event(step, "snapshot", path=str(tag_dir), **taken)
        if wait:
            self.background.finish()

    def poll(self) -> None:
        """After a step: commit the save in flight once every rank has written it."""
        if self.background is not None:
            self.background.poll()

    def finish(self) -> None:
        """Wait for the save in flight, if any, and commit it."""
        if self.background is not None:
            self.background.finish()

    def committed(self, tag_dir: Path, step: int, times: SaveTimes) -> None:
        """A save is complete on every rank: the event, the console line, ``on_checkpoint``."""
        self.last = Path(tag_dir)
        self.preemption.last_save_s = times.blocking_s + times.write_s  # a stop's estimate
        asynchronous = self.background is not None
        self.events.on_event(
            step, "checkpoint", path=str(tag_dir), asynchronous=asynchronous, **times.fields()
        )
        behind = f", its files written behind the training in {times.write_s:.2f} s"
        print0(
            f"step {step:>6} | checkpoint {tag_dir.name} | the loop waited "
            f"{times.blocking_s:.2f} s" + (behind if asynchronous else "")
        )
        self.events.on_checkpoint(tag_dir)
