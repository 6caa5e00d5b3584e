"""The Trainer: one run's training, read top to bottom in ``train``.

It owns the engine, the token stream, the train state, the guard and the run directory, and
one ``state_dict`` / ``load_state_dict`` that a save, a resume and a guard rewind all go
through, so a new piece of resume state is added in one place. Everything that leaves the
loop, rows and events alike, goes to the run's observers (``anneal.train.observers``).
``anneal.train.entry.run(cfg)`` checks everything, builds the engine and loads the checkpoint
before anything is written to the run directory, then hands them to a Trainer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from anneal import rundir
from anneal.data.prepared_dir import PreparedDir
from anneal.data.stream import PackedSplit, TokenStream
from anneal.dist import print0, rank, world_size
from anneal.errors import UserError
from anneal.eval.in_loop import InLoop
from anneal.hardware import device_peak_flops
from anneal.model import count_params, flops_per_token
from anneal.model.muon import step_flops_per_token
from anneal.observe.metrics import MetricsLogger, Mfu
from anneal.planning import measured_rate
from anneal.resilience import faults
from anneal.resilience.guard import Guard
from anneal.resilience.preempt import Preemption, StopMidStep
from anneal.resolution.resolve import Launch
from anneal.rundir import RunDir
from anneal.train import observers
from anneal.train.compiled import CompileClock
from anneal.train.engine import data_replica
from anneal.train.loss import next_token_loss
from anneal.train.saving import Saves
from anneal.train.step import StepShape, TrainState, train_step, validate

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Data:
    train: PackedSplit
    val: PackedSplit | None
    token_bytes: np.ndarray

    @classmethod
    def open(cls, launch: Launch) -> Data:
        path, seq_len = Path(launch.cfg.data.path), launch.seq_len
        val = PackedSplit(path, "val", seq_len=seq_len) if launch.cfg.train.val_samples else None
        train = PackedSplit(path, "train", seq_len=seq_len)
        return cls(train, val, PreparedDir(path).token_bytes())


class Trainer:
    """Owns the engine, the token stream, the train state, the guard and the run directory.

    ``train_step`` and ``val_step`` (``validate``) are the step functions
    (``anneal.train.step``; the first wrapped by fault injection when ``ANNEAL_FAULTS`` asks).
    ``watchers``: observers of the run besides its own (``start``), told everything after them."""

    def __init__(
        self,
        launch: Launch,
        engine,
        guard: Guard,
        run_dir: RunDir,
        data: Data,
        *,
        watchers: Sequence[observers.Observer] = (),
    ):
        self.launch, self.cfg, self.engine, self.guard = launch, launch.cfg, engine, guard
        self.run_dir, self.data, self.watchers = run_dir, data, list(watchers)
        self.state, self.stream = TrainState(), None
        self.observers = observers.Observers([])
        self.preemption = Preemption(launch.out)  # SIGUSR1/SIGTERM: checkpoint, then exit 75
        self.exports = observers.ExportAfterSave(self.cfg.train.export_every_save)
        fault = faults.from_env(rank())  # ANNEAL_FAULTS: drills and tests only
        self.train_step = fault.wrap(train_step, next_token_loss) if fault else train_step
        # synchronous or in the background (train.async_save); a save's pruning waits for the
        # previous export, which reads its tag
        self.saves = Saves(
            launch, engine, self.preemption, before_commit=self.exports.wait, fault=fault
        )
        self.val_step = validate
        self.shape = StepShape.of(launch)
        self.compile_clock = CompileClock() if self.cfg.train.compile != "off" else None
        self.samples_per_step = launch.ds_config["train_batch_size"]
        self.mfu = Mfu(
            flops_per_token=flops_per_token(launch.preset, seq_len=launch.seq_len)
            + step_flops_per_token(  # Muon's Newton-Schulz
                launch.preset, tokens_per_step=launch.tokens_per_step, ds_config=launch.ds_config
            ),
            peak_flops=device_peak_flops(engine.device),
            world_size=world_size(),
        )
        self.last_train, self.last_val = None, None
        self.stopped_at_position: int | None = None  # set by a stop inside a step (step())
        self.tasks = None  # train.eval_tasks, loaded at the start (anneal.eval.in_loop)

    # -- state: one dict for save, resume and rewind ---------------------------------------

    def state_dict(self) -> dict:
        data = self.stream.state_dict()
        if self.stopped_at_position is not None:  # a step dropped at a micro-batch boundary
            data = {**data, "position": self.stopped_at_position}
        return {
            **self.state.state_dict(),
            "data": data,
            "guard": self.guard.state_dict(),
            "tensor_parallel_size": self.launch.layout.tensor_parallel,  # into the manifest
            "sequence_parallel_size": self.launch.layout.sequence_parallel,  # and this
            "expert_parallel_size": self.launch.layout.expert_parallel,  # and this
            "zero_stage": self.launch.zero_stage,  # and this
        }

    def load_state_dict(self, client: dict) -> None:
        """The train state, the guard's record (which may move the data position past skipped
        samples) and the token stream at that position, from a checkpoint's client state."""
        if self.launch.cooldown is not None:  # a cooldown branch on other data starts it at 0
            client = self.launch.cooldown.client_for(client)
        self.state = TrainState(step=client["step"], tokens=client["tokens"])
        position = self.guard.restore(self.engine, client, client["data"]["position"])
        self.engine.lr_scheduler.apply()  # the schedule's LR, not the one the optimizer saved
        self._open_stream(position)

    def _open_stream(self, position: int) -> None:
        if self.stream is not None:
            self.stream.close()
        dp_rank, dp_size = data_replica(self.engine)  # a TP group reads as one
        self.stream = TokenStream(
            self.data.train,
            seed=self.cfg.train.seed,
            rank=dp_rank,
            world_size=dp_size,
            micro_batch=self.launch.micro_batch,
            position=position,
            prefetch=self.cfg.data.prefetch_batches,
        )

    # -- the loop ----------------------------------------------------------------------------

    def train(self, client: dict | None, resumed: dict) -> dict:
        """Start (from the checkpoint, if resuming), then until the last step: step, observe,
        guard (a rewind goes back and on), validate and save when due, and stop if a rank was
        asked to. docs/architecture.md, "The loop"."""
        self.start(client, resumed)
        try:
            if self.baseline_due():
                self.score_tasks()  # the untrained model: each task's starting point
            while self.state.step < self.end_step():
                row = self.step()
                self.observers.on_step(row)
                if self.guard_check(row) == "rewind":
                    self.rewind()
                    continue
                if self.validation_due():
                    self.validate()
                if self.tasks_due():
                    self.score_tasks()
                if self.save_due():
                    self.checkpoint()
                if self.preemption.requested_by_any:  # any rank (the step's collective)
                    self.preempt()
            self.saves.finish()  # the end of the run waits for its last save
            if self.state.step >= self.cfg.train.max_steps:
                self.observers.on_end()
            else:
                print0(self.stopped_line())
        except UserError:
            raise
        except Exception as e:
            self.observers.on_failure(e)
            raise
        finally:
            try:
                self.stream.close()
            finally:
                self.observers.close()  # the end-of-run plots last, the stream's thread gone
        return self.summary()

    def start(self, client: dict | None, resumed: dict) -> None:
        """The checkpoint's state (if resuming), then the observers, which start from it."""
        out, log_every = self.launch.out, self.cfg.train.log_every
        metrics = observers.Metrics(MetricsLogger(out), run_dir=out, log_every=log_every)
        self.observers = observers.Observers([observers.PlotsAndReport(out), metrics])
        self.saves.events = self.observers
        if client is None:
            self._open_stream(0)
        else:
            self.load_state_dict(client)
            position = self.stream.position
            self.observers.on_event(self.state.step, "resume", position=position, **resumed)
            print0(f"resumed from {resumed['checkpoint']} at step {self.state.step}")
            change = self.engine.lr_scheduler.change_on_resume()  # e.g. a new --max-steps
            if self.launch.cooldown is not None and self.state.step == self.launch.cooldown.step:
                change = None  # a branch's decay: the launch's notes said it
            if change and rank() == 0:
                log.warning(change)
        start = self.state.step
        self.observers.add(
            observers.ForecastCheck(
                out,
                start_step=start,
                tokens_per_step=self.shape.tokens_per_step,
                events=self.observers,
                rate=self._rate_key(),
            ),
            observers.LiveView(
                out, cfg=self.cfg, start_step=start, config_doc=self.launch.config_document()
            ),
            observers.Liveness(out, timeout_s=self.cfg.train.heartbeat_timeout_s),
            observers.PreemptionSignals(self.preemption),
            self.exports,
            observers.KeepRunDir(self.run_dir),
            *self.watchers,
        )
        if self.tasks is None and self.cfg.train.eval_tasks:  # loaded once, told to all
            self.tasks = InLoop.open(
                self.launch,
                self.engine,
                replica=data_replica(self.engine),
                step=start,
                events=self.observers,
            )

    def _rate_key(self) -> tuple[str, float] | None:
        """On a CPU: the shape under which the measured rate is kept, and FLOPs per token."""
        if self.launch.device_type != "cpu":
            return None
        flops = flops_per_token(self.launch.preset, seq_len=self.launch.seq_len)
        return measured_rate.shape_key(self.launch), flops

    def step(self) -> dict:
        start = self.stream.position
        if self.compile_clock is not None:
            self.compile_clock.start()
        try:
            row = self.train_step(self.engine, self.stream, self.state, self.shape, self.preemption)
        except StopMidStep:  # one process, signalled inside the step: the step is dropped
            self.stopped_at_position = start  # its samples are read again on resume
            self.preempt()
        if self.compile_clock is not None:  # compile time apart from the step's
            self.compile_clock.account(row, tokens_per_step=self.shape.tokens_per_step)
        row["mfu"] = self.mfu(row["tokens_per_s"])
        self.last_train = row
        self.saves.poll()  # a background save is committed once every rank has written it
        return row

    def end_step(self) -> int:
        """The step this process stops after: ``stop_at_step`` if set, else ``max_steps``."""
        train = self.cfg.train
        return min(train.stop_at_step or train.max_steps, train.max_steps)

    def guard_check(self, row: dict) -> str:
        samples = (self.stream.position - self.samples_per_step, self.stream.position)
        last = row["step"] >= self.end_step()
        return self.guard.check(row, self.engine, samples=samples, events=self.observers, last=last)

    def rewind(self) -> None:
        """The guard's rewind: back to the newest intact checkpoint before the spike, through
        ``load_state_dict`` as for a resume, with the spike's samples skipped."""
        self.saves.finish()  # the save in flight, if any, may be the one to go back to
        spike_step, spike_end = self.state.step, self.stream.position
        client, tag_dir = self.guard.load_before_spike(
            self.engine,
            rundir.checkpoints_dir(self.launch.out),
            spike_step=spike_step,
            spike_end=spike_end,
            samples_per_step=self.samples_per_step,
            expert_parallel=self.launch.layout.expert_parallel,
            tensor_parallel=self.launch.layout.tensor_parallel,
            zero_stage=self.launch.zero_stage,
        )
        self.load_state_dict(client)
        self.guard.rewound(spike_step, client, tag_dir, self.observers)

    def validation_due(self) -> bool:
        """Every ``val_every`` steps and after the last step (never without val data)."""
        train = self.cfg.train
        return self.data.val is not None and _due(self.state.step, train.val_every, train.max_steps)

    def validate(self) -> None:
        row = self.val_step(
            self.engine,
            self.data.val,
            self.data.token_bytes,
            n_samples=self.cfg.train.val_samples,
            micro_batch=self.launch.micro_batch,
            attention=self.launch.attention,
        )
        self.last_val = {**row, "step": self.state.step}
        self.observers.on_val(self.last_val)

    def tasks_due(self) -> bool:
        """Every ``eval_tasks_every`` steps and after the last step (never without tasks)."""
        train = self.cfg.train
        return self.tasks is not None and _due(
            self.state.step, train.eval_tasks_every, train.max_steps
        )

    def baseline_due(self) -> bool:
        """Before the first step of a run that starts from step 0 (not a resume, not a
        branch): the scores of the model as it starts, the line each task's rise is read from
        (chance for a model from scratch, the parent's level for continued pretraining)."""
        return self.tasks is not None and self.state.step == 0

    def score_tasks(self) -> None:
        doc = self.tasks.score(step=self.state.step, tokens=self.state.tokens)
        self.observers.on_eval(doc)

    def save_due(self) -> bool:
        """Every ``save_every`` steps, after the last step and at ``stop_at_step``."""
        train, step = self.cfg.train, self.state.step
        return _due(step, train.save_every, train.max_steps) or step == train.stop_at_step

    def checkpoint(self, *, wait: bool = False) -> None:
        """A checkpoint of this step (``anneal.train.saving``); with ``wait``, committed
        before this returns, even when it is written in the background."""
        self.saves.save(self.state.step, self.state_dict(), wait=wait)

    def preempt(self) -> None:
        """Collective: wait for the save in flight, save this step (unless the regular save
        just did), tell the observers, and exit 75 for a requeue
        (``anneal.resilience.preempt``)."""
        self.saves.finish()
        self.preemption.stop(
            step=self.state.step,
            ckpt_dir=rundir.checkpoints_dir(self.launch.out),
            save=lambda: self.checkpoint(wait=True),
            events=self.observers,
        )

    def stopped_line(self) -> str:
        """What a stop before the last step (``train.stop_at_step``) says: where, what it
        saved, and how to go on, so that it never reads like a crash."""
        train, step = self.cfg.train, self.state.step
        last = self.saves.last
        saved = f"checkpoint {last} written" if last else "saved"
        return (
            f"stopped at step {step} of {train.max_steps} (train.stop_at_step={train.stop_at_step})"
            f": {saved}. To go on, run the same command again without train.stop_at_step (or "
            f"with a later one): it resumes from that checkpoint."
        )

    def summary(self) -> dict:
        train, val = self.last_train or {}, self.last_val or self._earlier_val()
        return {
            "run_dir": str(self.launch.out),
            "step": self.state.step,
            "max_steps": self.cfg.train.max_steps,
            "val_step": val.get("step"),
            "val_every": self.cfg.train.val_every if self.data.val is not None else None,
            "tokens": self.state.tokens,
            "train_loss": train.get("loss"),
            "tokens_per_s": train.get("tokens_per_s"),
            "val_loss": val.get("val_loss"),
            "val_bpb": val.get("val_bpb"),
            "params": count_params(self.launch.preset),
        }

    def _earlier_val(self) -> dict:
        """The run's last validation row when this process ran none (it resumed after it, and
        stopped before the next): the summary shows it with its step, not "n/a"."""
        if rank() != 0 or not rundir.metrics_path(self.launch.out).is_file():
            return {}
        rows = rundir.read_metrics(self.launch.out, "val")
        return rows[-1] if rows else {}


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)
