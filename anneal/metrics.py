"""metrics.jsonl, TensorBoard, the console line and MFU.

Only rank 0 writes. Every row is flushed as it is written, so a killed run keeps its metrics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import time
from pathlib import Path

import torch

from anneal.dist import is_main_process, print0

log = logging.getLogger(__name__)

# Dense bf16 peak per device in FLOP/s (tensor cores, no sparsity), by a fragment of the name
# torch reports; the first fragment found in the name wins, so variants come before the family.
GPU_PEAK_FLOPS = {
    "H200": 989e12,  # also matches GH200
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    "A100": 312e12,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """An accelerator the planner and the memory estimator know by a short name."""

    name: str
    peak_flops: float
    """Dense bf16 tensor-core peak in FLOP/s (no sparsity)."""
    memory_bytes: int
    """Device memory in bytes, as nvidia-smi reports it (MiB x 2**20)."""


GPUS = {
    "h100": GpuSpec(
        name="H100 SXM 80GB", peak_flops=GPU_PEAK_FLOPS["H100"], memory_bytes=81559 * 2**20
    ),
    "h200": GpuSpec(
        name="H200 SXM 141GB", peak_flops=GPU_PEAK_FLOPS["H200"], memory_bytes=143771 * 2**20
    ),
    "a100": GpuSpec(
        name="A100 SXM 80GB", peak_flops=GPU_PEAK_FLOPS["A100"], memory_bytes=81920 * 2**20
    ),
}


def get_gpu(name: str) -> GpuSpec:
    """The GpuSpec for a short name (h100, h200, a100); ValueError naming the choices."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(
            f"--gpu {name}: unknown GPU; choose one of {', '.join(GPUS)} (their dense bf16 "
            f"peaks are in anneal/metrics.py). For another accelerator, pass --flops for the "
            f"planner, or --gpu-mem-gib for the memory estimator."
        )
    return GPUS[key]


def _cpu_peak_flops(cache_dir: Path) -> float:
    """FP32 matmul FLOP/s of this process's share of the CPU, measured once and cached."""
    key = f"{platform.processor() or platform.machine()}-{os.cpu_count()}-{torch.get_num_threads()}"
    cache = cache_dir / "cpu_peak_flops.json"
    try:
        cached = json.loads(cache.read_text())
        if key in cached:
            return float(cached[key])
    except (OSError, ValueError):
        cached = {}
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.5:
        a @ b
        reps += 1
    peak = 2 * n**3 * reps / (time.perf_counter() - start)
    cached[key] = peak
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached))
        tmp.replace(cache)
    except OSError:
        pass
    return peak


def device_peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of one device, for MFU. CPUs: a measured fp32 matmul rate."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, peak in GPU_PEAK_FLOPS.items():
            if fragment in name:
                return peak
        log.warning("no peak FLOP/s known for %s; MFU is reported against the H100's", name)
        return GPU_PEAK_FLOPS["H100"]
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return _cpu_peak_flops(cache_home / "anneal")


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


def console_line(row: dict, *, max_steps: int) -> None:
    print0(
        f"step {row['step']:>6}/{max_steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
        f"gnorm {row['grad_norm']:.3f} | {row['tokens_per_s']:,.0f} tok/s | "
        f"mfu {100 * row['mfu']:.2f}%"
    )
