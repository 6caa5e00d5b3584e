"""Chinchilla scaling laws: compute-optimal planning and fitting a user's own sweep.

The law (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", eq. 2)::

    L(N, D) = E + A / N**alpha + B / D**beta

with N parameters, D training tokens and L the loss in nats per token. Training compute is
``C = 6 N D`` FLOPs (Kaplan et al. 2020), and minimising L on that constraint gives (eq. 4)::

    N*(C) = G (C/6)**a,   D*(C) = (C/6)**b / G,
    G = (alpha A / (beta B))**(1/(alpha+beta)),  a = beta/(alpha+beta),  b = alpha/(alpha+beta).

On that frontier ``alpha A / N**alpha = beta B / D**beta``, so a target loss L gives N* in
closed form: ``N* = (A (1 + alpha/beta) / (L - E))**(1/alpha)``.

Two published fits ship: Hoffmann's approach 3 and the Epoch AI replication (Besiroglu et al.
2024, "Chinchilla Scaling: A replication attempt"), which refitted the same data and found the
published approach-3 constants inconsistent with approaches 1 and 2 (about 70 tokens per
parameter at Chinchilla's compute instead of 20). The replication is the default.

``fit_points`` fits the law to a user's runs the way Hoffmann did: Huber loss (delta 1e-3) on
log-loss residuals, L-BFGS from a grid of starting points, plus bootstrap confidence intervals.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

FIT_FORMAT = "anneal-chinchilla-fit"
FIT_VERSION = 1
PARAM_NAMES = ("E", "A", "B", "alpha", "beta")

DEFAULT_MFU = 0.40
"""MFU assumed when none is given or measured: dense bf16 pretraining on H100s at scale
reaches 38-43% (Llama 3 paper, Dubey et al. 2024, table 4); 40% is the round middle."""

DEFAULT_GLOBAL_BATCH = 512
"""Sequences per optimizer step when planning steps (x the sequence length: 1M tokens at
2048, between GPT-3's 0.5M for its small models and Chinchilla's 1.5-3M)."""


# ---------------------------------------------------------------------------------------------
# The law and its published fits.


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChinchillaFit:
    """``L(N, D) = E + A/N**alpha + B/D**beta``: N parameters, D tokens, L nats per token."""

    E: float
    """Irreducible loss in nats per token: no model size or data reaches below it."""
    A: float
    B: float
    alpha: float
    beta: float
    name: str
    source: str
    """Where the constants come from (a paper or a fit file)."""
    ci95: tuple[tuple[str, float, float], ...] = ()
    """Bootstrap 95% intervals as (parameter, low, high), for fits made by ``anneal fit``."""

    def __post_init__(self) -> None:
        bad = [
            k for k in PARAM_NAMES if not (math.isfinite(getattr(self, k)) and getattr(self, k) > 0)
        ]
        if bad:
            raise ValueError(
                f"fit {self.name!r} ({self.source}): {', '.join(bad)} must be positive and "
                f"finite, got {', '.join(f'{k}={getattr(self, k)}' for k in bad)}. A fit "
                f"with a non-positive exponent has no compute-optimal frontier; it usually "
                f"means the runs span too little of N or D. Add runs of more sizes and token "
                f"budgets and fit again."
            )

    @property
    def a(self) -> float:
        """Exponent of N* in C: ``beta / (alpha + beta)``."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of D* in C: ``alpha / (alpha + beta)``."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:  # noqa: N802 (the paper's name)
        return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

    def loss(self, params: float, tokens: float) -> float:
        """Predicted loss in nats per token of N = ``params`` trained on D = ``tokens``."""
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta

    def optimal_params(self, flops: float) -> float:
        """Compute-optimal N for C = ``flops``: ``G (C/6)**a``."""
        return self.G * (flops / 6) ** self.a

    def optimal_tokens(self, flops: float) -> float:
        """Compute-optimal D for C = ``flops``: ``(C/6)**b / G`` (so that 6 N* D* = C)."""
        return (flops / 6) ** self.b / self.G

    def frontier_params_for_loss(self, loss: float) -> float:
        """N on the compute-optimal frontier where the predicted loss is ``loss``."""
        self.check_reachable(loss)
        return (self.A * (1 + self.alpha / self.beta) / (loss - self.E)) ** (1 / self.alpha)

    def check_reachable(self, loss: float) -> None:
        if not math.isfinite(loss) or loss <= self.E:
            raise ValueError(
                f"--target-loss {loss}: impossible under the {self.name} fit, whose "
                f"irreducible loss is E = {self.E:.4f} nats/token; no model size or amount "
                f"of data reaches it. Ask for a loss above {self.E:.4f}."
            )

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in PARAM_NAMES}
        out.update(name=self.name, source=self.source)
        if self.ci95:
            out["ci95"] = {k: [lo, hi] for k, lo, hi in self.ci95}
        return out


FITS: dict[str, ChinchillaFit] = {
    "hoffmann": ChinchillaFit(
        E=1.69,
        A=406.4,
        B=410.7,
        alpha=0.34,
        beta=0.28,
        name="hoffmann",
        source="Hoffmann et al. 2022, approach 3 (eq. 10)",
    ),
    "epoch": ChinchillaFit(
        E=1.8169,
        A=482.01,
        B=2085.43,
        alpha=0.3478,
        beta=0.3659,
        name="epoch",
        source="Besiroglu et al. 2024 (Epoch AI), replication of approach 3",
    ),
}
DEFAULT_FIT = "epoch"


def load_fit(name_or_path: str | Path) -> ChinchillaFit:
    """A shipped fit by name (``epoch``, ``hoffmann``) or a fit file written by ``anneal fit``."""
    if str(name_or_path) in FITS:
        return FITS[str(name_or_path)]
    path = Path(name_or_path)
    where = f"--fit {name_or_path}"
    if not path.is_file():
        raise ValueError(
            f"{where}: neither a shipped fit ({', '.join(FITS)}) nor a file. Pass a fit name "
            f"or the JSON that `anneal fit` writes."
        )
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{where}: not a fit file (cannot read it as JSON: {e}). Fit files are the JSON "
            f"that `anneal fit` writes."
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FIT_FORMAT:
        raise ValueError(
            f'{where}: not a fit file (it has no "format": "{FIT_FORMAT}"). Fit files are '
            f"the JSON that `anneal fit` writes; shipped fits are named {', '.join(FITS)}."
        )
    if doc.get("version") != FIT_VERSION:
        raise ValueError(
            f"{where}: fit file version {doc.get('version')!r}; this Anneal reads version "
            f"{FIT_VERSION}. Refit with `anneal fit`."
        )
    values = {}
    for k in PARAM_NAMES:
        v = doc.get("fit", {}).get(k) if isinstance(doc.get("fit"), dict) else None
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise ValueError(
                f"{where}: fit file lacks a number for fit.{k}; it needs E, A, B, alpha and "
                f"beta. Refit with `anneal fit`."
            )
        values[k] = float(v)
    ci = doc.get("ci95") or {}
    return ChinchillaFit(
        **values,
        name=path.name,
        source=f"{path} ({len(doc.get('points', []))} runs)",
        ci95=tuple((k, float(ci[k][0]), float(ci[k][1])) for k in PARAM_NAMES if k in ci),
    )


# ---------------------------------------------------------------------------------------------
# Planning.


def parse_rule(text: str) -> float:
    """``tokens-per-param=R`` -> R (a positive number of training tokens per parameter)."""
    key, sep, value = text.partition("=")
    try:
        ratio = float(value)
    except ValueError:
        ratio = float("nan")
    if key != "tokens-per-param" or not sep or not (math.isfinite(ratio) and ratio > 0):
        raise ValueError(
            f"--rule {text}: rules look like tokens-per-param=R with R > 0, e.g. "
            f"tokens-per-param=20 (Chinchilla's rule of thumb)."
        )
    return ratio


def _positive(flag: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} {value}: must be a positive, finite number.")


def mfu_from_run(run_dir: str | Path) -> tuple[float, str]:
    """Median MFU of a run's train rows (the first 10% of steps skipped as warm-up)."""
    from anneal.errors import UserError
    from anneal.metrics import read_metrics

    try:
        train = read_metrics(run_dir, "train")
    except UserError as e:
        raise UserError(f"--mfu-from {run_dir}: {e} Or give --mfu M.") from None
    mfus = [r["mfu"] for r in train if r.get("mfu") is not None]
    if not mfus:
        raise ValueError(
            f"--mfu-from {run_dir}: its metrics.jsonl has no train rows with an mfu value; give "
            f"a run that trained at least one step, or --mfu M."
        )
    device = "?"
    cfg = Path(run_dir) / "config.json"
    if cfg.is_file():
        device = json.loads(cfg.read_text()).get("launch", {}).get("device", "?")
    kept = mfus[len(mfus) // 10 :] or mfus
    return statistics.median(kept), f"median over {len(kept)} steps of {run_dir} ({device})"


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
        }


def nearest_preset(params: float) -> tuple[str, int]:
    """The preset whose parameter count (at its nominal vocabulary) is closest in log scale."""
    from anneal.model import PRESETS, count_params

    counts = {name: count_params(p) for name, p in PRESETS.items()}
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
    gpu: str = "h100",
    mfu: float | None = None,
    mfu_source: str | None = None,
    fit: ChinchillaFit | None = None,
    tokens_per_param: float | None = None,
    global_batch: int = DEFAULT_GLOBAL_BATCH,
    seq_len: int | None = None,
) -> ComputePlan:
    """N and D for exactly one budget: ``flops``, ``gpus`` x ``hours`` (at ``mfu`` of the
    ``gpu``'s peak), ``params``, ``tokens`` or ``target_loss``.

    Without ``tokens_per_param`` N and D sit on ``fit``'s compute-optimal frontier; with it,
    D = R N (Chinchilla's rule of thumb is R = 20) and ``fit`` only predicts the loss.
    """
    from anneal.hardware import get_gpu
    from anneal.model import get_preset

    fit = fit or FITS[DEFAULT_FIT]
    spec = get_gpu(gpu)
    for flag, value in (
        ("--flops", flops),
        ("--params", params),
        ("--tokens", tokens),
        ("--hours", hours),
        ("--mfu", mfu),
        ("--rule tokens-per-param", tokens_per_param),
    ):
        _positive(flag, value)
    if gpus is not None and (isinstance(gpus, bool) or int(gpus) != gpus or gpus < 1):
        raise ValueError(f"--gpus {gpus}: must be a whole number of GPUs, at least 1.")
    if mfu is not None and mfu > 1:
        raise ValueError(f"--mfu {mfu}: MFU is a fraction of peak in (0, 1]; 40% is --mfu 0.4.")
    if global_batch < 1 or (seq_len is not None and seq_len < 1):
        raise ValueError(
            f"--global-batch {global_batch} / --seq-len {seq_len}: both must be at least 1."
        )
    if hours is not None and gpus is None:
        raise ValueError(f"--hours {hours}: give --gpus too (the budget is GPUs x hours).")
    mfu_source = mfu_source or ("--mfu" if mfu is not None else "assumed (docs/planning.md)")
    mfu = mfu if mfu is not None else DEFAULT_MFU
    if hours is not None:
        flops_budget = gpus * hours * 3600 * spec.peak_flops * mfu
        if flops is not None:
            raise ValueError(
                "--flops and --gpus/--hours both set a compute budget; give one of them."
            )
        flops = flops_budget
    given = {
        k: v
        for k, v in (
            ("--flops (or --gpus with --hours)", flops),
            ("--params", params),
            ("--tokens", tokens),
            ("--target-loss", target_loss),
        )
        if v is not None
    }
    if len(given) != 1:
        raise ValueError(
            f"anneal plan needs exactly one budget, got "
            f"{', '.join(given) if given else 'none'}: give --flops C, or --gpus G --hours H, "
            f"or --params N, or --tokens D, or --target-loss L."
        )

    r = tokens_per_param
    if r is not None:
        basis = f"rule: {r:g} tokens per parameter"
        if flops is not None:
            params = math.sqrt(flops / (6 * r))
        elif tokens is not None:
            params = tokens / r
        elif target_loss is not None:
            fit.check_reachable(target_loss)
            if fit.loss(1e30, r * 1e30) >= target_loss:
                raise ValueError(
                    f"--target-loss {target_loss}: so close to E = {fit.E:.4f} that even 1e30 "
                    f"parameters at {r:g} tokens each do not reach it; ask for a higher loss."
                )
            params = _solve_log(lambda n: target_loss - fit.loss(n, r * n), 1.0, 1e30)
        tokens = r * params
    else:
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
    flops = 6 * params * tokens
    preset, preset_params = nearest_preset(params)
    return ComputePlan(
        params=params,
        tokens=tokens,
        flops=flops,
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
    )


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _duration(hours: float) -> str:
    if hours >= 48:
        return f"{hours / 24:,.1f} days"
    if hours >= 1:
        return f"{hours:,.1f} hours"
    return f"{hours * 60:,.1f} minutes"


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
        f"x{p.preset_params / p.params:.2g} of N)",
        f"  steps          {p.steps:,} at a global batch of {p.global_batch} x {p.seq_len} tokens",
        f"  GPU-hours      {gpu_hours} on {p.gpu.upper()} at MFU {100 * p.mfu:.1f}% "
        f"({p.mfu_source}; peak {p.gpu_peak_flops / 1e12:g} TFLOP/s)",
    ]
    if p.wall_clock_hours is not None:
        lines.append(f"  wall-clock     {_duration(p.wall_clock_hours)} on {p.gpus} GPUs")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Fitting: Hoffmann et al. 2022, section 3.3 and appendix D.2.

HUBER_DELTA = 1e-3
# Hoffmann's initialisation grid (appendix D.2) over (alpha, beta, e, a, b), with E = exp(e),
# A = exp(a), B = exp(b): 5 x 5 x 5 x 6 x 6 = 4500 starting points.
INIT_GRID = {
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0),
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPoint:
    """One finished run: N parameters, D training tokens, final loss in nats per token."""

    params: float
    tokens: float
    loss: float
    source: str = ""


def read_run(run_dir: str | Path) -> RunPoint:
    """N (all parameters, embeddings included, as Hoffmann counted), D (tokens consumed) and
    the last validation loss of a run directory."""
    from anneal.metrics import read_metrics

    run_dir = Path(run_dir)
    cfg_path, metrics_path = run_dir / "config.json", run_dir / "metrics.jsonl"
    if not cfg_path.is_file() or not metrics_path.is_file():
        raise ValueError(
            f"{run_dir}: not a run directory (it needs config.json and metrics.jsonl, which "
            f"every Anneal run writes). Give run directories, or --csv with params,tokens,loss."
        )
    params = json.loads(cfg_path.read_text()).get("model", {}).get("params")
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val" and r.get("val_loss") is not None]
    if not params or not train or not val:
        raise ValueError(
            f"{run_dir}: has no parameter count or no train and val rows in metrics.jsonl; "
            f"the fit needs finished runs (a validation after the last step)."
        )
    last = train[-1]
    if val[-1]["step"] != last["step"]:
        raise ValueError(
            f"{run_dir}: the last validation is at step {val[-1]['step']} but training went "
            f"to step {last['step']}; the fit needs the loss at the end of training. Finish "
            f"the run (it validates after its last step) or drop it."
        )
    return RunPoint(
        params=float(params),
        tokens=float(last["tokens"]),
        loss=float(val[-1]["val_loss"]),
        source=str(run_dir),
    )


def read_csv(path: str | Path) -> list[RunPoint]:
    """Rows of a CSV with a header naming ``params``, ``tokens`` and ``loss`` columns."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"--csv {path}: cannot read it ({e}).") from None
    points = []
    for i, row in enumerate(rows, start=2):
        try:
            p = RunPoint(
                params=float(row["params"]),
                tokens=float(row["tokens"]),
                loss=float(row["loss"]),
                source=f"{path}:{i}",
            )
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"--csv {path}, line {i}: needs numbers in columns params, tokens and loss "
                f"(header: params,tokens,loss), got {dict(row)}."
            ) from None
        points.append(p)
    return points


def _check_points(points: Sequence[RunPoint]) -> None:
    bad = [
        p.source
        for p in points
        if not all(math.isfinite(v) and v > 0 for v in (p.params, p.tokens, p.loss))
    ]
    if bad:
        raise ValueError(f"runs with non-positive params, tokens or loss: {', '.join(bad)}.")
    if (
        len(points) < len(PARAM_NAMES)
        or len({p.params for p in points}) < 2
        or len({p.tokens for p in points}) < 2
    ):
        raise ValueError(
            f"the fit has 5 unknowns (E, A, B, alpha, beta) and needs at least 5 runs with at "
            f"least 2 model sizes and 2 token budgets; got {len(points)} runs, "
            f"{len({p.params for p in points})} sizes, {len({p.tokens for p in points})} "
            f"budgets. `recipes/scaling_sweep.py` trains such a grid."
        )


def huber_objective(
    theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float
) -> tuple[float, np.ndarray]:
    """Mean Huber loss of ``LSE(a - alpha log N, b - beta log D, e) - log L`` and its gradient
    with respect to ``theta = (a, b, e, alpha, beta)``."""
    a, b, e, alpha, beta = theta
    t1 = a - alpha * log_n
    t2 = b - beta * log_d
    top = np.maximum(np.maximum(t1, t2), e)
    w1, w2, w3 = np.exp(t1 - top), np.exp(t2 - top), np.exp(e - top)
    total = w1 + w2 + w3
    resid = top + np.log(total) - log_l
    absr = np.abs(resid)
    value = np.where(absr <= delta, 0.5 * resid * resid, delta * (absr - 0.5 * delta)).mean()
    dr = np.clip(resid, -delta, delta) / (len(resid) * total)  # d value / d term, over softmax
    g1, g2 = dr * w1, dr * w2
    grad = np.array([g1.sum(), g2.sum(), (dr * w3).sum(), -(g1 @ log_n), -(g2 @ log_d)])
    return float(value), grad


def _scaled_objective(theta, log_n, log_d, log_l, delta):
    value, grad = huber_objective(theta, log_n, log_d, log_l, delta)
    return value / delta, grad / delta


def _minimise(starts: np.ndarray, log_n, log_d, log_l, delta: float) -> tuple[np.ndarray, float]:
    """L-BFGS from every start; the best end point and its mean Huber loss.

    The objective is divided by delta so that it and its gradient are of order one: on the raw
    scale (residuals of order delta) the default tolerances stop L-BFGS early, the flaw that
    Besiroglu et al. found in the published fit.
    """
    from scipy.optimize import minimize

    best, best_value = None, math.inf
    for x0 in starts:
        res = minimize(
            _scaled_objective,
            x0,
            args=(log_n, log_d, log_l, delta),
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": 200, "ftol": 1e-10, "gtol": 1e-6},
        )
        if np.all(np.isfinite(res.x)) and res.fun < best_value:
            best, best_value = res.x, float(res.fun) * delta
    return best, best_value


def _grid() -> np.ndarray:
    g = INIT_GRID
    mesh = np.meshgrid(g["a"], g["b"], g["e"], g["alpha"], g["beta"], indexing="ij")
    return np.stack([m.ravel() for m in mesh], axis=1)


def _grid_scores(grid: np.ndarray, log_n, log_d, log_l, delta: float) -> np.ndarray:
    """``huber_objective`` at every row of ``grid`` at once (no gradient)."""
    a, b, e, alpha, beta = (grid[:, i : i + 1] for i in range(5))
    terms = np.stack(
        [a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (len(grid), len(log_n)))]
    )
    top = terms.max(axis=0)
    resid = top + np.log(np.exp(terms - top).sum(axis=0)) - log_l
    absr = np.abs(resid)
    return np.where(absr <= delta, 0.5 * resid**2, delta * (absr - 0.5 * delta)).mean(axis=1)


def _theta_to_fit(theta: np.ndarray) -> dict[str, float]:
    a, b, e, alpha, beta = (float(v) for v in theta)
    return {"E": math.exp(e), "A": math.exp(a), "B": math.exp(b), "alpha": alpha, "beta": beta}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitResult:
    """Best-fit constants, their bootstrap intervals and what they were fitted to."""

    values: dict[str, float]
    ci95: dict[str, tuple[float, float]]
    objective: float
    """Mean Huber loss at the optimum (on log-loss residuals)."""
    points: tuple[RunPoint, ...]
    n_starts: int
    n_bootstrap: int
    seed: int

    def to_fit(self, *, name: str = "fitted", source: str = "anneal fit") -> ChinchillaFit:
        return ChinchillaFit(
            **self.values,
            name=name,
            source=source,
            ci95=tuple((k, *self.ci95[k]) for k in PARAM_NAMES if k in self.ci95),
        )

    def to_json(self) -> dict:
        return {
            "format": FIT_FORMAT,
            "version": FIT_VERSION,
            "law": "L(N, D) = E + A / N**alpha + B / D**beta (nats/token; N params, D tokens)",
            "fit": self.values,
            "ci95": {k: list(v) for k, v in self.ci95.items()},
            "method": {
                "objective": "mean Huber loss of log-loss residuals (Hoffmann et al. 2022, D.2)",
                "huber_delta": HUBER_DELTA,
                "optimizer": "L-BFGS-B",
                "grid_starts": self.n_starts,
                "bootstrap_resamples": self.n_bootstrap,
                "seed": self.seed,
                "objective_value": self.objective,
            },
            "points": [dataclasses.asdict(p) for p in self.points],
        }


def fit_points(
    points: Sequence[RunPoint],
    *,
    n_bootstrap: int = 200,
    bootstrap_starts: int = 8,
    grid_starts: int | None = None,
    seed: int = 0,
    delta: float = HUBER_DELTA,
) -> FitResult:
    """Fit E, A, B, alpha, beta to ``points`` (Hoffmann's approach 3).

    The point estimate runs L-BFGS from all 4500 starts of Hoffmann's grid (or, with
    ``grid_starts``, from that many of them that score best before optimising). Each bootstrap
    resample (runs drawn with replacement) refits from the point estimate and the
    ``bootstrap_starts`` grid points that score best on that resample; the 95% intervals are
    the 2.5th and 97.5th percentiles of the refits.
    """
    import scipy.optimize  # noqa: F401 (load its BLAS before limiting the thread pools)
    from threadpoolctl import threadpool_limits

    _check_points(points)
    # Thousands of tiny L-BFGS runs: a multi-threaded BLAS only spins (18x slower measured on
    # a busy 2-core machine), so the fit runs single-threaded.
    with threadpool_limits(limits=1):
        return _fit_points(
            points,
            n_bootstrap=n_bootstrap,
            bootstrap_starts=bootstrap_starts,
            grid_starts=grid_starts,
            seed=seed,
            delta=delta,
        )


def _fit_points(points, *, n_bootstrap, bootstrap_starts, grid_starts, seed, delta) -> FitResult:
    log_n = np.log([p.params for p in points])
    log_d = np.log([p.tokens for p in points])
    log_l = np.log([p.loss for p in points])
    grid = _grid()
    if grid_starts is not None:
        grid = grid[np.argsort(_grid_scores(grid, log_n, log_d, log_l, delta))[:grid_starts]]
    theta, value = _minimise(grid, log_n, log_d, log_l, delta)
    if theta is None:
        raise ValueError("the fit diverged from every starting point; check the runs' losses.")

    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n_bootstrap):
        idx = rng.integers(0, len(points), size=len(points))
        ln, ld, ll = log_n[idx], log_d[idx], log_l[idx]
        scores = _grid_scores(grid, ln, ld, ll, delta)
        starts = np.vstack([theta, grid[np.argsort(scores)[:bootstrap_starts]]])
        boot, _ = _minimise(starts, ln, ld, ll, delta)
        if boot is not None:
            samples.append(_theta_to_fit(boot))
    ci = {}
    if samples:
        for k in PARAM_NAMES:
            vals = np.array([s[k] for s in samples])
            ci[k] = (float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5)))
    return FitResult(
        values=_theta_to_fit(theta),
        ci95=ci,
        objective=value,
        points=tuple(points),
        n_starts=len(grid),
        n_bootstrap=n_bootstrap,
        seed=seed,
    )


def write_fit(result: FitResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return path


def format_fit(result: FitResult) -> str:
    lines = [f"fit of {len(result.points)} runs (mean Huber {result.objective:.3e}):"]
    for k in PARAM_NAMES:
        lo, hi = result.ci95.get(k, (math.nan, math.nan))
        lines.append(f"  {k:<6} {result.values[k]:>12.5g}   95% CI [{lo:.4g}, {hi:.4g}]")
    try:
        fit = result.to_fit()
        lines.append(
            f"  compute-optimal: N* = {fit.G:.4g} (C/6)^{fit.a:.4f}, "
            f"D* = (C/6)^{fit.b:.4f} / {fit.G:.4g}"
        )
    except ValueError as e:
        lines.append(f"  no compute-optimal frontier: {e}")
    return "\n".join(lines)
