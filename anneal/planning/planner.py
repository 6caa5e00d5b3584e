"""The compute-optimal planner behind ``anneal plan``: for one budget (FLOPs, GPU-hours,
parameters, tokens or a target loss), N and D on a fit's frontier or by a tokens-per-parameter
rule, the predicted loss, the nearest preset, optimizer steps and GPU-hours.

The law and its fits are in ``anneal.planning.law``; docs/planning.md has the formulas.
"""

from __future__ import annotations

import dataclasses
import math

from anneal.errors import UserError
from anneal.hardware import DEFAULT_GPU, DEFAULT_MFU, get_gpu
from anneal.planning import sparse
from anneal.planning.forecast import format_duration
from anneal.planning.law import DEFAULT_FIT, FITS, ChinchillaFit

DEFAULT_GLOBAL_BATCH = 512
"""Sequences per optimizer step when planning steps (x the sequence length: 1M tokens at
2048, between GPT-3's 0.5M for its small models and Chinchilla's 1.5-3M)."""
PREPARE_TOKENS_PER_CORE_S = 1_910_000.0
"""Tokens per second per core of ``anneal data prepare``'s tokenize+pack in one task of a
preparation in tasks (the median task of bench/bench_prepare_tasks.py, 2026-12-03: 1.91M, one
node's 1.98M; docs/benchmarks.md), for SentencePiece BPE of 8192 pieces on Python source on a
shared 2-core machine; a larger vocabulary, another tokenizer or other text changes it. The
plan's node-hours leave out the merge, one node's I/O (docs/data.md)."""
PREPARE_NODE_CORES = 128
"""Cores of the node in the node-hours of preparation (a common CPU node: 2 x 64 cores)."""


def parse_rule(text: str) -> float:
    """``tokens-per-param=R`` -> R (a positive number of training tokens per parameter)."""
    key, sep, value = text.partition("=")
    try:
        ratio = float(value)
    except ValueError:
        ratio = float("nan")
    if key != "tokens-per-param" or not sep or not (math.isfinite(ratio) and ratio > 0):
        raise UserError(
            f"--rule {text}: rules look like tokens-per-param=R with R > 0, e.g. "
            f"tokens-per-param=20 (Chinchilla's rule of thumb)."
        )
    return ratio


PLAN_RANGES = {"--params": (1e3, 1e14), "--tokens": (1e3, 1e16), "--flops": (1e9, 1e30)}
"""The budgets a plan answers, (low, high): below, no transformer (1e3 parameters) or not one
batch (1e3 tokens); above, 50x the largest model trained, 600x the largest corpus (Llama 3's
15T tokens) and 10,000x the largest run's compute (about 1e26) reported so far. A value outside
is a typo (``1e60``, ``1e-30``), refused with the range rather than answered with nonsense."""


def _in_range(flag: str, value: float | None) -> None:
    low, high = PLAN_RANGES[flag]
    if value is not None and not low <= value <= high:
        raise UserError(
            f"{flag} {value:g}: outside what a plan can answer ({low:g} to {high:g}); a typo in "
            f"the exponent? E.g. --params 7e9 is a 7B model, --tokens 2e12 two trillion tokens."
        )


def _positive(flag: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UserError(f"{flag} {value}: must be a positive, finite number.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputePlan:
    """What to train for a budget, and what it costs. FLOPs are ``6 N D`` throughout."""

    params: float
    tokens: float
    flops: float
    loss: float
    """Predicted final loss in nats per token under ``fit``."""
    fit: ChinchillaFit
    basis: str
    """How N and D were chosen: the fit's compute-optimal frontier, or a tokens-per-param rule."""
    preset: str
    preset_params: int
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    gpu: str
    gpu_peak_flops: float
    mfu: float
    mfu_source: str
    gpus: int | None
    total_params: int | None = None
    """All parameters of a sparse ``--model`` (what memory holds); ``params`` is then its active
    count (``anneal.planning.sparse``). None otherwise."""

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params

    @property
    def steps(self) -> int:
        return math.ceil(self.tokens / (self.global_batch * self.seq_len))

    @property
    def gpu_hours(self) -> float:
        return self.flops / (self.gpu_peak_flops * self.mfu) / 3600

    @property
    def prepare_node_hours(self) -> float:
        """Node-hours of ``anneal data prepare`` for the planned tokens (docs/data.md,
        "Preparing tens of terabytes"), at the measured rate per core."""
        return self.tokens / (PREPARE_TOKENS_PER_CORE_S * PREPARE_NODE_CORES) / 3600

    @property
    def wall_clock_hours(self) -> float | None:
        return self.gpu_hours / self.gpus if self.gpus else None

    def to_dict(self) -> dict:
        return {
            "params": self.params,
            "tokens": self.tokens,
            "flops": self.flops,
            "loss": self.loss,
            "tokens_per_param": self.tokens_per_param,
            "basis": self.basis,
            "fit": self.fit.to_dict(),
            "preset": self.preset,
            "preset_params": self.preset_params,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "steps": self.steps,
            "gpu": self.gpu,
            "gpu_peak_flops": self.gpu_peak_flops,
            "mfu": self.mfu,
            "mfu_source": self.mfu_source,
            "gpus": self.gpus,
            "gpu_hours": self.gpu_hours,
            "wall_clock_hours": self.wall_clock_hours,
            "prepare_node_hours": self.prepare_node_hours,
            "total_params": self.total_params,
        }


def nearest_preset(params: float) -> tuple[str, int]:
    """The dense preset whose parameter count (at its nominal vocabulary) is closest in log
    scale (the law is a dense model's: a sparse preset is never the nearest)."""
    from anneal.model import PRESETS, count_params

    counts = {name: count_params(p) for name, p in PRESETS.items() if not p.is_moe}
    name = min(counts, key=lambda k: abs(math.log(counts[k] / params)))
    return name, counts[name]


def _solve_log(f, lo: float, hi: float) -> float:
    """x in [lo, hi] with f(x) = 0 for f increasing in x, by bisection on log x."""
    from scipy.optimize import brentq

    return math.exp(brentq(lambda u: f(math.exp(u)), math.log(lo), math.log(hi), xtol=1e-12))


def plan(
    *,
    flops: float | None = None,
    params: float | None = None,
    tokens: float | None = None,
    target_loss: float | None = None,
    gpus: int | None = None,
    hours: float | None = None,
    gpu: str = DEFAULT_GPU,
    mfu: float | None = None,
    mfu_source: str | None = None,
    fit: ChinchillaFit | None = None,
    tokens_per_param: float | None = None,
    global_batch: int = DEFAULT_GLOBAL_BATCH,
    seq_len: int | None = None,
    model: str | None = None,
) -> ComputePlan:
    """N and D for exactly one budget: ``flops``, ``gpus`` x ``hours`` (at ``mfu`` of the
    ``gpu``'s peak), ``params``, ``tokens``, ``target_loss`` or ``model`` (a preset, whose N is
    its active parameters: ``anneal.planning.sparse``).

    Without ``tokens_per_param`` N and D sit on ``fit``'s compute-optimal frontier; with it,
    D = R N (Chinchilla's rule of thumb is R = 20) and ``fit`` only predicts the loss.
    """
    from anneal.model import get_preset

    fit = fit or FITS[DEFAULT_FIT]
    spec = get_gpu(gpu)
    _check_inputs(
        flops=flops,
        params=params,
        tokens=tokens,
        gpus=gpus,
        hours=hours,
        mfu=mfu,
        tokens_per_param=tokens_per_param,
        global_batch=global_batch,
        seq_len=seq_len,
    )
    mfu_source = mfu_source or ("--mfu" if mfu is not None else "assumed (docs/planning.md)")
    mfu = mfu if mfu is not None else DEFAULT_MFU["cuda"]
    if hours is not None:
        if flops is not None:
            raise UserError(
                "--flops and --gpus/--hours both set a compute budget; give one of them."
            )
        flops = gpus * hours * 3600 * spec.peak_flops * mfu
    _check_one_budget(
        flops=flops, params=params, tokens=tokens, target_loss=target_loss, model=model
    )
    chosen = sparse.planned_model(model) if model is not None else None
    params = chosen.params if chosen else params
    budget = dict(flops=flops, params=params, tokens=tokens, target_loss=target_loss)
    if tokens_per_param is not None:
        params, tokens, basis = _by_rule(fit, tokens_per_param, **budget)
    else:
        params, tokens, basis = _on_frontier(fit, **budget)
    preset, preset_params = (chosen.name, chosen.params) if chosen else nearest_preset(params)
    return ComputePlan(
        params=params,
        tokens=tokens,
        flops=6 * params * tokens,
        loss=fit.loss(params, tokens),
        fit=fit,
        basis=basis,
        preset=preset,
        preset_params=preset_params,
        seq_len=seq_len or get_preset(preset).seq_len,
        global_batch=global_batch,
        gpu=gpu.lower(),
        gpu_peak_flops=spec.peak_flops,
        mfu=mfu,
        mfu_source=mfu_source,
        gpus=gpus,
        total_params=chosen.total if chosen and chosen.total != chosen.params else None,
    )


def _check_inputs(
    *,
    flops: float | None,
    params: float | None,
    tokens: float | None,
    gpus: int | None,
    hours: float | None,
    mfu: float | None,
    tokens_per_param: float | None,
    global_batch: int,
    seq_len: int | None,
) -> None:
    """Each of ``plan``'s numbers on its own: positive, whole where it counts things, MFU a
    fraction, and hours only with GPUs to multiply them by."""
    for flag, value in (
        ("--flops", flops),
        ("--params", params),
        ("--tokens", tokens),
        ("--hours", hours),
        ("--mfu", mfu),
        ("--rule tokens-per-param", tokens_per_param),
    ):
        _positive(flag, value)
    for flag, value in (("--flops", flops), ("--params", params), ("--tokens", tokens)):
        _in_range(flag, value)
    if gpus is not None and (isinstance(gpus, bool) or int(gpus) != gpus or gpus < 1):
        raise UserError(f"--gpus {gpus}: must be a whole number of GPUs, at least 1.")
    if mfu is not None and mfu > 1:
        raise UserError(f"--mfu {mfu}: MFU is a fraction of peak in (0, 1]; 40% is --mfu 0.4.")
    if global_batch < 1 or (seq_len is not None and seq_len < 1):
        raise UserError(
            f"--global-batch {global_batch} / --seq-len {seq_len}: both must be at least 1."
        )
    if hours is not None and gpus is None:
        raise UserError(f"--hours {hours}: give --gpus too (the budget is GPUs x hours).")


def _check_one_budget(
    *,
    flops: float | None,
    params: float | None,
    tokens: float | None,
    target_loss: float | None,
    model: str | None = None,
) -> None:
    """A plan answers one question: the budgets would otherwise disagree with each other."""
    given = {
        k: v
        for k, v in (
            ("--flops (or --gpus with --hours)", flops),
            ("--params", params),
            ("--tokens", tokens),
            ("--target-loss", target_loss),
            ("--model", model),
        )
        if v is not None
    }
    if len(given) != 1:
        raise UserError(
            f"anneal plan needs exactly one budget, got "
            f"{', '.join(given) if given else 'none'}: give --flops C, or --gpus G --hours H, "
            f"or --params N, or --tokens D, or --target-loss L, or --model PRESET."
        )


def _by_rule(
    fit: ChinchillaFit,
    r: float,
    *,
    flops: float | None,
    params: float | None,
    tokens: float | None,
    target_loss: float | None,
) -> tuple[float, float, str]:
    """(N, D, basis) with D = r N, from the one budget given; ``fit`` only predicts the loss
    (and tells whether a target loss is reachable)."""
    basis = f"rule: {r:g} tokens per parameter"
    if flops is not None:
        params = math.sqrt(flops / (6 * r))
    elif tokens is not None:
        params = tokens / r
    elif target_loss is not None:
        fit.check_reachable(target_loss)
        if fit.loss(1e30, r * 1e30) >= target_loss:
            raise UserError(
                f"--target-loss {target_loss}: so close to E = {fit.E:.4f} that even 1e30 "
                f"parameters at {r:g} tokens each do not reach it; ask for a higher loss."
            )
        params = _solve_log(lambda n: target_loss - fit.loss(n, r * n), 1.0, 1e30)
    return params, r * params, basis


def _on_frontier(
    fit: ChinchillaFit,
    *,
    flops: float | None,
    params: float | None,
    tokens: float | None,
    target_loss: float | None,
) -> tuple[float, float, str]:
    """(N, D, basis) on ``fit``'s compute-optimal frontier, from the one budget given."""
    basis = f"compute-optimal under the {fit.name} fit"
    if flops is not None:
        params, tokens = fit.optimal_params(flops), fit.optimal_tokens(flops)
    elif tokens is not None:
        # C/6 = N D with D*(C) = (C/6)**b / G inverted: C/6 = (D G)**(1/b).
        params = (tokens * fit.G) ** (1 / fit.b) / tokens
    else:
        if target_loss is not None:
            params = fit.frontier_params_for_loss(target_loss)
        # C/6 = N D with N*(C) = G (C/6)**a inverted: C/6 = (N / G)**(1/a).
        tokens = (params / fit.G) ** (1 / fit.a) / params
    return params, tokens, basis


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_plan(p: ComputePlan) -> str:
    """The human-readable plan that ``anneal plan`` prints."""
    gpu_hours = f"{p.gpu_hours:,.0f}" if p.gpu_hours >= 10 else f"{p.gpu_hours:.3g}"
    lines = [
        f"plan: {p.basis}",
        f"  fit            {p.fit.name}: E {p.fit.E:g}, A {p.fit.A:g}, B {p.fit.B:g}, "
        f"alpha {p.fit.alpha:g}, beta {p.fit.beta:g} ({p.fit.source})",
        f"  compute        {p.flops:.3e} FLOPs (6 N D)",
        f"  parameters     N = {_si(p.params)} ({p.params:.4g})",
        f"  tokens         D = {_si(p.tokens)} ({p.tokens:.4g}), "
        f"{p.tokens_per_param:.1f} tokens per parameter",
        f"  predicted loss {p.loss:.4f} nats/token",
        f"  nearest preset {p.preset} ({_si(p.preset_params)} parameters, "
        f"x{p.preset_params / p.params:.2g} of N)"
        if p.total_params is None
        else f"  sparse model   {p.preset}: N is its {_si(p.params)} active parameters of "
        f"{_si(p.total_params)} (see below)",
        f"  steps          {p.steps:,} at a global batch of {p.global_batch} x {p.seq_len} tokens",
        f"  GPU-hours      {gpu_hours} on {p.gpu.upper()} at MFU {100 * p.mfu:.1f}% "
        f"({p.mfu_source}; peak {p.gpu_peak_flops / 1e12:g} TFLOP/s)",
    ]
    if p.wall_clock_hours is not None:
        wall = format_duration(p.wall_clock_hours * 3600)
        lines.append(f"  wall-clock     {wall} on {p.gpus} GPUs")
    hours = p.prepare_node_hours
    lines.append(
        f"  data prep      {f'{hours:,.0f}' if hours >= 10 else f'{hours:.2g}'} node-hours of "
        f"`anneal data prepare` on {PREPARE_NODE_CORES}-core nodes, at "
        f"{PREPARE_TOKENS_PER_CORE_S:,.0f} tokens/s per core (measured: docs/data.md)"
    )
    if p.total_params is not None:
        lines.append(sparse.NOTE.format(name=p.preset))
    return "\n".join(lines)
