"""What ``anneal estimate`` reads and prints: the model from a preset name or a config file
(an Anneal run's or a Hugging Face one), the ds_config a run resolved, and the table of the
estimate with its levers and the compute a token costs. The estimate itself is
``anneal.planning.memory``.

Memory counts a sparse model's *total* parameters (every expert is held somewhere, E / EP of
them on each GPU); compute counts its *active* ones (a token runs through top_k experts):
``flops_per_token`` is ``6 N_active + 12 L H Q T`` (``anneal.model.counts``), the figure MFU
and the forecast use. Beside it the table prints what the same token would cost if it ran
through every expert, to show what sparsity saves.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from anneal.errors import UserError
from anneal.hardware import DEFAULT_MFU, get_gpu
from anneal.model import (
    PRESETS,
    ModelPreset,
    active_params,
    count_params,
    flops_per_token,
    get_preset,
    human_count,
    preset_from_dict,
)
from anneal.model.float8_rule import dense_linear_shapes
from anneal.planning import float8_costs
from anneal.planning.memory import MemoryEstimate, Workload, ZeroSetup, estimate, format_bytes
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


def compute_figures(preset: ModelPreset, work: Workload, *, gpu: str) -> dict:
    """Parameters (total and active) and FLOPs per token (active, and with every expert), and
    the tokens per second per GPU they allow at the assumed MFU of ``gpu``'s peak."""
    flops = flops_per_token(preset, seq_len=work.seq_len)
    every = preset
    if preset.moe is not None:  # the same token through all E experts of each layer
        moe = dataclasses.replace(preset.moe, top_k=preset.moe.num_experts)
        every = dataclasses.replace(preset, moe=moe)
    mfu, peak = DEFAULT_MFU["cuda"], get_gpu(gpu).peak_flops
    return {
        "param_count": count_params(preset),
        "active_params": active_params(preset),
        "flops_per_token": flops,
        "flops_per_token_all_experts": flops_per_token(every, seq_len=work.seq_len),
        "mfu_assumed": mfu,
        "tokens_per_s_per_gpu": mfu * peak / flops,
    }


def format_estimate(
    est: MemoryEstimate,
    *,
    preset: ModelPreset,
    zero: ZeroSetup,
    work: Workload,
    capacity_name: str,
    lever_list: list[Lever] = (),
    gpu: str = "h100",
) -> str:
    """The table ``anneal estimate`` prints."""
    p = count_params(preset)
    n = work.n_gpus // work.tp
    compute = compute_figures(preset, work, gpu=gpu)
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
        f"model {preset.name}: {p:,} parameters{_sparse_label(preset, work, compute)}; "
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
        row("= model states", est.model_state, f"({est.model_state * work.n_gpus / p:.3g}P/n)"),
        row("activations", est.activations),
        row("logits and loss", est.logits),
        *(row(f"{k} (fwd/bwd)", v) for k, v in est.buffers.items()),
        *(row(f"{k} (step)", v) for k, v in est.step_buffers.items()),
        row("runtime", est.runtime),
        row("peak", est.total),
        "",
        _compute_line(compute, preset=preset, gpu=gpu),
    ]
    if est.host_bytes:
        lines.append(row("host memory per GPU (offloaded)", est.host_bytes))
    lines.append(row("host copy per GPU, train.async_save", est.snapshot_bytes, "(if on)"))
    if preset.moe is None:
        fig = float8_figures(preset, zero, work, gpu=gpu)
        lines += _float8_lines(fig, peak=est.total, gpu=gpu)
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
        if est.model_state + est.runtime > est.capacity:
            lines.append(
                f"  model states and runtime alone need "
                f"{format_bytes(est.model_state + est.runtime)}: more GPUs "
                f"(ZeRO-3 divides them by n) or offload_optimizer help where micro-batch and "
                f"context cannot."
            )
    return "\n".join(lines)


def float8_figures(preset: ModelPreset, zero: ZeroSetup, work: Workload, *, gpu: str) -> dict:
    """What ``train.float8`` does to this run (``anneal.planning.float8_costs``): its layers,
    their share of the FLOPs, its memory terms, the step at ``gpu``'s float8 peak (MFU still
    against the bf16 peak), and the estimate's peak with float8 switched (on: off; off:
    tensorwise) and, with float8 on, with ``train.compile`` switched."""
    f8, spec = work.float8, get_gpu(gpu)
    flops = flops_per_token(preset, seq_len=work.seq_len)
    shown = f8 if f8.on else dataclasses.replace(f8, recipe="tensorwise")
    layers = float8_costs.converted_linears(preset, shown)
    factor = float8_costs.step_time_factor(
        preset,
        shown,
        flops_per_token=flops,
        peak_flops=spec.peak_flops,
        fp8_peak_flops=spec.fp8_peak_flops,
    )

    def peak_with(setting) -> int:
        return estimate(preset, zero, dataclasses.replace(work, float8=setting)).total

    switched = {"float8": "off" if f8.on else "tensorwise"}
    switched["peak_bytes"] = peak_with(dataclasses.replace(f8, recipe=switched["float8"]))
    out = {
        "recipe": f8.recipe,
        "layers": f8.layers,
        "compiled": f8.compiled,
        "figures_for": shown.recipe,
        "converted_layers": len(layers),
        "linear_layers": len(dense_linear_shapes(preset)) if preset.moe is None else 0,
        "flops_share": float8_costs.float8_flops_per_token(preset, shown) / flops,
        "step_time_factor": factor,
        "fp8_peak_flops": spec.fp8_peak_flops,
        "mfu_against_bf16_peak": DEFAULT_MFU["cuda"] / factor,
        "switched": switched,
    }
    if f8.on:
        compiled = dataclasses.replace(f8, compiled=not f8.compiled)
        out["compile_switched"] = {"compiled": compiled.compiled, "peak_bytes": peak_with(compiled)}
    return out


def _float8_lines(fig: dict, *, peak: int, gpu: str) -> list[str]:
    """``anneal estimate``'s float8 lines: the chosen setting, then the levers."""
    what = (
        f"{fig['converted_layers']} of {fig['linear_layers']} Linear layers "
        f"({fig['flops_share']:.0%} of the FLOPs per token)"
    )
    step = (
        f"at the {gpu.upper()}'s float8 peak ({fig['fp8_peak_flops'] / 1e12:,.0f} TFLOP/s) "
        f"{fig['step_time_factor']:.2f}x the step time, MFU {fig['mfu_against_bf16_peak']:.0%} "
        "against the bf16 peak (an upper bound: the casts take time too)"
        if fig["fp8_peak_flops"]
        else f"no float8 peak known for the {gpu.upper()}: step time unchanged"
    )
    switched = fig["switched"]
    delta = switched["peak_bytes"] - peak
    lines = ["float8 (docs/throughput.md):"]
    if fig["recipe"] != "off":
        how = "compiled" if fig["compiled"] else "eager: casts unfused"
        lines.append(f"  train.float8={fig['recipe']} ({how}): {what}; {step}")
    lines.append(
        f"  lever train.float8={switched['float8']}: peak {format_bytes(switched['peak_bytes'])}"
        f" ({'+' if delta >= 0 else '-'}{format_bytes(abs(delta))})"
        + (f"; {what}; {step}" if fig["recipe"] == "off" else "; step time as without float8")
    )
    if "compile_switched" in fig:
        other = fig["compile_switched"]
        lines.append(
            f"  lever train.compile={'torch' if other['compiled'] else 'off'}: float8's casts "
            f"{'fused' if other['compiled'] else 'unfused'}, peak "
            f"{format_bytes(other['peak_bytes'])}; its speed is not counted here"
        )
    return lines


def _compute_line(compute: dict, *, preset: ModelPreset, gpu: str) -> str:
    every = ""
    if preset.moe is not None:
        every = f" (through all experts: {compute['flops_per_token_all_experts']:.3g})"
    return (
        f"compute: {compute['flops_per_token']:.3g} FLOPs per token{every}; "
        f"{compute['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU at MFU "
        f"{compute['mfu_assumed']:.0%} of the {gpu.upper()}'s peak"
    )


def _sparse_label(preset: ModelPreset, work: Workload, compute: dict) -> str:
    """How a sparse model's experts lie on the GPUs ("" for a dense model)."""
    moe = preset.moe
    if moe is None:
        return ""
    return (
        f" ({human_count(compute['active_params'])} active: top-{moe.top_k} of "
        f"{moe.num_experts} experts; expert-parallel {work.ep}: {moe.num_experts // work.ep} "
        f"experts of each layer a GPU, their ZeRO states over {work.n_gpus // work.ep} GPUs)"
    )
