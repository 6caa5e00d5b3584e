"""Charts of a formula rather than of a run: the learning-rate schedule that a ds_config or a
run's config.json describes (``anneal plot --schedule``: warmup-cosine or WSD), drawn before any
step is taken, and a fitted scaling law with the runs it was fitted to (``anneal fit --plot``,
the scaling sweep)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from anneal.config.run import AUTO
from anneal.config.schedule import DEFAULT_FLOOR, Schedule
from anneal.observe.plot_style import SIZE, claim_pngs, pyplot, save
from anneal.planning.fit import FitResult
from anneal.run_record import RunRecord


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
    fig, (ax_iso, ax_front) = plt.subplots(1, 2, figsize=(12, 4.8))
    _iso_flop_panel(fig, ax_iso, fit, n=n, c=c, loss=loss)
    _frontier_panel(ax_front, fit, n=n, c=c, loss=loss)
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


def _iso_flop_panel(fig, ax, fit, *, n, c, loss) -> None:
    """The law's loss against N at fixed compute, one curve per compute level, its optimum
    circled, and the runs coloured by their compute."""
    import matplotlib
    import matplotlib.pyplot as plt

    c_lo, c_hi = math.log10(c.min()), math.log10(c.max())
    # One curve per run's compute when there are few (each run then sits on its own curve).
    distinct = np.unique(np.round(np.log10(c), 2))
    levels = 10**distinct if len(distinct) <= 12 else np.logspace(c_lo, c_hi, 6)
    cmap = plt.get_cmap("viridis")
    norm = matplotlib.colors.Normalize(vmin=c_lo, vmax=max(c_hi, c_lo + 1e-9))
    n_grid = np.logspace(math.log10(n.min()) - 0.7, math.log10(n.max()) + 0.7, 200)
    for level in levels:
        color = cmap(norm(math.log10(level)))
        ax.plot(n_grid, fit.loss(n_grid, level / (6 * n_grid)), color=color, lw=1.2)
        n_opt = fit.optimal_params(level)
        ax.plot([n_opt], [fit.loss(n_opt, level / (6 * n_opt))], "o", mfc="none", mec=color)
    points = ax.scatter(n, loss, c=np.log10(c), cmap=cmap, norm=norm, edgecolor="k", zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("final loss (nats/token)")
    ax.set_title("iso-FLOP curves of the fit (open circles: optimum)")
    lo, hi = loss.min(), loss.max()
    ax.set_ylim(max(fit.E, lo - 0.3 * (hi - lo + 0.1)), hi + 0.3 * (hi - lo + 0.1))
    fig.colorbar(points, ax=ax, label="log10 C = 6ND (FLOPs)")


def _frontier_panel(ax, fit, *, n, c, loss) -> None:
    """The fitted N*(C) a decade past the runs each way, the 20-tokens-per-parameter rule
    (N = sqrt(C/120)) beside it, and the runs coloured by their loss."""
    c_lo, c_hi = math.log10(c.min()), math.log10(c.max())
    c_grid = np.logspace(c_lo - 1, c_hi + 1, 100)
    ax.plot(
        c_grid, fit.optimal_params(c_grid), "k-", label=f"fit: N* = {fit.G:.3g} (C/6)^{fit.a:.3f}"
    )
    ax.plot(c_grid, np.sqrt(c_grid / 120), "k:", label="20 tokens per parameter")
    ax.scatter(c, n, c=loss, cmap="magma", edgecolor="k", zorder=3, label="runs (colour: loss)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compute C = 6ND (FLOPs)")
    ax.set_ylabel("parameters N")
    ax.set_title("compute-optimal frontier")
    ax.legend(loc="upper left", fontsize=8)


def schedule_phases(ax, schedule: Schedule, *, colors: dict, from_step: int = 0) -> None:
    """Shade the schedule's phases: warmup and cosine decay, or warmup, stable and decay; only
    after ``from_step`` (a resumed run's earlier steps are shaded by the LR they had)."""
    warm, start, end = schedule.warmup_num_steps, schedule.decay_start, schedule.total_num_steps
    spans = [(0, warm, "warm", 0.25, "linear warmup")]
    if schedule.kind == "cosine":
        spans.append((warm, end, "cos", 0.18, "cosine decay"))
    else:
        label = f"{schedule.decay_shape} decay ({schedule.decay_share:.0%} of the run)"
        if schedule.cooldown_step:  # a cooldown branch (anneal.resolution.cooldown)
            label = f"{schedule.decay_shape} cooldown from step {start}"
        spans += [(warm, start, "clip", 0.08, "stable (peak)"), (start, end, "cos", 0.18, label)]
    for a, b, colour, alpha, label in spans:
        if b > max(a, from_step):
            ax.axvspan(max(a, from_step), b, color=colors[colour], alpha=alpha, lw=0, label=label)


def planned_lr(schedule: Schedule, peak_lr: float, *, points: int = 2000):
    """(steps, learning rates) of the schedule at up to ``points`` steps from 1 to its end."""
    total = schedule.total_num_steps
    steps = np.unique(np.linspace(1, total, min(total, points)).astype(int))
    # The decay's first and last steps, so a short WSD decay is drawn where it starts.
    steps = np.unique(np.concatenate([steps, [schedule.decay_start, schedule.decay_start + 1]]))
    steps = steps[(steps >= 1) & (steps <= total)]
    return steps, [peak_lr * schedule.ratio(int(t)) for t in steps]


def plot_schedule(
    schedule: Schedule, *, peak_lr: float, path: Path, dark: bool = False, title: str = ""
) -> Path:
    """The schedule alone (``anneal.config.schedule.Schedule``), its phases shaded."""
    plt, style, c = pyplot(dark)
    total, floor = schedule.total_num_steps, schedule.min_ratio
    steps, lr = planned_lr(schedule, peak_lr)
    with plt.rc_context(style):
        fig, ax = plt.subplots(figsize=SIZE)
        schedule_phases(ax, schedule, colors=c)
        ax.plot(steps, lr, color=c["main"], lw=2, label="learning rate")
        ax.axhline(peak_lr, color=c["clip"], ls=":", lw=1)
        ax.axhline(floor * peak_lr, color=c["clip"], ls=":", lw=1)
        ax.annotate(
            f"peak {peak_lr:.2g}",
            (schedule.warmup_num_steps, peak_lr),
            textcoords="offset points",
            xytext=(6, -12),
        )
        ax.annotate(
            f"floor {floor:g} x peak",
            (total, floor * peak_lr),
            textcoords="offset points",
            xytext=(-110, 6),
        )
        ax.set_xlim(0, total)
        ax.set_ylim(0, peak_lr * 1.1)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("learning rate")
        ax.set_title(title or schedule.describe())
        ax.grid(alpha=0.4)
        # Under WSD the middle of the chart is empty (the line runs along the top).
        ax.legend(loc="upper right" if schedule.kind == "cosine" else "center", fontsize=8)
        out = save(fig, path)
    return out


def _auto(value) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def _read_schedule_source(config: Path) -> tuple[Path, dict, RunRecord | None]:
    """(file, ds_config, the run's record or None) of a ds_config, of a run's config.json, or
    of a run directory (its config.json), each read once."""
    import json

    from anneal import rundir
    from anneal.errors import UserError
    from anneal.resolution.ds import find_ds_config

    run_config = rundir.config_path(config) if Path(config).is_dir() else None
    path = run_config if run_config and run_config.is_file() else find_ds_config(str(config))
    try:
        doc = json.loads(Path(path).read_text())
    except ValueError as e:
        raise UserError(f"--schedule {config}: not valid JSON ({e}).") from None
    if not isinstance(doc, dict):
        raise UserError(f"--schedule {path}: not a JSON object (a ds_config or a config.json).")
    if isinstance(doc.get("run"), dict) and isinstance(doc.get("ds_config"), dict):
        return path, doc["ds_config"], RunRecord(doc, Path(path))
    return path, doc, None


def plot_schedule_file(
    config: Path,
    *,
    steps: int | None,
    peak_lr: float | None = None,
    warmup_steps: int | None = None,
    out: Path | None = None,
    dark: bool = False,
) -> Path:
    """``anneal plot --schedule CONFIG --steps N``: the ds_config's WarmupCosineLR block, or the
    schedule of a run (its directory or config.json: cosine or WSD, ``--steps`` defaulting to
    its length; a larger one shows the run extended). ``"auto"`` values need ``--peak-lr`` /
    ``--warmup-steps``; flags override numbers."""
    import json

    from anneal.errors import UserError

    path, ds, record = _read_schedule_source(config)
    optim = record.optim if record is not None else {}
    sched = (ds.get("scheduler") or {}).get("params")
    if sched is None:
        raise UserError(f"--schedule {path}: no scheduler.params block (WarmupCosineLR) in it.")
    if optim and not steps:
        steps = sched.get("total_num_steps")
    if not isinstance(steps, int) or steps < 1:
        raise UserError(f"--schedule {config}: give the run length, --steps N (N >= 1).")
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
    kind = optim.get("schedule", "cosine")
    floor = optim.get("min_lr_ratio")
    if floor is None:
        given = sched.get("cos_min_ratio", AUTO)
        floor = given if kind == "cosine" and not _auto(given) else DEFAULT_FLOOR[kind]
    params = {**sched, "total_num_steps": steps, "warmup_num_steps": int(warm)}
    schedule = Schedule.resolved({**params, "cos_min_ratio": floor}, optim)
    if optim:  # a run's config.json: a cooldown branch's decay (anneal.resolution.cooldown)
        from anneal.resolution.cooldown import with_cooldown

        schedule = with_cooldown(schedule, record)
    out = out or Path(f"schedule_{Path(path).stem}_{steps}.png")
    claim_pngs([out])
    what = "cosine" if kind == "cosine" else f"stable, {schedule.decay_shape} decay"
    return plot_schedule(
        schedule,
        peak_lr=float(lr),
        path=out,
        dark=dark,
        title=f"{Path(path).name}: warmup {int(warm):,} steps, then {what} to {floor:g} x peak "
        f"over {steps:,} steps",
    )
