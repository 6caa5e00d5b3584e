"""metrics.jsonl, TensorBoard and the console line.

Only rank 0 writes. Every row is flushed as it is written, so a killed run keeps its metrics.
The device peaks that MFU divides by live in ``anneal.hardware``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from anneal.dist import is_main_process, print0
from anneal.hardware import device_peak_flops  # noqa: F401 (anneal/train.py imports it here)

log = logging.getLogger(__name__)

class MetricsLogger:
    """Appends rows to ``metrics.jsonl`` (and TensorBoard under ``tb/``) on rank 0."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True):
        self.enabled = is_main_process()
        self._file = None
        self._tb = None
        if not self.enabled:
            return
        self._file = open(Path(run_dir) / "metrics.jsonl", "a")  # noqa: SIM115
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
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
        if self._tb is not None and row.get("kind") in ("train", "val"):
            for key, value in row.items():
                if key not in ("kind", "step") and isinstance(value, int | float):
                    self._tb.add_scalar(f"{row['kind']}/{key}", value, row["step"])

    def event(self, step: int, event: str, **fields) -> None:
        self.write({"kind": "event", "step": step, "event": event, **fields})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def console_line(row: dict, *, max_steps: int) -> None:
    print0(
        f"step {row['step']:>6}/{max_steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
        f"gnorm {row['grad_norm']:.3f} | {row['tokens_per_s']:,.0f} tok/s | "
        f"mfu {100 * row['mfu']:.2f}%"
    )
