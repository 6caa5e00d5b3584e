"""What a person watches of a run: the rank-0 progress bar, optional Weights & Biases, and
what a run writes when it ends (plots, health report). The Trainer's observers
(``anneal.train.observers``: ``LiveView``, ``PlotsAndReport``) drive them.

On a terminal, tqdm draws the progress bar in place and a plain line is kept every
``log_every`` steps so the history scrolls. When stdout is not a terminal (CI, Slurm logs, a
pipe) only the plain lines are printed, every ``log_every`` steps, so logs stay readable and
grep-able.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path

from anneal.dist import is_main_process
from anneal.observe import moe
from anneal.planning.forecast import format_duration

log = logging.getLogger(__name__)


# --- progress ----------------------------------------------------------------------------------


class ProgressBar:
    """Step, loss (and a sparse model's aux loss beside it), tokens/s and ETA on rank 0.

    ``interactive`` defaults to whether ``stream`` is a terminal. Interactive: a tqdm bar
    redrawn in place, with a plain line kept above it every ``log_every`` steps. Otherwise: a
    plain line every ``log_every`` steps and at the first and last step.
    """

    def __init__(
        self,
        *,
        max_steps: int,
        log_every: int = 10,
        start_step: int = 0,
        stream=None,
        interactive: bool | None = None,
        enabled: bool | None = None,
    ):
        self.max_steps = max_steps
        self.log_every = max(1, log_every)
        self.stream = stream or sys.stdout
        self.enabled = is_main_process() if enabled is None else enabled
        if interactive is None:
            isatty = getattr(self.stream, "isatty", None)
            interactive = bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"
        self.interactive = interactive
        self._start_step = start_step
        self._t0 = time.monotonic()
        self._bar = None
        self._unkept: str | None = None
        """The latest line the bar shows but the history does not hold yet."""
        if self.enabled and self.interactive:
            from tqdm import tqdm

            self._bar = tqdm(
                total=max_steps,
                initial=start_step,
                desc=self._step(start_step) + " ",
                file=self.stream,
                bar_format="{desc}{bar:20}| {postfix}",
                disable=False,  # a terminal: drawn whatever TQDM_DISABLE says (anneal/__init__)
                dynamic_ncols=True,
                leave=False,
            )

    def eta_s(self, step: int) -> float:
        done = step - self._start_step
        if done <= 0:
            return math.nan
        return (time.monotonic() - self._t0) / done * (self.max_steps - step)

    def _step(self, step: int) -> str:
        return f"step {step:>{len(str(self.max_steps))}}/{self.max_steps}"

    def _fields(self, row: dict) -> list[str]:
        loss, aux = row.get("loss"), row.get("aux_loss")
        parts = [f"loss {loss:.4f}" if isinstance(loss, int | float) else "loss nan"]
        if "aux_loss" in row:  # a sparse model: its router's aux loss beside the LM loss
            parts[0] += f" aux {aux:.4f}" if isinstance(aux, int | float) else " aux nan"
        if isinstance(row.get("lr"), int | float):
            parts.append(f"lr {row['lr']:.2e}")
        if isinstance(row.get("grad_norm"), int | float):
            parts.append(f"gnorm {row['grad_norm']:.3f}")
        parts.append(f"{row.get('tokens_per_s') or 0:,.0f} tok/s")
        if isinstance(row.get("mfu"), int | float):
            parts.append(f"mfu {100 * min(row['mfu'], 1):.2f}%")  # never over the peak
        if isinstance(row.get("mem_max_gib"), int | float):
            parts.append(f"mem {row['mem_max_gib']:.2f} GiB")
        parts.append(f"ETA {format_duration(self.eta_s(row['step']))}")
        return parts

    def line(self, row: dict) -> str:
        """The plain line of one row, as logs get it."""
        return " | ".join([self._step(row["step"]), *self._fields(row)])

    def update(self, row: dict) -> None:
        if not self.enabled:
            return
        step = row["step"]
        keep = step % self.log_every == 0 or step == 1 or step == self.max_steps
        if self._bar is not None:
            self._unkept = None if keep else self.line(row)
            if keep:
                self._bar.write(self.line(row), file=self.stream)
            self._bar.set_description_str(self._step(step) + " ", refresh=False)
            self._bar.set_postfix_str(" | ".join(self._fields(row)), refresh=False)
            self._bar.update(step - self._bar.n)
        elif keep:
            self.stream.write(self.line(row) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            if self._unkept is not None:  # a run that stopped between kept lines
                self.stream.write(self._unkept + "\n")
                self.stream.flush()


# --- Weights & Biases (optional) ---------------------------------------------------------------


class WandbSink:
    """Mirror metrics rows to W&B when asked for (``train.wandb`` or ``ANNEAL_WANDB=1``) and
    installed; offline unless ``WANDB_MODE`` says otherwise, so no network is needed."""

    def __init__(self, run_dir: Path, *, config: dict, enabled: bool):
        self._run, self._eval_axis = None, False
        if not (enabled and is_main_process()):
            return
        try:
            import wandb
        except ImportError:
            log.warning("W&B asked for but wandb is not installed (pip install wandb); skipped")
            return
        os.environ.setdefault("WANDB_MODE", "offline")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "anneal"),
            name=Path(run_dir).name,
            dir=str(run_dir),
            config=config,
            resume="allow",
        )

    def log(self, row: dict) -> None:
        if self._run is None or row.get("kind") not in ("train", "val", "eval"):
            return
        if row["kind"] == "eval":
            self._log_eval(row)
            return
        data = moe.scalars(row)  # a sparse model's balance, as TensorBoard gets it
        for key, value in row.items():
            if key in ("kind", "step") or key in moe.MOE_FIELDS:
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                data[f"{row['kind']}/{key}"] = value
            elif isinstance(value, list):
                data |= {f"{row['kind']}/{key}/rank{i}": v for i, v in enumerate(value)}
        self._run.log(data, step=row["step"])

    def _log_eval(self, row: dict) -> None:
        """A scoring's ``eval/<task>/<metric>`` values, charted against ``eval/tokens`` (the
        tokens trained on) at the run's step."""
        if not self._eval_axis:
            self._run.define_metric("eval/tokens")
            self._run.define_metric("eval/*", step_metric="eval/tokens")
            self._eval_axis = True
        data = {
            (k if k.startswith("eval/") else f"eval/{k}"): v
            for k, v in row.items()
            if k not in ("kind", "step", "tokens")
            and isinstance(v, int | float)
            and not isinstance(v, bool)
        }
        if isinstance(row.get("tokens"), int):
            data["eval/tokens"] = row["tokens"]
        self._run.log(data, step=row["step"])

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def finish_run(run_dir: Path) -> None:
    """Rank 0, after the last step: plots to ``RUN/plots`` and the health report (printed and
    written to ``RUN/report.txt``). Drawn in a child process
    (``python -m anneal.observe.report RUN``, no torch in it) so that matplotlib's memory never
    adds to the training process's peak, and never fails the run: a problem here is logged."""
    if not is_main_process():
        return
    import subprocess

    import anneal

    root = str(Path(anneal.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    sys.stdout.flush()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "anneal.observe.report", str(run_dir), "--end-of-run"],
            env=env,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            log.warning(
                "plots/health report at the end of the run failed (exit %d)", done.returncode
            )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("plots/health report at the end of the run failed: %s", e)
