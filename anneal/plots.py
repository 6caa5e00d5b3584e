"""PNG charts (matplotlib, headless Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from anneal.scaling.fit import FitResult


def plot_fit(result: FitResult, path: str | Path, *, title: str = "") -> Path:
    """Two panels: iso-FLOP curves of the fitted law with the runs on them, and the fitted
    compute-optimal frontier N*(C) with the runs and the 20-tokens-per-parameter rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fit = result.to_fit()
    n = np.array([p.params for p in result.points])
    d = np.array([p.tokens for p in result.points])
    loss = np.array([p.loss for p in result.points])
    c = 6 * n * d
    c_lo, c_hi = math.log10(c.min()), math.log10(c.max())
    # One curve per run's compute when there are few (each run then sits on its own curve).
    distinct = np.unique(np.round(np.log10(c), 2))
    levels = 10**distinct if len(distinct) <= 12 else np.logspace(c_lo, c_hi, 6)
    cmap = plt.get_cmap("viridis")
    norm = matplotlib.colors.Normalize(vmin=c_lo, vmax=max(c_hi, c_lo + 1e-9))

    fig, (ax_iso, ax_front) = plt.subplots(1, 2, figsize=(12, 4.8))
    n_grid = np.logspace(math.log10(n.min()) - 0.7, math.log10(n.max()) + 0.7, 200)
    for level in levels:
        color = cmap(norm(math.log10(level)))
        ax_iso.plot(n_grid, fit.loss(n_grid, level / (6 * n_grid)), color=color, lw=1.2)
        n_opt = fit.optimal_params(level)
        ax_iso.plot([n_opt], [fit.loss(n_opt, level / (6 * n_opt))], "o", mfc="none", mec=color)
    points = ax_iso.scatter(n, loss, c=np.log10(c), cmap=cmap, norm=norm, edgecolor="k", zorder=3)
    ax_iso.set_xscale("log")
    ax_iso.set_xlabel("parameters N")
    ax_iso.set_ylabel("final loss (nats/token)")
    ax_iso.set_title("iso-FLOP curves of the fit (open circles: optimum)")
    lo, hi = loss.min(), loss.max()
    ax_iso.set_ylim(max(fit.E, lo - 0.3 * (hi - lo + 0.1)), hi + 0.3 * (hi - lo + 0.1))
    fig.colorbar(points, ax=ax_iso, label="log10 C = 6ND (FLOPs)")

    c_grid = np.logspace(c_lo - 1, c_hi + 1, 100)
    ax_front.plot(
        c_grid, fit.optimal_params(c_grid), "k-", label=f"fit: N* = {fit.G:.3g} (C/6)^{fit.a:.3f}"
    )
    ax_front.plot(c_grid, np.sqrt(c_grid / 120), "k:", label="20 tokens per parameter")
    ax_front.scatter(
        c, n, c=loss, cmap="magma", edgecolor="k", zorder=3, label="runs (colour: loss)"
    )
    ax_front.set_xscale("log")
    ax_front.set_yscale("log")
    ax_front.set_xlabel("compute C = 6ND (FLOPs)")
    ax_front.set_ylabel("parameters N")
    ax_front.set_title("compute-optimal frontier")
    ax_front.legend(loc="upper left", fontsize=8)
    fig.suptitle(
        title
        or (
            f"L = {fit.E:.3g} + {fit.A:.3g}/N^{fit.alpha:.3f} + {fit.B:.3g}/D^{fit.beta:.3f}"
            f"  ({len(result.points)} runs)"
        )
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
