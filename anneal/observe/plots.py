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


# --- a run's charts ----------------------------------------------------------------------------

# The seed's chart: dark slate, white text, cyan accents, zones highlighted.
DARK = {
    "figure.facecolor": "#0f172a",
    "axes.facecolor": "#0f172a",
    "savefig.facecolor": "#0f172a",
    "axes.edgecolor": "#94a3b8",
    "axes.labelcolor": "#e2e8f0",
    "axes.titlecolor": "#f8fafc",
    "text.color": "#e2e8f0",
    "xtick.color": "#cbd5e1",
    "ytick.color": "#cbd5e1",
    "grid.color": "#334155",
    "legend.facecolor": "#1e293b",
    "legend.edgecolor": "#334155",
}
COLORS = {
    "light": {
        "main": "#1f77b4",
        "second": "#d62728",
        "warm": "#fde68a",
        "cos": "#bfdbfe",
        "event": "#7c3aed",
        "clip": "#6b7280",
    },
    "dark": {
        "main": "#22d3ee",
        "second": "#f472b6",
        "warm": "#f59e0b",
        "cos": "#38bdf8",
        "event": "#a78bfa",
        "clip": "#94a3b8",
    },
}
DPI = 100
SIZE = (8, 4.5)


def _pyplot(dark: bool):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, (DARK if dark else {}), COLORS["dark" if dark else "light"]


def claim_pngs(paths: list[Path], *, flag: str = "--out") -> None:
    """Before drawing: each chart's path is new, or a PNG that Matplotlib wrote (an earlier
    chart, replaced); never a directory, a link or any other file. UserError naming the file."""
    from anneal.errors import UserError
    from anneal.files import is_matplotlib_png

    for path in map(Path, paths):
        if not (path.exists() or path.is_symlink()):
            continue
        if path.is_symlink() or not path.is_file() or not is_matplotlib_png(path):
            raise UserError(
                f"{flag}: {path} is there and is not a chart Anneal drew (a PNG written by "
                f"Matplotlib), so it is not replaced. Choose another {flag}, or move it away."
            )


def _save(fig, path: Path) -> Path:
    """Write the figure as a PNG and close it (pyplot keeps every open figure alive)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _schedule_zones(ax, *, warmup: int, total: int, colors: dict) -> None:
    if warmup > 0:
        ax.axvspan(0, warmup, color=colors["warm"], alpha=0.25, lw=0, label="linear warmup")
    ax.axvspan(warmup, total, color=colors["cos"], alpha=0.18, lw=0, label="cosine decay")


def plot_schedule(
    *,
    total_steps: int,
    warmup_steps: int,
    peak_lr: float,
    path: Path,
    cos_min_ratio: float = 0.1,
    warmup_min_ratio: float = 0.0,
    dark: bool = False,
    title: str = "",
) -> Path:
    """The warmup-cosine schedule alone (``anneal.config.schedule.lr_ratio``), zones shaded."""
    from anneal.config.schedule import lr_ratio

    plt, style, c = _pyplot(dark)
    steps = np.unique(np.linspace(1, total_steps, min(total_steps, 2000)).astype(int))
    kw = dict(
        total_num_steps=total_steps,
        warmup_num_steps=warmup_steps,
        warmup_min_ratio=warmup_min_ratio,
        cos_min_ratio=cos_min_ratio,
    )
    lr = [peak_lr * lr_ratio(int(t), **kw) for t in steps]
    with plt.rc_context(style):
        fig, ax = plt.subplots(figsize=SIZE)
        _schedule_zones(ax, warmup=warmup_steps, total=total_steps, colors=c)
        ax.plot(steps, lr, color=c["main"], lw=2, label="learning rate")
        ax.axhline(peak_lr, color=c["clip"], ls=":", lw=1)
        ax.axhline(cos_min_ratio * peak_lr, color=c["clip"], ls=":", lw=1)
        ax.annotate(
            f"peak {peak_lr:.2g}",
            (warmup_steps, peak_lr),
            textcoords="offset points",
            xytext=(6, -12),
        )
        ax.annotate(
            f"floor {cos_min_ratio:g} x peak",
            (total_steps, cos_min_ratio * peak_lr),
            textcoords="offset points",
            xytext=(-110, 6),
        )
        ax.set_xlim(0, total_steps)
        ax.set_ylim(0, peak_lr * 1.1)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("learning rate")
        ax.set_title(title or f"warmup {warmup_steps:,} steps, cosine to {total_steps:,}")
        ax.grid(alpha=0.4)
        ax.legend(loc="upper right", fontsize=8)
        out = _save(fig, path)
    return out


def _auto(value) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def plot_schedule_file(
    config: Path,
    *,
    steps: int | None,
    peak_lr: float | None = None,
    warmup_steps: int | None = None,
    out: Path | None = None,
    dark: bool = False,
) -> Path:
    """``anneal plot --schedule CONFIG --steps N``: the ds_config's WarmupCosineLR block.
    ``"auto"`` values need ``--peak-lr`` / ``--warmup-steps``; flags override numbers."""
    import json

    from anneal.config.ds import find_ds_config
    from anneal.errors import UserError

    path = find_ds_config(str(config))
    try:
        ds = json.loads(Path(path).read_text())
    except ValueError as e:
        raise UserError(f"--schedule {config}: not valid JSON ({e}).") from None
    if not steps or steps < 1:
        raise UserError(f"--schedule {config}: give the run length, --steps N (N >= 1).")
    sched = (ds.get("scheduler") or {}).get("params")
    if sched is None:
        raise UserError(f"--schedule {path}: no scheduler.params block (WarmupCosineLR) in it.")
    lr = peak_lr if peak_lr is not None else (ds.get("optimizer") or {}).get("params", {}).get("lr")
    warm = warmup_steps if warmup_steps is not None else sched.get("warmup_num_steps")
    needed = [
        (lr, "optimizer.params.lr", "--peak-lr"),
        (warm, "scheduler.params.warmup_num_steps", "--warmup-steps"),
    ]
    for value, key, flag in needed:
        if value is None or _auto(value):
            raise UserError(
                f"--schedule {path}: {key} is {json.dumps(value)}; a run fills it in from its "
                f"recipe. Give the value with {flag}."
            )
    if warm > steps:
        raise UserError(f"--warmup-steps {warm} is longer than --steps {steps}.")
    out = out or Path(f"schedule_{Path(path).stem}_{steps}.png")
    claim_pngs([out])
    return plot_schedule(
        total_steps=steps,
        warmup_steps=int(warm),
        peak_lr=float(lr),
        cos_min_ratio=float(sched.get("cos_min_ratio", 0.1)),
        warmup_min_ratio=float(sched.get("warmup_min_ratio", 0.0)),
        path=out,
        dark=dark,
        title=f"{Path(path).name}: warmup {int(warm):,} steps, then cosine to "
        f"{float(sched.get('cos_min_ratio', 0.1)):g} x peak over {steps:,} steps",
    )


def _series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    if not pts:
        return np.array([]), np.array([])
    x, y = zip(*pts, strict=True)
    return np.asarray(x), np.asarray(y, dtype=float)


def plot_run(run_dir: Path, *, out_dir: Path | None = None, dark: bool = False) -> list[Path]:
    """``anneal plot RUN``: loss.png, lr.png, grad_norm.png, throughput.png in ``RUN/plots``."""
    from anneal import rundir
    from anneal.errors import UserError

    run_dir = Path(run_dir)
    rows = rundir.read_metrics(run_dir, trained=True)
    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val"]
    events = [r for r in rows if r.get("kind") == "event"]
    cfg = rundir.config_or_empty(run_dir)
    out_dir = Path(out_dir) if out_dir else rundir.plots_dir(run_dir)
    names = ("loss.png", "lr.png", "grad_norm.png", "throughput.png")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir}: a file is there; name a directory for the charts.")
    claim_pngs([out_dir / n for n in names])
    plt, style, c = _pyplot(dark)
    name = run_dir.name
    paths = []
    loss, lr, grad_norm, throughput = (out_dir / n for n in names)
    with plt.rc_context(style):
        paths.append(_plot_loss(plt, c, train, val, cfg, loss, name))
        paths.append(_plot_lr(plt, c, train, cfg, lr, name))
        paths.append(_plot_grad_norm(plt, c, train, events, cfg, grad_norm, name))
        paths.append(_plot_throughput(plt, c, train, throughput, name))
    return paths


def _plot_loss(plt, c, train, val, cfg, path, name) -> Path:
    tokens = {r["step"]: r["tokens"] for r in train}
    fig, ax = plt.subplots(figsize=SIZE)
    x = np.array([r["tokens"] for r in train if isinstance(r.get("loss"), int | float)])
    y = np.array([r["loss"] for r in train if isinstance(r.get("loss"), int | float)])
    ax.plot(x, y, color=c["main"], lw=1, alpha=0.5 if len(y) > 50 else 1, label="train loss")
    if len(y) > 50:  # a running mean over ~2% of the run shows the trend through the noise
        k = max(2, len(y) // 50)
        ax.plot(
            x[k - 1 :],
            np.convolve(y, np.ones(k) / k, "valid"),
            color=c["main"],
            lw=2,
            label=f"train loss, mean of {k}",
        )
    vx = [tokens.get(r["step"]) for r in val if isinstance(r.get("val_loss"), int | float)]
    vy = [r["val_loss"] for r in val if isinstance(r.get("val_loss"), int | float)]
    pts = [(a, b) for a, b in zip(vx, vy, strict=True) if a]
    if pts:
        ax.plot(*zip(*pts, strict=True), "o-", color=c["second"], lw=1.5, ms=4, label="dev loss")
    vocab = (cfg.get("model") or {}).get("vocab_size")
    if vocab:
        ax.axhline(
            math.log(vocab),
            color=c["clip"],
            ls="--",
            lw=1,
            label=f"random baseline ln V = {math.log(vocab):.2f}",
        )
    ax.set_xscale("log")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{name}: loss")
    ax.grid(alpha=0.4, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _plot_lr(plt, c, train, cfg, path, name) -> Path:
    ds = cfg.get("ds_config") or {}
    sched = (ds.get("scheduler") or {}).get("params") or {}
    fig, ax = plt.subplots(figsize=SIZE)
    total = sched.get("total_num_steps")
    warm = sched.get("warmup_num_steps")
    peak = (ds.get("optimizer") or {}).get("params", {}).get("lr")
    if all(isinstance(v, int | float) for v in (total, warm, peak)):
        from anneal.config.schedule import lr_ratio

        _schedule_zones(ax, warmup=int(warm), total=int(total), colors=c)
        t = np.unique(np.linspace(1, total, min(int(total), 2000)).astype(int))
        kw = {k: sched[k] for k in ("warmup_min_ratio", "cos_min_ratio") if k in sched}
        plan = [
            peak * lr_ratio(int(s), total_num_steps=int(total), warmup_num_steps=int(warm), **kw)
            for s in t
        ]
        ax.plot(t, plan, color=c["clip"], ls="--", lw=1, label="planned")
    x, y = _series(train, "lr")
    ax.plot(x, y, color=c["main"], lw=2, label="applied")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(f"{name}: learning rate")
    ax.grid(alpha=0.4)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _plot_grad_norm(plt, c, train, events, cfg, path, name) -> Path:
    fig, ax = plt.subplots(figsize=SIZE)
    x, y = _series(train, "grad_norm")
    ax.plot(x, y, color=c["main"], lw=1.2, label="grad norm (before clipping)")
    clip = (cfg.get("ds_config") or {}).get("gradient_clipping")
    if clip:
        ax.axhline(clip, color=c["clip"], ls="--", lw=1, label=f"clip threshold {clip:g}")
    bad = [r["step"] for r in train if "grad_norm" in (r.get("nonfinite") or [])]
    top = float(np.nanmax(y)) if len(y) else 1.0
    if bad:
        ax.plot(bad, [top] * len(bad), "x", color=c["second"], ms=8, mew=2, label="non-finite")
    marked = set()
    for e in events:
        kind = e.get("event")
        if kind in ("spike", "rewind", "skip"):
            style = {"spike": ":", "rewind": "-", "skip": "--"}[kind]
            ax.axvline(
                e["step"],
                color=c["event"],
                ls=style,
                lw=1.2,
                label=kind if kind not in marked else None,
            )
            marked.add(kind)
    if len(y) and top / max(float(np.nanmin(y[y > 0])) if (y > 0).any() else 1, 1e-12) > 50:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("global L2 norm")
    ax.set_title(f"{name}: gradient norm")
    ax.grid(alpha=0.4)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _plot_throughput(plt, c, train, path, name) -> Path:
    """Two stacked panels: MFU is tokens/s times a constant, so one axis would hide a line."""
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(SIZE[0], SIZE[1] * 1.25), sharex=True)
    x, y = _series(train, "tokens_per_s")
    ax.plot(x, y, color=c["main"], lw=1.2)
    if len(y):
        ax.axhline(
            float(np.median(y)),
            color=c["clip"],
            ls="--",
            lw=1,
            label=f"median {float(np.median(y)):,.0f}",
        )
        ax.legend(fontsize=8, loc="lower right")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{name}: throughput")
    ax.grid(alpha=0.4)
    mx, my = _series(train, "mfu")
    ax2.plot(mx, 100 * my, color=c["second"], lw=1.2)
    ax2.set_ylabel("MFU (%)")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("optimizer step")
    ax2.grid(alpha=0.4)
    return _save(fig, path)
