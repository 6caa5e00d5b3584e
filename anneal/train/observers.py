"""What watches a run, behind one small interface that the Trainer calls from one place:
``on_step(row)`` after each optimizer step, ``on_val(row)`` after each validation,
``on_checkpoint(tag_dir)`` after each complete save, ``on_failure(error)`` when the loop raises,
and ``close()`` at the end (in reverse order, so the metrics file closes last)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from anneal import rundir
from anneal.dist import is_main_process, print0, rank, world_size
from anneal.observe import progress as live
from anneal.observe.metrics import MetricsLogger
from anneal.planning import forecast
from anneal.resilience import heartbeat
from anneal.resilience.preempt import Preemption

log = logging.getLogger(__name__)


class Observer:
    """Does nothing; an observer overrides what it watches."""

    def on_step(self, row: dict) -> None: ...

    def on_val(self, row: dict) -> None: ...

    def on_checkpoint(self, tag_dir: Path) -> None: ...

    def on_failure(self, error: BaseException) -> None: ...

    def close(self) -> None: ...


class Metrics(Observer):
    """Every row to metrics.jsonl and TensorBoard (rank 0); the console line of a validation."""

    def __init__(self, logger: MetricsLogger):
        self.logger = logger

    def on_step(self, row: dict) -> None:
        self.logger.write(row)

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

    def close(self) -> None:
        self.logger.close()


class ForecastCheck(Observer):
    """The launcher's forecast against the measured step time and memory
    (``anneal.planning.forecast``)."""

    def __init__(self, run_dir: Path, *, start_step: int, tokens_per_step: int, device, metrics):
        self.check = forecast.Check(run_dir, start_step=start_step)
        self.tokens_per_step, self.device, self.metrics = tokens_per_step, device, metrics

    def on_step(self, row: dict) -> None:
        self.check.after_step(row, self.tokens_per_step, self.device, self.metrics)


class LiveView(Observer):
    """The progress bar and Weights & Biases (``anneal.observe.progress``)."""

    def __init__(self, view: live.LiveView):
        self.view = view

    def on_step(self, row: dict) -> None:
        self.view.update(row)

    on_val = on_step

    def close(self) -> None:
        self.view.close()


class Heartbeat(Observer):
    """This rank's liveness, and the peers' watched (``anneal.resilience.heartbeat``)."""

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
