"""metrics.jsonl (written here; read back by ``anneal.rundir.read_metrics``, re-exported here),
TensorBoard and the console line.

Only rank 0 writes. Every row is flushed as it is written, so a killed run keeps its metrics
(all but, at worst, a torn last line, which ``read_metrics`` skips). The device peaks that MFU
divides by live in ``anneal.hardware``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from anneal import rundir
from anneal.dist import is_main_process
from anneal.rundir import read_metrics

__all__ = ["MetricsLogger", "Mfu", "read_metrics"]

log = logging.getLogger(__name__)


class Mfu:
    """Model FLOPs utilisation of a train row: ``flops_per_token x tokens_per_s / (peak_flops
    x world_size)``, at most 1. A device does not run above its peak, so a higher ratio means the
    peak is too small (a CPU peak measured while the machine was busy): the row gets 1, and the
    first such step logs a warning saying so. What goes to the console, metrics.jsonl and the
    charts is never over 100%."""

    def __init__(self, *, flops_per_token: float, peak_flops: float, world_size: int):
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.world_size, self.over_peak = world_size, False

    def __call__(self, tokens_per_s: float) -> float:
        ratio = self.flops_per_token * tokens_per_s / (self.peak_flops * self.world_size)
        if ratio > 1 and not self.over_peak:
            self.over_peak = True
            log.warning(
                "training ran at %.0f%% of the peak FLOP/s it is measured against (%.3g per "
                "device, anneal/hardware.py): that peak is too small, so MFU is shown as 100%% "
                "at most. On a CPU, delete the cached peak ($XDG_CACHE_HOME/anneal/"
                "cpu_peak_flops.json) to measure it again.",
                100 * ratio,
                self.peak_flops,
            )
        return min(ratio, 1.0)


class MetricsLogger:
    """Appends rows to ``metrics.jsonl`` (and TensorBoard under ``tb/``) on rank 0."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True):
        self.enabled = is_main_process()
        self._file = None
        self._tb = None
        if not self.enabled:
            return
        self._file = open(rundir.metrics_path(run_dir), "a")  # noqa: SIM115
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(rundir.tb_dir(run_dir)))
            except ImportError:
                log.info("tensorboard is not installed; metrics go to metrics.jsonl only")

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()
        }
        if any(clean[k] is None and row[k] is not None for k in row):
            clean["nonfinite"] = [k for k in row if clean[k] is None and row[k] is not None]
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._tb is not None and row.get("kind") == "eval":
            self._eval_scalars(row)
        if self._tb is not None and row.get("kind") in ("train", "val"):
            for key, value in row.items():
                if key not in ("kind", "step") and isinstance(value, int | float):
                    self._tb.add_scalar(f"{row['kind']}/{key}", value, row["step"])
                elif isinstance(value, list) and not key.startswith("moe_"):  # per rank: mem_gib
                    for i, v in enumerate(value):
                        self._tb.add_scalar(f"{row['kind']}/{key}/rank{i}", v, row["step"])

    def _eval_scalars(self, row: dict) -> None:
        """A scoring's row (``anneal.eval.results.metrics_row``): ``eval/<task>/<metric>`` and
        ``eval/eval_s`` against the tokens trained on (the step where they are unknown)."""
        x = row["tokens"] if isinstance(row.get("tokens"), int) else row["step"]
        for key, value in row.items():
            if key in ("kind", "step", "tokens") or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                self._tb.add_scalar(key if key.startswith("eval/") else f"eval/{key}", value, x)

    def event(self, step: int, event: str, **fields) -> None:
        self.write({"kind": "event", "step": step, "event": event, **fields})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
