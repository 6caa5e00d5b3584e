"""The Trainer: one run's training, read top to bottom in ``train``.

It owns the engine, the token stream, the train state, the guard and the run directory, and
one ``state_dict`` / ``load_state_dict`` that a save, a resume and a guard rewind all go
through, so a new piece of resume state is added in one place. What watches the run sits
behind ``anneal.train.observers``. ``run(cfg)`` checks everything, builds the engine and loads
the checkpoint before anything is written to the run directory (``anneal.rundir.RunDir``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import torch

from anneal import model as modellib
from anneal import rundir
from anneal.config.run import RunConfig
from anneal.config.run_checks import check_ranges
from anneal.data.prepared_dir import PreparedDir
from anneal.data.stream import PackedSplit, TokenStream
from anneal.dist import print0, rank, world_size
from anneal.errors import UserError
from anneal.hardware import device_peak_flops
from anneal.launch.resolve import Launch
from anneal.observe import progress as live
from anneal.observe.metrics import MetricsLogger
from anneal.resilience import checkpoint, faults
from anneal.resilience.guard import Guard
from anneal.resilience.preempt import Preemption
from anneal.rundir import RunDir
from anneal.train import engine as enginelib
from anneal.train import observers
from anneal.train import step as steplib
from anneal.train.step import TrainState

log = logging.getLogger(__name__)


def run(cfg: RunConfig, overrides: list[str] = ()) -> dict:
    """Train per ``cfg``. Returns a summary (final losses, tokens/s, run directory).

    Everything is checked (``resolve_launch``), the engine built and the checkpoint loaded before
    anything is written to the run directory; a launch that fails after that but before its
    first step puts the directory back as it found it (``RunDir``), so the corrected relaunch
    starts cleanly instead of meeting the config of a run that never trained."""
    check_ranges(cfg)  # before the process group: collective_timeout_s goes there
    enginelib.setup_process(cfg.train.collective_timeout_s)
    launch = enginelib.resolve_run(cfg, overrides)
    for note in launch.notes:
        log.warning(note)
    torch.manual_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    data = Data.open(launch)
    print0(launch.describe())
    engine = enginelib.build_engine(launch)
    recompute = getattr(engine.module, "is_gradient_checkpointing", False)
    print0(f"activation checkpointing {'on' if recompute else 'off'}")
    t0 = time.perf_counter()
    resume_from = launch.resume_from and checkpoint.verified_resume(
        launch.resume_from,
        fallback=launch.cfg.resume == "auto",  # a branch: its parent's tag
    )
    resumed = {"verify_s": round(time.perf_counter() - t0, 3)}
    guard = Guard(cfg.guard, run_dir=launch.out, resuming=resume_from is not None)
    client = None
    if resume_from is not None:
        t0 = time.perf_counter()
        client = checkpoint.load(engine, resume_from, ckpt_dir=rundir.checkpoints_dir(launch.out))
        resumed.update(checkpoint=str(resume_from), load_s=round(time.perf_counter() - t0, 3))
    run_dir = RunDir.for_launch(launch)
    try:
        return Trainer(launch, engine, guard, run_dir, data).train(client, resumed)
    except BaseException:
        run_dir.undo()
        raise


@dataclasses.dataclass
class Data:
    train: PackedSplit
    val: PackedSplit | None
    token_bytes: np.ndarray

    @classmethod
    def open(cls, launch: Launch) -> Data:
        path, seq_len = Path(launch.cfg.data.path), launch.seq_len
        val = PackedSplit(path, "val", seq_len=seq_len) if launch.cfg.train.eval_samples else None
        train = PackedSplit(path, "train", seq_len=seq_len)
        return cls(train, val, PreparedDir(path).token_bytes())


class Trainer:
    """Owns the engine, the token stream, the train state, the guard and the run directory."""

    def __init__(self, launch: Launch, engine, guard: Guard, run_dir: RunDir, data: Data):
        self.launch, self.cfg, self.engine, self.guard = launch, launch.cfg, engine, guard
        self.run_dir, self.data = run_dir, data
        self.state, self.stream = TrainState(), None
        self.metrics = MetricsLogger(launch.out)
        self.preemption = Preemption(launch.out)  # SIGUSR1/SIGTERM: checkpoint, then exit 75
        self.exports = observers.ExportAfterSave(self.cfg.train.export_every_save)
        fault = faults.from_env(rank())  # ANNEAL_FAULTS: drills and tests only
        base = steplib.train_step
        self.train_step = fault.wrap(base, steplib.next_token_loss) if fault else base
        self.samples_per_step = launch.ds_config["train_batch_size"]
        flops = modellib.flops_per_token(launch.preset, seq_len=launch.seq_len)
        self.flops_per_s = flops / (device_peak_flops(engine.device) * world_size())
        self.last_train, self.last_val = None, None
        self.watchers: list[observers.Observer] = []

    # -- state: one dict for save, resume and rewind ---------------------------------------

    def state_dict(self) -> dict:
        return {
            **self.state.state_dict(),
            "data": self.stream.state_dict(),
            "guard": self.guard.state_dict(),
            "tensor_parallel_size": self.launch.layout.tensor_parallel,  # into the manifest
            "sequence_parallel_size": self.launch.layout.sequence_parallel,  # and this
        }

    def load_state_dict(self, client: dict) -> None:
        """The train state, the guard's record (which may move the data position past skipped
        samples) and the token stream at that position, from a checkpoint's client state."""
        if self.launch.branch is not None:  # a cooldown branch on other data starts it at 0
            client = self.launch.branch.client_for(client)
        self.state = TrainState(step=client["step"], tokens=client["tokens"])
        position = self.guard.restore(self.engine, client, client["data"]["position"])
        self.engine.lr_scheduler.apply()  # the schedule's LR, not the one the optimizer saved
        self._open_stream(position)

    def _open_stream(self, position: int) -> None:
        if self.stream is not None:
            self.stream.close()
        dp_rank, dp_size = enginelib.data_parallel(self.engine)  # a TP group reads as one
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
        """Restore, then until the last step: step, observe, guard, validate, checkpoint, and
        stop if a rank was asked to."""
        self.restore(client, resumed)
        try:
            while self.state.step < self.end_step():
                row = self.step()
                self.observe("on_step", row)
                self.run_dir.stepped = True
                if self.guard_check(row) == "rewind":
                    self.rewind()
                    continue
                self.validate()
                self.checkpoint()
                if self.preemption.requested_by_any:  # any rank (the step's collective)
                    self.preemption.stop(
                        step=self.state.step,
                        ckpt_dir=rundir.checkpoints_dir(self.launch.out),
                        metrics=self.metrics,
                        save=lambda: self.checkpoint(force=True),
                    )
        except UserError:
            raise
        except Exception as e:
            self.observe("on_failure", e)
            raise
        finally:
            for watcher in reversed(self.watchers):
                watcher.close()
            self.stream.close()
        if self.state.step >= self.cfg.train.max_steps:
            live.finish_run(self.launch.out)  # rank 0: RUN/plots/*.png, the health report
        return self.summary()

    def restore(self, client: dict | None, resumed: dict) -> None:
        """The checkpoint's state (if resuming), then the observers, which start from it."""
        self.watchers = [observers.Metrics(self.metrics)]
        if client is None:
            self._open_stream(0)
        else:
            self.load_state_dict(client)
            self.metrics.event(self.state.step, "resume", position=self.stream.position, **resumed)
            print0(f"resumed from {resumed['checkpoint']} at step {self.state.step}")
            change = self.engine.lr_scheduler.change_on_resume()  # e.g. a new --max-steps
            if self.launch.branch is not None and self.state.step == self.launch.branch.step:
                change = None  # a branch's decay: the launch's notes said it
            if change and rank() == 0:
                log.warning(change)
        out, start = self.launch.out, self.state.step
        self.watchers += [
            observers.ForecastCheck(
                out,
                start_step=start,
                device=self.engine.device,
                tokens_per_step=self.launch.tokens_per_step,
                metrics=self.metrics,
            ),
            observers.LiveView(
                live.LiveView(
                    out, cfg=self.cfg, start_step=start, config_doc=self.launch.config_document()
                )
            ),
            observers.Heartbeat(out, timeout_s=self.cfg.train.heartbeat_timeout_s),
            observers.PreemptionSignals(self.preemption),
            self.exports,
        ]

    def observe(self, event: str, arg) -> None:
        for watcher in self.watchers:
            getattr(watcher, event)(arg)

    def step(self) -> dict:
        row = self.train_step(self.engine, self.stream, self.state, self.launch, self.preemption)
        row["mfu"] = self.flops_per_s * row["tokens_per_s"]
        self.last_train = row
        return row

    def end_step(self) -> int:
        """The step this process stops after: ``stop_at_step`` if set, else ``max_steps``."""
        train = self.cfg.train
        return min(train.stop_at_step or train.max_steps, train.max_steps)

    def guard_check(self, row: dict) -> str:
        samples = (self.stream.position - self.samples_per_step, self.stream.position)
        last = row["step"] >= self.end_step()
        return self.guard.check(row, self.engine, samples=samples, metrics=self.metrics, last=last)

    def rewind(self) -> None:
        """The guard's rewind: back to the newest intact checkpoint before the spike, through
        ``load_state_dict`` as for a resume, with the spike's samples skipped."""
        spike_step, spike_end = self.state.step, self.stream.position
        client, tag_dir = self.guard.rewind(
            self.engine,
            rundir.checkpoints_dir(self.launch.out),
            spike_step=spike_step,
            spike_end=spike_end,
            samples_per_step=self.samples_per_step,
        )
        self.load_state_dict(client)
        self.guard.rewound(spike_step, client, tag_dir, self.metrics)

    def validate(self) -> None:
        """Every ``eval_every`` steps and after the last step (never without val data)."""
        train = self.cfg.train
        if self.data.val is None or not _due(self.state.step, train.eval_every, train.max_steps):
            return
        row = steplib.validate(self.engine, self.data.val, self.data.token_bytes, self.launch)
        self.last_val = {**row, "step": self.state.step}
        self.observe("on_val", self.last_val)

    def checkpoint(self, *, force: bool = False) -> None:
        """Every ``save_every`` steps, after the last step and at ``stop_at_step`` (``force``:
        now, for a preemption)."""
        train, step = self.cfg.train, self.state.step
        due = _due(step, train.save_every, train.max_steps) or step == train.stop_at_step
        if not (due or force):
            return
        self.exports.wait()  # the previous export reads its tag; keep-K may remove it now
        tag_dir = checkpoint.save(
            self.engine,
            rundir.checkpoints_dir(self.launch.out),
            step=step,
            client_state=self.state_dict(),
            keep_last=train.keep_last,
            keep_every=train.keep_every,
            model=dataclasses.asdict(self.launch.preset),
        )
        self.metrics.event(step, "checkpoint", path=str(tag_dir))
        self.observe("on_checkpoint", tag_dir)

    def summary(self) -> dict:
        train, val = self.last_train or {}, self.last_val or {}
        return {
            "run_dir": str(self.launch.out),
            "step": self.state.step,
            "tokens": self.state.tokens,
            "train_loss": train.get("loss"),
            "tokens_per_s": train.get("tokens_per_s"),
            "val_loss": val.get("val_loss"),
            "val_bpb": val.get("val_bpb"),
            "params": modellib.count_params(self.launch.preset),
        }


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)
