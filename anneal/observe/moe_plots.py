"""A sparse model's two charts (``anneal plot``, only for a run with ``moe`` rows):

- ``expert_load.png``: for each layer a panel, experts up the side, steps along the bottom,
  each cell coloured by the expert's load over the uniform load (its share of the layer's
  assignments times E; 1 = its fair share) over the steps of one moe row;
- ``moe_balance.png``: the router's aux loss (with the value a balanced router gives, top_k)
  and z-loss, and each layer's max/mean load with the worst layer's in bold, from the train
  rows. The loss chart keeps the language-model loss alone: the aux loss is on another scale.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from anneal.json_values import is_finite_number
from anneal.observe.moe import shares, steps
from anneal.observe.plot_style import SIZE, save

# Panels per row of the heat map: 4, or 8 for a deep model (48 layers: 6 rows, not 12).
COLUMNS, DEEP_COLUMNS, DEEP = 4, 8, 16


def load_grid(moe: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(step edges [R + 1], load over uniform [L, E, R]) of R moe rows: row r covers the steps
    from edge r (exclusive) to edge r + 1 (inclusive)."""
    edges = [moe[0]["step"] - steps(moe[0])] + [r["step"] for r in moe]
    load = np.array([np.asarray(shares(r["counts"])) for r in moe], dtype=float)  # [R, L, E]
    return np.asarray(edges, dtype=float), load.transpose(1, 2, 0) * load.shape[2]


def draw_expert_load(plt, c, moe: list[dict], path: Path, name: str) -> Path:
    """The heat map: one panel per layer; blue under its fair share, red over, white at it."""
    from matplotlib.colors import TwoSlopeNorm

    edges, load = load_grid(moe)
    layers, experts = load.shape[:2]
    cols = min(COLUMNS if layers <= DEEP else DEEP_COLUMNS, layers)
    rows = math.ceil(layers / cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(SIZE[0] if cols <= COLUMNS else 2 * SIZE[0], max(SIZE[1], 2.2 * rows + 1)),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(2.0, float(np.nanmax(load))))
    mesh = None
    for layer, ax in enumerate(axes.flat):
        if layer >= layers:
            ax.set_visible(False)
            continue
        mesh = ax.pcolormesh(
            edges, np.arange(experts + 1) - 0.5, load[layer], cmap="RdBu_r", norm=norm
        )
        ax.set_title(f"layer {layer}", fontsize=9)
    for ax in axes[:, 0]:
        ax.set_ylabel("expert")
    for ax in axes[-1, :]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(f"{name}: expert load / uniform load ({experts} experts)")
    fig.colorbar(mesh, ax=axes.ravel().tolist(), shrink=0.8, label="load / uniform")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)  # not plot_style.save: tight_layout fights a shared colorbar
    plt.close(fig)
    return path


def draw_balance(plt, c, train: list[dict], path: Path, name: str, top_k) -> Path:
    """Aux loss (and z-loss, on its own axis) above; each layer's max/mean load below."""
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(SIZE[0], SIZE[1] * 1.25), sharex=True)
    aux = [(r["step"], r["aux_loss"]) for r in train if is_finite_number(r.get("aux_loss"))]
    if aux:
        ax.plot(*zip(*aux, strict=True), color=c["main"], lw=1.2, label="aux loss")
    if isinstance(top_k, int):
        ax.axhline(top_k, color=c["clip"], ls="--", lw=1, label=f"balanced (top_k = {top_k})")
    z = [(r["step"], r["z_loss"]) for r in train if is_finite_number(r.get("z_loss"))]
    if z:
        zx = ax.twinx()
        zx.plot(*zip(*z, strict=True), color=c["second"], lw=1, alpha=0.7, label="z-loss")
        zx.set_ylabel("z-loss")
        zx.legend(fontsize=8, loc="upper center")
    ax.set_ylabel("aux loss (unscaled)")
    ax.set_title(f"{name}: router balance")
    ax.grid(alpha=0.4)
    ax.legend(fontsize=8, loc="upper right")
    ratios = [
        (r["step"], r["moe_max_mean"]) for r in train if isinstance(r.get("moe_max_mean"), list)
    ]
    if ratios:
        steps = np.array([s for s, _ in ratios])
        grid = np.array(
            [[v if is_finite_number(v) else np.nan for v in vs] for _, vs in ratios], dtype=float
        )
        for layer in range(grid.shape[1]):
            ax2.plot(steps, grid[:, layer], color=c["clip"], lw=0.6, alpha=0.5)
        ax2.plot(steps, np.nanmax(grid, axis=1), color=c["second"], lw=1.5, label="worst layer")
        ax2.plot([], [], color=c["clip"], lw=0.6, label="each layer")
    ax2.axhline(1.0, color=c["main"], ls="--", lw=1, label="uniform")
    ax2.set_ylabel("max / mean expert load")
    ax2.set_xlabel("optimizer step")
    ax2.grid(alpha=0.4)
    ax2.legend(fontsize=8, loc="upper right")
    return save(fig, path)
