"""The forecast printed before a launch, and the check of it after ``CHECK_AT_STEP`` steps.

Before: per-GPU memory by ``anneal.planning.memory.estimate``, and time per optimizer step and to
the end of the run at an assumed MFU (``--mfu``)::

    step_s = flops_per_token x tokens_per_step / (mfu x peak_flops x world_size)

(under Muon, flops_per_token gains its Newton-Schulz FLOPs per step / tokens_per_step:
``anneal.model.muon.newton_schulz_flops``; under ``train.float8``, the float8 layers' matmuls
run at the device's float8 peak where one is known, at the same MFU, and the MFU printed beside
it is against the bf16 peak, as the anchors report it: ``anneal.planning.float8_costs``)

Time to the end is ``step_s x`` the steps left, plus the in-loop downstream scorings
(``train.eval_tasks``): their forward tokens at a third of the training FLOPs per token (no
backward), at the same MFU::

    eval_s = flops_per_token / 3 x eval_tokens / (mfu x peak_flops x world_size)

Validation and checkpoints are not counted.
The launcher writes it to ``RUN/forecast.json``. After ``CHECK_AT_STEP`` steps rank 0 logs an
``event`` (``"event": "forecast"``) with the measured median step time and peak memory (the
train row's ``mem_max_gib``) next to the forecast, so a job that will not fit its time or memory
shows it in the first minutes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
from pathlib import Path

from anneal.config.ds_schema import degrees
from anneal.hardware import GiB
from anneal.model import ModelPreset, flops_per_token
from anneal.model.muon import step_flops_per_token
from anneal.planning import float8_costs, memory
from anneal.planning.float8_costs import FLOAT8_OFF, Float8Setting

log = logging.getLogger(__name__)

CHECK_AT_STEP = 20
FILE = "forecast.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Forecast:
    memory_bytes_per_gpu: int
    step_s: float
    remaining_steps: int
    mfu: float
    peak_flops: float
    """FLOP/s of one device that the MFU is a fraction of."""
    world_size: int
    eval_tokens: int = 0
    """Forward tokens of the downstream scorings left in the run (``anneal.eval.in_loop``)."""
    eval_s: float = 0.0
    """Their time."""
    device_type: str = "cuda"
    """Where the ranks run: on a CPU the memory is per process, not per GPU."""
    mfu_source: str = ""
    """Where ``mfu`` comes from: "--mfu", a run of the same shape on this machine
    (``anneal.planning.measured_rate``), or "" (assumed: ``anneal.hardware.DEFAULT_MFU``)."""
    float8_step_factor: float = 1.0
    """``step_s`` over what it would be without float8 (``float8_costs.step_time_factor``);
    1 without float8 or without a known float8 peak."""

    @property
    def remaining_s(self) -> float:
        return self.step_s * self.remaining_steps + self.eval_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "remaining_s": self.remaining_s}


def make(
    *,
    preset: ModelPreset,
    ds_config: dict,
    tokens_per_step: int,
    world_size: int,
    max_steps: int,
    start_step: int,
    mfu: float,
    peak_flops: float,
    activation_checkpointing: bool = False,
    eval_tokens: int = 0,
    device_type: str = "cuda",
    mfu_source: str = "",
    float8: Float8Setting = FLOAT8_OFF,
    fp8_peak_flops: float | None = None,
) -> Forecast:
    micro, d = ds_config["train_micro_batch_size_per_gpu"], degrees(ds_config)
    est = memory.estimate(
        preset,
        memory.ZeroSetup.from_ds_config(ds_config),
        memory.Workload(
            micro_batch=micro,
            seq_len=preset.seq_len,
            n_gpus=world_size,
            tp=d.tp,
            sp=d.sp,
            ep=d.ep,
            activation_checkpointing=activation_checkpointing,
            float8=float8,
        ),
    )
    flops = flops_per_token(preset, seq_len=preset.seq_len)
    ns = step_flops_per_token(preset, tokens_per_step=tokens_per_step, ds_config=ds_config)
    per_s = mfu * peak_flops * world_size
    factor = float8_costs.step_time_factor(
        preset,
        float8,
        flops_per_token=flops + ns,
        peak_flops=peak_flops,
        fp8_peak_flops=fp8_peak_flops,
    )
    return Forecast(
        memory_bytes_per_gpu=est.total,
        step_s=(flops + ns) * tokens_per_step / per_s * factor,
        float8_step_factor=factor,
        eval_tokens=eval_tokens,
        eval_s=flops / 3 * eval_tokens / per_s,
        remaining_steps=max(0, max_steps - start_step),
        mfu=mfu,
        peak_flops=peak_flops,
        world_size=world_size,
        device_type=device_type,
        mfu_source=mfu_source,
    )


def format_duration(seconds: float) -> str:
    """A duration for people, the one formatter of them: ``3m07s`` under an hour, ``5h04m``
    under two days, ``14.0 days`` beyond; ``?`` when unknown (not finite or negative)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds >= 48 * 3600:
        return f"{seconds / 86400:,.1f} days"
    h, rest = divmod(int(round(seconds)), 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def describe(f: Forecast) -> str:
    cpu = f.device_type == "cpu"
    where = "per process" if cpu else "per GPU"
    devices = ("process" if f.world_size == 1 else "processes") if cpu else "devices"
    source = f.mfu_source or "assumed, docs/planning.md"
    if cpu and not f.mfu_source:
        source += "; a CPU run keeps its measured rate for the next forecast of its shape"
    return (
        f"forecast: {memory.format_bytes(f.memory_bytes_per_gpu)} {where} "
        f"(anneal/planning/memory.py); "
        f"{f.step_s:.3g} s per step and {format_duration(f.remaining_s)} for the "
        f"{f.remaining_steps} steps left at MFU {f.mfu:.0%} of {f.peak_flops / 1e12:.3g} TFLOP/s "
        f"x {f.world_size} {devices} ({source})"
        + (
            f", of which {format_duration(f.eval_s)} scoring train.eval_tasks (about "
            f"{f.eval_tokens:,} forward tokens)"
            if f.eval_tokens
            else ""
        )
        + (
            f"; float8 layers' matmuls at the float8 peak: {f.float8_step_factor:.2f}x the "
            f"step time, MFU {f.mfu / f.float8_step_factor:.0%} against the bf16 peak"
            if f.float8_step_factor != 1.0
            else ""
        )
        + " (validation and checkpoints not counted)"
    )


class Check:
    """Collects step times; at ``CHECK_AT_STEP`` returns the forecast event's fields."""

    def __init__(self, run_dir: Path, *, start_step: int) -> None:
        path = Path(run_dir) / FILE
        try:
            self.forecast = json.loads(path.read_text())
        except (OSError, ValueError):
            self.forecast = None  # started without the launcher: nothing to compare with
        self.at_step = start_step + CHECK_AT_STEP
        self.step_s: list[float] = []

    def after_step(self, row: dict, tokens_per_step: int) -> dict | None:
        """``row``: a train row. At ``CHECK_AT_STEP``: the event's fields (and the log line);
        else None. Peak memory: the row's, the largest rank's (``anneal.hardware``'s probe:
        the device's peak in this step, the host's since the process began)."""
        if self.forecast is None or row["step"] > self.at_step:
            return None
        self.step_s.append(tokens_per_step / row["tokens_per_s"])
        if row["step"] < self.at_step:
            return None
        measured_s = statistics.median(self.step_s[1:] or self.step_s)  # the first step warms up
        peak, how = round(row["mem_max_gib"] * GiB), "mem_max_gib"
        fields = {
            "step_s": round(measured_s, 6),
            "forecast_step_s": self.forecast["step_s"],
            "step_time_ratio": round(measured_s / self.forecast["step_s"], 3),
            "peak_memory_bytes": peak,
            "peak_memory_source": how,
            "forecast_memory_bytes": self.forecast["memory_bytes_per_gpu"],
            "memory_ratio": round(peak / self.forecast["memory_bytes_per_gpu"], 3),
            "assumed_mfu": self.forecast["mfu"],
        }
        log.info(
            "forecast check at step %d: %.3g s per step (forecast %.3g, x%.2f); peak memory "
            "%s (forecast %s, x%.2f)",
            row["step"],
            measured_s,
            self.forecast["step_s"],
            fields["step_time_ratio"],
            memory.format_bytes(peak),
            memory.format_bytes(self.forecast["memory_bytes_per_gpu"]),
            fields["memory_ratio"],
        )
        return fields
