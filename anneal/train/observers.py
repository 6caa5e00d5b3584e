"""What watches a run, behind one interface of methods (``Observer``) that the Trainer calls
through one object (``Observers``): rows and events alike go this way out of the loop.

- ``on_step(row)`` after each optimizer step, before the guard looks at it;
- ``on_event(step, event, **fields)`` for each event: resume, spike, skip, rewind, snapshot
  (an asynchronous save's state taken), checkpoint (a save complete), forecast, preempt,
  eval_failed (the guard, preemption, the forecast check and the in-loop evaluator emit theirs
  through it too);
- ``on_val(row)`` after each validation; ``on_eval(doc)`` after each scoring of the
  downstream tasks (``anneal.eval.results``' document); ``on_checkpoint(tag_dir)`` after each
  complete save (an asynchronous one: once committed on every rank);
- ``on_failure(error)`` when the loop raises (not on a ``UserError``);
- ``on_end()`` once the run's last step (``max_steps``) is done;
- ``close()`` at the end, whatever happened, in reverse order: the metrics file closes after
  the others, and the end-of-run plots and report come after everything.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from anneal import rundir
from anneal.dist import is_main_process, print0, rank, world_size
from anneal.eval import results
from anneal.observe.metrics import MetricsLogger
from anneal.observe.moe import MoeCounts, without_counts
from anneal.observe.progress import ProgressBar, WandbSink, finish_run
from anneal.planning import forecast, measured_rate
from anneal.resilience import heartbeat
from anneal.resilience.preempt import Preemption

log = logging.getLogger(__name__)


class Observer:
    """Does nothing; an observer overrides what it watches."""

    def on_step(self, row: dict) -> None: ...

    def on_val(self, row: dict) -> None: ...

    def on_eval(self, doc: dict) -> None: ...

    def on_event(self, step: int, event: str, **fields) -> None: ...

    def on_checkpoint(self, tag_dir: Path) -> None: ...

    def on_failure(self, error: BaseException) -> None: ...

    def on_end(self) -> None: ...

    def close(self) -> None: ...


class Observers(Observer):
    """A run's observers as one: each call goes to every member, in order; ``close`` in
    reverse order."""

    def __init__(self, members: list[Observer]):
        self.members = list(members)

    def add(self, *members: Observer) -> None:
        self.members += members

    def on_step(self, row: dict) -> None:
        for member in self.members:
            member.on_step(row)

    def on_val(self, row: dict) -> None:
        for member in self.members:
            member.on_val(row)

    def on_eval(self, doc: dict) -> None:
        for member in self.members:
            member.on_eval(doc)

    def on_event(self, step: int, event: str, **fields) -> None:
        for member in self.members:
            member.on_event(step, event, **fields)

    def on_checkpoint(self, tag_dir: Path) -> None:
        for member in self.members:
            member.on_checkpoint(tag_dir)

    def on_failure(self, error: BaseException) -> None:
        for member in self.members:
            member.on_failure(error)

    def on_end(self) -> None:
        for member in self.members:
            member.on_end()

    def close(self) -> None:
        for member in reversed(self.members):
            member.close()


class Metrics(Observer):
    """Every row and event to metrics.jsonl and TensorBoard (rank 0); the console line of a
    validation and of a scoring of the downstream tasks, whose document goes to
    ``RUN/evals/step-<N>.json`` (rank 0).

    A sparse model's train rows go without their ``moe_counts``: those are summed
    (``anneal.observe.moe.MoeCounts``) into a ``moe`` row every ``log_every`` steps, at each
    checkpoint (so that a resume from it starts a fresh sum: no step is lost or counted twice),
    at the run's last step and when the loop stops (a crash's last steps are seen). A rewind
    forgets the sum: its steps are trained again."""

    def __init__(self, logger: MetricsLogger, *, run_dir: Path | None = None, log_every: int = 1):
        self.logger, self.run_dir, self.log_every = logger, run_dir, max(1, log_every)
        self.moe = MoeCounts()

    def on_step(self, row: dict) -> None:
        self.moe.add(row)
        self.logger.write(without_counts(row))
        if row["step"] % self.log_every == 0:
            self.write_moe()

    def write_moe(self) -> None:
        """The moe row of the steps summed since the last one, if any."""
        row = self.moe.take()
        if row is not None:
            self.logger.write(row)

    def on_event(self, step: int, event: str, **fields) -> None:
        if event == "rewind":
            self.moe.drop()
        self.logger.event(step, event, **fields)
        if event in ("checkpoint", "snapshot"):  # an asynchronous save's state: its snapshot
            self.write_moe()

    def on_end(self) -> None:
        self.write_moe()

    def on_val(self, row: dict) -> None:
        self.logger.write(row)
        per_source = [  # a blend: each source's bits per byte (anneal.train.step.validate)
            f"{k.split('/', 1)[1]} {v:.4f}" for k, v in row.items() if k.startswith("val_bpb/")
        ]
        print0(
            f"step {row['step']:>6} | val loss {row['val_loss']:.4f} | "
            f"ppl {row['val_ppl']:.2f} | bpb {row['val_bpb']:.4f}"
            + (f" ({', '.join(per_source)})" if per_source else "")
        )

    def on_eval(self, doc: dict) -> None:
        if self.run_dir is not None and is_main_process():
            results.write(self.run_dir, doc)
        self.logger.write(results.metrics_row(doc))
        print0(eval_line(doc))

    def close(self) -> None:
        self.write_moe()
        self.logger.close()


def eval_line(doc: dict) -> str:
    """The console line of a scoring: each task's headline metric (with its chance), the
    tasks that did not score, and the time."""
    parts = []
    for task, entry in sorted(doc.get("tasks", {}).items()):
        name, value = headline(entry["metrics"])
        chance = entry.get("chance")
        parts.append(
            f"{task} {name} {value:.4f}" + (f" (chance {chance:.2f})" if chance is not None else "")
            if name
            else f"{task} -"
        )
    parts += [f"{task} failed" for task in sorted(doc.get("failed", {}))]
    seconds = doc.get("seconds")
    took = f" | {seconds:.1f} s" if isinstance(seconds, int | float) else ""
    return f"step {doc['step']:>6} | eval " + (", ".join(parts) or "no tasks") + took


def headline(metrics: dict[str, float]) -> tuple[str | None, float]:
    """The metric a task is judged by at a glance: acc_norm, acc, the perplexities, else the
    first that is not a stderr."""
    for name in ("acc_norm", "acc", "word_perplexity", "perplexity", "bits_per_byte"):
        if name in metrics:
            return name, metrics[name]
    rest = sorted(k for k in metrics if not k.endswith("_stderr"))
    return (rest[0], metrics[rest[0]]) if rest else (None, float("nan"))


class ForecastCheck(Observer):
    """The launcher's forecast against the measured step time and memory
    (``anneal.planning.forecast``), told to ``events`` (the run's observers). ``rate``: on a
    CPU, (shape key, FLOPs per token) under which rank 0 keeps the rate this run measured for
    the next forecast of the same shape (``anneal.planning.measured_rate``)."""

    def __init__(self, run_dir: Path, *, start_step: int, tokens_per_step: int, events, rate=None):
        self.check = forecast.Check(run_dir, start_step=start_step)
        self.tokens_per_step, self.events = tokens_per_step, events
        self.run_dir, self.rate, self.rows = Path(run_dir), rate, []

    def on_step(self, row: dict) -> None:
        self.rows.append(row)
        fields = self.check.after_step(row, self.tokens_per_step)
        if fields is not None:
            self.events.on_event(row["step"], "forecast", **fields)

    def close(self) -> None:
        if self.rate is None or not is_main_process():
            return
        key, flops_per_token = self.rate
        rate = measured_rate.rate_of(
            self.rows, flops_per_token=flops_per_token, world_size=world_size()
        )
        if rate is not None:
            measured_rate.remember(key, rate, run_dir=self.run_dir)


class LiveView(Observer):
    """The progress bar of the train rows and, when asked for (``train.wandb`` or
    ``ANNEAL_WANDB=1``), Weights & Biases of every row (``anneal.observe.progress``)."""

    def __init__(self, run_dir: Path, *, cfg, config_doc: dict, start_step: int = 0):
        self.bar = ProgressBar(
            max_steps=cfg.train.max_steps, log_every=cfg.train.log_every, start_step=start_step
        )
        wandb = cfg.train.wandb or os.environ.get("ANNEAL_WANDB") == "1"
        self.wandb = WandbSink(run_dir, config=config_doc, enabled=wandb)

    def on_step(self, row: dict) -> None:
        self.bar.update(row)
        self.wandb.log(row)

    def on_val(self, row: dict) -> None:
        self.wandb.log(row)

    def on_eval(self, doc: dict) -> None:
        self.wandb.log(results.metrics_row(doc))

    def close(self) -> None:
        self.bar.close()
        self.wandb.close()


class Liveness(Observer):
    """This rank's heartbeat, and the peers' watched (``anneal.resilience.heartbeat``)."""

    def __init__(self, run_dir: Path, *, timeout_s: float):
        self.beat = heartbeat.start(
            run_dir, rank=rank(), world_size=world_size(), timeout_s=timeout_s
        )

    def on_step(self, row: dict) -> None:
        self.beat.completed(row["step"])

    def on_failure(self, error: BaseException) -> None:
        self.beat.failed(error)  # names a rank that went silent, if one did

    def close(self) -> None:
        self.beat.close()


class PreemptionSignals(Observer):
    """SIGUSR1/SIGTERM caught for the run (``anneal.resilience.preempt``); put back at the end."""

    def __init__(self, preemption: Preemption):
        self.preemption = preemption

    def close(self) -> None:
        self.preemption.close()


class KeepRunDir(Observer):
    """The run directory's undo rule (``anneal.rundir.RunDir``): a launch that fails before its
    first step puts the directory back as it found it; from the first step on it is kept."""

    def __init__(self, run_dir: rundir.RunDir):
        self.run_dir = run_dir

    def on_step(self, row: dict) -> None:
        self.run_dir.stepped = True


class PlotsAndReport(Observer):
    """Rank 0, once the run's last step is done: its plots and health report
    (``anneal.observe.progress.finish_run``), drawn at ``close``, after the other observers
    closed (the first member of ``Observers`` closes last)."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.ended = run_dir, False

    def on_end(self) -> None:
        self.ended = True

    def close(self) -> None:
        if self.ended:
            finish_run(self.run_dir)


class ExportAfterSave(Observer):
    """``train.export_every_save``: rank 0 exports each checkpoint, once it is complete on every
    rank, to ``RUN/hf/<tag>`` in a child process (``anneal export``, verified), so that the
    exporter's memory and time never land in the training process and the other ranks go on to
    their next collective. One export at a time: the next save (``wait``), and the end of the
    run, wait for the one before. A failed export is logged; the run and its checkpoint are
    fine."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and is_main_process()
        self._child = None  # (Popen, tag_dir)

    def on_checkpoint(self, tag_dir: Path) -> None:
        if not self.enabled:
            return
        self.wait()
        run = rundir.of_checkpoint(tag_dir)
        out = rundir.hf_dir(run, tag_dir.name)
        cmd = [
            sys.executable,
            "-m",
            "anneal.cli",
            "export",
            str(run),
            "--tag",
            tag_dir.name,
            "--out",
            str(out),
            "--force",
        ]
        sys.stdout.flush()
        try:
            self._child = (subprocess.Popen(cmd, env=_child_env()), tag_dir)
        except OSError as e:
            log.error("export of %s could not start (%s); the checkpoint is intact", tag_dir, e)

    def wait(self) -> None:
        """Until the running export (if any) has finished; log it if it failed."""
        if self._child is None:
            return
        child, tag_dir = self._child
        self._child = None
        if child.wait() != 0:
            log.error(
                "export of %s failed (exit %d, its error above); training goes on, the "
                "checkpoint is intact: export it later with `anneal export`",
                tag_dir,
                child.returncode,
            )

    close = wait


def _child_env() -> dict:
    """This environment, with the directory that holds this ``anneal`` first on PYTHONPATH."""
    import anneal

    root = str(Path(anneal.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}
