"""metrics.jsonl (written here, and read back by ``read_metrics``), TensorBoard and the
console line.

Only rank 0 writes. Every row is flushed as it is written, so a killed run keeps its metrics
(all but, at worst, a torn last line, which ``read_metrics`` skips). The device peaks that MFU
divides by live in ``anneal.hardware``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from anneal.dist import is_main_process
from anneal.errors import UserError

METRICS_FILE = "metrics.jsonl"

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends rows to ``metrics.jsonl`` (and TensorBoard under ``tb/``) on rank 0."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True):
        self.enabled = is_main_process()
        self._file = None
        self._tb = None
        if not self.enabled:
            return
        self._file = open(Path(run_dir) / METRICS_FILE, "a")  # noqa: SIM115
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
                elif isinstance(value, list):  # one value per rank, e.g. mem_gib
                    for i, v in enumerate(value):
                        self._tb.add_scalar(f"{row['kind']}/{key}/rank{i}", v, row["step"])

    def event(self, step: int, event: str, **fields) -> None:
        self.write({"kind": "event", "step": step, "event": event, **fields})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path, kind: str | None = None) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` in order, only those of ``kind`` if given.

    A killed run can leave its last line torn (no newline, not valid JSON); that line is
    skipped with a warning. Any other line that is not a JSON object is a UserError naming the
    file and line, as is a run directory without the file.
    """
    path = Path(run_dir) / METRICS_FILE
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(
            f"{path}: cannot read it ({e.strerror or e}). Every Anneal run writes "
            f"{METRICS_FILE} into its run directory from its first step on; give the directory "
            f"of a run that has trained (the --out of the recipe)."
        ) from None
    lines = data.split(b"\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif number == len(lines):  # no newline after it: a write cut short by a kill
            log.warning("%s: skipping the torn last line %d (the run was killed)", path, number)
        else:
            start = line[:80].decode(errors="replace")
            raise UserError(
                f"{path}, line {number}: not a JSON object ({start!r}). {METRICS_FILE} "
                f"holds one JSON object per line, as Anneal writes it; the file was changed "
                f"or damaged by something else. Remove that line or rerun."
            )
    return [r for r in rows if kind is None or r.get("kind") == kind]
