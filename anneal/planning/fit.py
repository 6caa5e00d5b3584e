"""Fitting the law to a user's runs the way Hoffmann et al. 2022 did (section 3.3, appendix
D.2): Huber loss (delta 1e-3) on log-loss residuals, L-BFGS from a grid of starting points, and
bootstrap confidence intervals. ``anneal fit`` and ``recipes/scaling_sweep.py`` call
``fit_points``; docs/planning.md describes the method and its checks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from anneal.errors import UserError
from anneal.files import check_creatable, is_matplotlib_png
from anneal.planning.law import FIT_FORMAT, FIT_VERSION, PARAM_NAMES, ChinchillaFit
from anneal.planning.run_points import RunPoint

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


def _check_points(points: Sequence[RunPoint]) -> None:
    bad = [
        p.source
        for p in points
        if not all(math.isfinite(v) and v > 0 for v in (p.params, p.tokens, p.loss))
    ]
    if bad:
        raise UserError(f"runs with non-positive params, tokens or loss: {', '.join(bad)}.")
    if (
        len(points) < len(PARAM_NAMES)
        or len({p.params for p in points}) < 2
        or len({p.tokens for p in points}) < 2
    ):
        raise UserError(
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


def _minimise(
    starts: np.ndarray, log_n, log_d, log_l, delta: float, *, tick=None
) -> tuple[np.ndarray, float]:
    """L-BFGS from every start; the best end point and its mean Huber loss. ``tick(i)`` is
    called after start ``i`` (counted from 1), for progress.

    The objective is divided by delta so that it and its gradient are of order one: on the raw
    scale (residuals of order delta) the default tolerances stop L-BFGS early, the flaw that
    Besiroglu et al. found in the published fit.
    """
    from scipy.optimize import minimize

    best, best_value = None, math.inf
    for i, x0 in enumerate(starts, start=1):
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
        if tick is not None:
            tick(i)
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
    n_bootstrap: int = 100,
    bootstrap_starts: int = 8,
    grid_starts: int | None = None,
    seed: int = 0,
    delta: float = HUBER_DELTA,
    progress: Callable[[str], None] | None = None,
) -> FitResult:
    """Fit E, A, B, alpha, beta to ``points`` (Hoffmann's approach 3).

    The point estimate runs L-BFGS from all 4500 starts of Hoffmann's grid (or, with
    ``grid_starts``, from that many of them that score best before optimising). Each bootstrap
    resample (runs drawn with replacement) refits from the point estimate and the
    ``bootstrap_starts`` grid points that score best on that resample; the 95% intervals are
    the 2.5th and 97.5th percentiles of the refits.

    ``progress`` receives a line for each stage: the start, each tenth of the point
    estimate's starts and of the bootstrap resamples (a full fit takes minutes on a small
    machine, and says so while it runs).
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
            progress=_Progress(progress),
        )


class _Progress:
    """Lines for ``fit_points``'s ``progress``: each tenth of a stage, with the seconds since
    the fit began."""

    def __init__(self, say: Callable[[str], None] | None):
        self.say = say
        self.t0 = time.perf_counter()

    def __call__(self, text: str) -> None:
        if self.say is not None:
            self.say(f"{text} ({time.perf_counter() - self.t0:.0f} s)")

    def ticker(self, what: str, total: int, unit: str) -> Callable[[int], None] | None:
        """A ``tick(i)`` that says ``what i/total unit`` at each tenth of ``total``."""
        if self.say is None:
            return None
        due = {math.ceil(total * k / 10) for k in range(1, 11)}
        return lambda i: self(f"{what} {i}/{total} {unit}") if i in due else None


def _fit_points(
    points, *, n_bootstrap, bootstrap_starts, grid_starts, seed, delta, progress
) -> FitResult:
    log_n = np.log([p.params for p in points])
    log_d = np.log([p.tokens for p in points])
    log_l = np.log([p.loss for p in points])
    grid = _grid()
    if grid_starts is not None:
        grid = grid[np.argsort(_grid_scores(grid, log_n, log_d, log_l, delta))[:grid_starts]]
    then = f", then {n_bootstrap} bootstrap resamples" if n_bootstrap else ""
    progress(f"{len(points)} runs; point estimate: L-BFGS from {len(grid)} starts{then}")
    tick = progress.ticker("point estimate:", len(grid), "starts")
    theta, value = _minimise(grid, log_n, log_d, log_l, delta, tick=tick)
    if theta is None:
        raise UserError(
            "the fit diverged from every starting point; check that the losses are final "
            "validation losses in nats per token, and add runs of more sizes and budgets."
        )

    rng = np.random.default_rng(seed)
    samples = []
    tick = progress.ticker("bootstrap", n_bootstrap, "resamples")
    for i in range(1, n_bootstrap + 1):
        idx = rng.integers(0, len(points), size=len(points))
        ln, ld, ll = log_n[idx], log_d[idx], log_l[idx]
        scores = _grid_scores(grid, ln, ld, ll, delta)
        starts = np.vstack([theta, grid[np.argsort(scores)[:bootstrap_starts]]])
        boot, _ = _minimise(starts, ln, ld, ll, delta)
        if boot is not None:
            samples.append(_theta_to_fit(boot))
        if tick is not None:
            tick(i)
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
    """Write the fit file (atomically: a reader sees the old file or the new one)."""
    from anneal.files import write_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(result.to_json(), indent=2) + "\n")
    return path


def is_fit_file(path: Path) -> bool:
    """A file ``anneal fit`` wrote: a JSON object with ``"format": FIT_FORMAT``."""
    try:
        doc = json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("format") == FIT_FORMAT


def claim_fit_outputs(out: Path, plot: Path | None, *, force: bool) -> None:
    """Before fitting: ``--out`` and ``--plot`` may be written. Each must be new, or with
    ``force`` be what ``anneal fit`` writes (a fit file, a Matplotlib PNG); never a directory,
    never the same path for both. UserError naming the flag and the fix otherwise."""
    out = Path(out)
    checks = [("--out", out, is_fit_file, 'a fit file (JSON with "format": "' + FIT_FORMAT + '")')]
    if plot is not None:
        plot = Path(plot)
        if os.path.realpath(plot) == os.path.realpath(out):
            raise UserError(
                f"--plot {plot}: the same file as --out. Give the plot its own name (.png)."
            )
        checks.append(("--plot", plot, is_matplotlib_png, "a PNG written by Matplotlib"))
    for flag, path, ours, kind in checks:
        if path.is_dir():
            raise UserError(
                f"{flag} {path}: a directory is there. Name a file, e.g. {path / out.name}."
            )
        if not (path.exists() or path.is_symlink()):
            check_creatable(path, flag=flag)
            continue
        if not force:
            raise UserError(
                f"{flag} {path}: exists. Choose another name, or pass --force to replace it "
                f"(only {kind} is replaced)."
            )
        if path.is_symlink() or not ours(path):
            raise UserError(
                f"{flag} {path}: exists and is not {kind}, so --force will not replace it. "
                f"Choose another name, or move that file away."
            )


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
    except UserError as e:
        lines.append(f"  no compute-optimal frontier: {e}")
    return "\n".join(lines)
