"""What ``anneal estimate`` reads and prints: the model from a preset name or a config file
(an Anneal run's or a Hugging Face one), the ds_config a run resolved, and the table of the
estimate with its levers. The estimate itself is ``anneal.planning.memory``.
"""

from __future__ import annotations

import json
from pathlib import Path

from anneal.errors import UserError
from anneal.model import PRESETS, ModelPreset, count_params, get_preset, preset_from_dict
from anneal.planning.memory import MemoryEstimate, Workload, ZeroSetup, format_bytes
from anneal.planning.memory_levers import Lever
from anneal.run_record import RunRecord


def load_model(spec: str) -> tuple[ModelPreset, RunRecord | None]:
    """A preset name, or a JSON file: an Anneal run's ``config.json`` (its resolved ``model``),
    a Hugging Face ``config.json``, or a flat object with the preset's fields. The file is read
    once; with the model comes the run's record when it is a run's config.json (the estimate
    then takes the run's ds_config and loss), else None."""
    if spec in PRESETS:
        return get_preset(spec), None
    path = Path(spec)
    if not path.is_file():
        raise UserError(
            f"--model {spec}: neither a preset ({', '.join(PRESETS)}) nor a file. Give a preset "
            f"name, a run's config.json or a Hugging Face config.json."
        )
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"--model {spec}: cannot read it as JSON ({e}).") from None
    record = RunRecord(doc, path) if RunRecord.holds(doc) else None
    preset = preset_from_dict(
        (record and record.model) or (doc if isinstance(doc, dict) else {}),
        source=f"--model {spec}",
        hint="The file must describe a Llama-style model (an Anneal run's config.json or a "
        "Hugging Face config.json).",
        name=path.stem,
    )
    return preset, record


def format_estimate(
    est: MemoryEstimate,
    *,
    preset: ModelPreset,
    zero: ZeroSetup,
    work: Workload,
    capacity_name: str,
    lever_list: list[Lever] = (),
) -> str:
    """The table ``anneal estimate`` prints."""
    p = count_params(preset)
    n = work.n_gpus // work.tp
    precision = "bf16 mixed precision (2+2+12 bytes/param)" if zero.bf16 else "fp32 (4+4+12)"
    offload = [
        k for k, v in (("optimizer", zero.offload_optimizer), ("params", zero.offload_param)) if v
    ]

    loss = (
        f"chunked ({work.loss_chunk_tokens} tokens a chunk)"
        if work.loss == "chunked" and work.tp == 1
        else "plain (full logits)" + (" under TP" if work.tp > 1 else "")
    )

    def row(label: str, value: int, note: str = "") -> str:
        return f"  {label:<36} {format_bytes(value):>12}{'   ' + note if note else ''}"

    sp = f" (sequence-parallel {work.sp}: {work.seq_len // work.sp} a GPU)" if work.sp > 1 else ""
    lines = [
        f"model {preset.name}: {p:,} parameters; "
        + (f"tensor-parallel {work.tp} x " if work.tp > 1 else "")
        + f"ZeRO stage {zero.stage} over {n} GPUs, "
        f"{precision}{'; offload ' + ' and '.join(offload) if offload else ''}",
        f"micro-batch {work.micro_batch} x {work.seq_len} tokens{sp}, activation checkpointing "
        f"{'on' if work.activation_checkpointing else 'off'}, loss {loss}",
        "",
        "per GPU:",
        row("weights", est.params),
        row("gradients", est.grads),
        row("optimizer state", est.optimizer),
        row("= model states", est.model_states, f"({est.model_states * work.n_gpus / p:.3g}P/n)"),
        row("activations", est.activations),
        row("logits and loss", est.logits),
        *(row(f"{k} (fwd/bwd)", v) for k, v in est.buffers.items()),
        *(row(f"{k} (step)", v) for k, v in est.step_buffers.items()),
        row("runtime", est.runtime),
        row("peak", est.total),
    ]
    if est.host_bytes:
        lines.append(row("host memory per GPU (offloaded)", est.host_bytes))
    if est.capacity is not None:
        verdict = "fits" if est.fits else "does NOT fit"
        lines.append(
            f"\n{verdict} in {capacity_name} ({format_bytes(est.capacity)}): "
            f"{100 * est.total / est.capacity:.0f}% used"
        )
    if lever_list:
        lines.append("levers, each alone, in order of preference:")
        for lever in lever_list:
            if lever.setting:
                lines.append(f"  {lever.name:<15} {lever.setting} -> {format_bytes(lever.total)}")
            else:
                lines.append(f"  {lever.name:<15} no: {lever.note}")
        if est.model_states + est.runtime > est.capacity:
            lines.append(
                f"  model states and runtime alone need "
                f"{format_bytes(est.model_states + est.runtime)}: more GPUs "
                f"(ZeRO-3 divides them by n) or offload_optimizer help where micro-batch and "
                f"context cannot."
            )
    return "\n".join(lines)
