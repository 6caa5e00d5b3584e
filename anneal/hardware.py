"""Device peaks: dense bf16 FLOP/s and memory of the GPUs Anneal knows, the measured CPU peak;
the host memory of a process tree (through psutil), and the one probe of a process's peak
memory (``peak_memory_bytes``: the train rows, the forecast check and the export read it).

MFU (``anneal.observe.metrics``), the planner (``anneal.planning``) and the memory estimator
(``anneal.planning.memory``) read their hardware numbers here and nowhere else. docs/planning.md
lists the table and how the CPU peak is measured.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING

from anneal.errors import UserError
from anneal.files import write_atomic

if TYPE_CHECKING:
    import torch

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


# Dense float8 (e4m3) peak by the same fragments, for the float8 layers' matmuls in the
# forecast (anneal.planning.float8_costs); none for the A100 (no float8 units) or a CPU.
GPU_FP8_PEAK_FLOPS = {
    "H200": 1979e12,
    "H100 PCIe": 1513e12,
    "H100 NVL": 1671e12,
    "H100": 1979e12,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """An accelerator the planner and the memory estimator know by a short name."""

    name: str
    peak_flops: float
    """Dense bf16 tensor-core peak in FLOP/s (no sparsity)."""
    memory_bytes: int
    """Device memory in bytes, as nvidia-smi reports it (MiB x 2**20)."""
    fp8_peak_flops: float | None = None
    """Dense float8 tensor-core peak in FLOP/s; None without float8 units."""


GPUS = {
    "h100": GpuSpec(
        name="H100 SXM 80GB",
        peak_flops=GPU_PEAK_FLOPS["H100"],
        memory_bytes=81559 * 2**20,
        fp8_peak_flops=GPU_FP8_PEAK_FLOPS["H100"],
    ),
    "h200": GpuSpec(
        name="H200 SXM 141GB",
        peak_flops=GPU_PEAK_FLOPS["H200"],
        memory_bytes=143771 * 2**20,
        fp8_peak_flops=GPU_FP8_PEAK_FLOPS["H200"],
    ),
    "a100": GpuSpec(
        name="A100 SXM 80GB", peak_flops=GPU_PEAK_FLOPS["A100"], memory_bytes=81920 * 2**20
    ),
}

DEFAULT_GPU = "h100"
"""The short name the planner and the memory estimator assume when no ``--gpu`` is given."""

DEFAULT_MFU = {"cuda": 0.40, "cpu": 0.45}
"""Model FLOPs utilisation assumed, by device type, when none is given or measured (the planner,
the launcher's forecast). GPUs: dense bf16 pretraining on H100s at scale reaches 38-43% (Llama 3
paper, Dubey et al. 2024, table 4); 40% is the round middle. CPUs: the demo of
docs/benchmarks.md ran at 45-55% of the measured fp32 matmul peak."""

GiB = 2**30
"""Bytes in a GiB, the unit of every memory figure Anneal prints."""


def get_gpu(name: str) -> GpuSpec:
    """The GpuSpec for a short name (h100, h200, a100); UserError naming the choices."""
    key = name.lower()
    if key not in GPUS:
        raise UserError(
            f"--gpu {name}: unknown GPU; choose one of {', '.join(GPUS)} (their dense bf16 "
            f"peaks are in anneal/hardware.py). For another accelerator, pass --flops for the "
            f"planner, or --gpu-mem-gib for the memory estimator."
        )
    return GPUS[key]


CPU_PEAK_MAX_AGE_S = 7 * 86400
"""A cached CPU peak older than this is measured again."""
CPU_PEAK_TRIALS = 10
"""Timings of one matmul whose fastest is the CPU peak: the best of several short timings, so
that other work on the machine during some of them does not lower it."""
CPU_PEAK_TRUST = 1.25
"""A cached CPU peak that a quick check (the best of two matmuls) beats by more than this
factor was measured while the machine was busy: it is not trusted, and measured again."""


def _cpu_key() -> str:
    """What the CPU peak depends on: the processor's model name, the core count and the
    process's thread count."""
    import torch

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    model = names[0] if names else platform.processor() or platform.machine()
    return f"{model}-{os.cpu_count()}-{torch.get_num_threads()}"


def _matmul_flops(trials: int, n: int = 1024) -> float:
    """FP32 FLOP/s of the fastest of ``trials`` timings of one n x n matmul."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: the thread pool and the caches
    best_s = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        a @ b
        best_s = min(best_s, time.perf_counter() - start)
    return 2 * n**3 / max(best_s, 1e-9)


def _cached_peak(entry, *, now: float) -> float | None:
    """The FLOP/s of a cache entry ``{"flops": F, "measured_unix": T}`` measured within
    CPU_PEAK_MAX_AGE_S of ``now``; None for an old, malformed or pre-issue-33 (bare number) one."""
    try:
        flops, measured = float(entry["flops"]), float(entry["measured_unix"])
    except (TypeError, KeyError, ValueError):
        return None
    fresh = -60 <= now - measured < CPU_PEAK_MAX_AGE_S  # a clock a minute off still reads it
    return flops if fresh and flops > 0 else None


_PEAK_OF_THIS_PROCESS: dict[tuple[Path, str], float] = {}


def _cpu_peak_flops(cache_dir: Path) -> float:
    """FP32 matmul FLOP/s of this process's share of the CPU: the best of CPU_PEAK_TRIALS
    timings, cached by processor, core count and threads (``_cpu_key``). The cache is trusted
    only while it is fresh (CPU_PEAK_MAX_AGE_S) and a quick check does not beat it by more than
    CPU_PEAK_TRUST (a peak measured on a busy machine is too small, and MFU over it too large);
    else the peak is measured again and the cache rewritten. A process decides once: the runs
    of one process (a scaling sweep) share one peak, so their MFUs compare."""
    key, cache = _cpu_key(), cache_dir / "cpu_peak_flops.json"
    if (cache, key) not in _PEAK_OF_THIS_PROCESS:
        _PEAK_OF_THIS_PROCESS[cache, key] = _cpu_peak_uncached(cache, key)
    return _PEAK_OF_THIS_PROCESS[cache, key]


def _cpu_peak_uncached(cache: Path, key: str) -> float:
    cache_dir = cache.parent
    try:
        cached = json.loads(cache.read_text())
        cached = cached if isinstance(cached, dict) else {}
    except (OSError, ValueError):
        cached = {}
    quick = _matmul_flops(trials=2)
    known = _cached_peak(cached.get(key), now=time.time())
    if known is not None and quick <= CPU_PEAK_TRUST * known:
        return known
    peak = max(quick, _matmul_flops(trials=CPU_PEAK_TRIALS))
    cached[key] = {"flops": peak, "measured_unix": int(time.time())}
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(cache, json.dumps(cached))
    except OSError:
        pass
    return peak


def device_peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of one device, for MFU. CPUs: a measured fp32 matmul rate."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = _by_name(GPU_PEAK_FLOPS, name)
        if peak is None:
            log.warning("no peak FLOP/s known for %s; MFU is reported against the H100's", name)
            return GPU_PEAK_FLOPS["H100"]
        return peak
    return _cpu_peak_flops(cache_dir())


def device_fp8_peak_flops(device: torch.device) -> float | None:
    """Dense float8 peak FLOP/s of one device; None where none is known (a CPU, an A100)."""
    import torch

    if device.type != "cuda":
        return None
    return _by_name(GPU_FP8_PEAK_FLOPS, torch.cuda.get_device_name(device))


def _by_name(peaks: dict[str, float], name: str) -> float | None:
    """The peak of the first fragment of ``peaks`` found in the device's ``name``."""
    return next((peak for fragment, peak in peaks.items() if fragment in name), None)


def cache_dir() -> Path:
    """Anneal's folder of figures measured on this machine (the CPU's peak, the rate a shape
    trained at): ``$XDG_CACHE_HOME/anneal``."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "anneal"


def process_memory_bytes(pid: int | None = None, *, tree: bool = False, pss: bool = False) -> int:
    """Host memory of process ``pid`` (default: this one), in bytes, read by psutil.

    ``tree`` adds every descendant (a prepare's workers, a launcher's ranks). ``pss`` counts
    each shared page once across the processes that share it (Linux's proportional set size),
    so forked workers are not counted twice; elsewhere, and where PSS cannot be read, resident
    memory (RSS). A process that exits while it is read counts 0.
    """
    import psutil

    try:
        top = psutil.Process(pid)
        procs = [top, *top.children(recursive=True)] if tree else [top]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            info = p.memory_full_info() if pss else p.memory_info()
            total += getattr(info, "pss", info.rss)
        except psutil.AccessDenied:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        except psutil.Error:
            pass
    return total


def peak_memory_bytes(device: torch.device | None = None, *, reset: bool = False) -> int:
    """The one memory probe: this process's peak memory in bytes, since it began or since the
    last ``reset`` (which starts the next peak after this read).

    On a CUDA ``device``: the allocator's peak (``torch.cuda.max_memory_allocated``). On the
    host: the peak resident set (Linux's VmHWM; ``reset`` through ``/proc/self/clear_refs``).
    Where ``/proc`` cannot tell: ``getrusage``'s ``ru_maxrss``, which nothing resets. A reset of
    the host's peak also lowers what a parent's ``wait4`` reads of this process, so a training
    process never resets it (``anneal.train.step``)."""
    if device is not None and device.type == "cuda":
        import torch

        peak = torch.cuda.max_memory_allocated(device)
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    peak = _proc_status_bytes("VmHWM")
    if peak is None:
        import resource
        import sys

        scale = 1 if sys.platform == "darwin" else 1024  # KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    if reset:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the resident set
        except OSError:
            pass
    return peak


def _proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes; None where there is no such file."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
