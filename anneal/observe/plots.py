"""A run's charts (``anneal plot RUN``, and the end of every run): loss against tokens with
the val loss and the random baseline, the learning rate planned and applied, the gradient norm
with the guard's events, and throughput with MFU, all read from ``RUN/metrics.jsonl``; and,
when the run has downstream scores (``RUN/evals/``), each task's against tokens
(``downstream``); a sparse model's expert load and router balance (``moe_plots``).

The schedule and fit charts live in ``formula_plots`` and the shared look in ``plot_style``;
the CLI imports all three kinds of chart from here."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from anneal.json_values import is_finite_number
from anneal.observe import downstream, moe, moe_plots
from anneal.observe.plot_style import SIZE, claim_pngs, pyplot, save
from anneal.run_record import RunRecord

log = logging.getLogger(__name__)


def _series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    if not pts:
        return np.array([]), np.array([])
    x, y = zip(*pts, strict=True)
    return np.asarray(x), np.asarray(y, dtype=float)


def plot_run(
    run_dir: Path, *, out_dir: Path | None = None, dark: bool = False, keep_others: bool = False
) -> list[Path]:
    """``anneal plot RUN``: loss.png, lr.png, grad_norm.png, throughput.png in ``RUN/plots``,
    val_sources.png for a blend, expert_load.png and moe_balance.png for a sparse model (a
    run with moe rows), downstream.png when the run has downstream scores (a damaged
    ``evals/`` document left out, with a warning).

    A file there that Anneal did not write is a UserError (``claim_pngs``), before anything is
    drawn; with ``keep_others`` (the end of a run) it is kept, its chart is not drawn, and a
    warning says so. Returns the charts drawn."""
    from anneal import rundir
    from anneal.errors import UserError

    run_dir = Path(run_dir)
    rows = rundir.read_metrics(run_dir, trained=True)
    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val"]
    events = [r for r in rows if r.get("kind") == "event"]
    record = rundir.record_or_empty(run_dir)
    parent = _parent_rows(record)
    out_dir = Path(out_dir) if out_dir else rundir.plots_dir(run_dir)
    sources = rundir.val_sources(val)
    name = run_dir.name
    charts = {
        "loss.png": lambda p: _plot_loss(plt, c, train, val, record, p, name, parent),
        "lr.png": lambda p: _plot_lr(plt, c, train, events, record, p, name, parent),
        "grad_norm.png": lambda p: _plot_grad_norm(plt, c, train, events, record, p, name),
        "throughput.png": lambda p: _plot_throughput(plt, c, train, p, name),
    }
    if sources:  # a blend's per-source validation: one more chart
        charts["val_sources.png"] = lambda p: _plot_val_sources(
            plt, c, train, val, sources, p, name
        )
    if balance := moe.moe_rows(rows):  # a sparse model (anneal.observe.moe_plots)
        top_k = (record.model.get("moe") or {}).get("top_k")
        charts["expert_load.png"] = lambda p: moe_plots.draw_expert_load(plt, c, balance, p, name)
        charts["moe_balance.png"] = lambda p: moe_plots.draw_balance(plt, c, train, p, name, top_k)
    tasks = downstream.read_scores(run_dir, rows)
    if downstream.drawable(tasks):
        theirs = _parent_downstream(record)
        charts["downstream.png"] = lambda p: downstream.draw(plt, c, tasks, p, name, theirs)
    if out_dir.exists() and not out_dir.is_dir():
        if not keep_others:
            raise UserError(f"--out {out_dir}: a file is there; name a directory for the charts.")
        log.warning(
            "%s: a file is there, not a directory of charts; it is kept, and no chart is "
            "drawn. Move it away, then run `anneal plot %s`.",
            out_dir,
            run_dir,
        )
        return []
    kept = claim_pngs([out_dir / n for n in charts], keep_others=keep_others)
    for path in kept:
        log.warning(
            "%s: not a chart Anneal drew (a PNG written by Matplotlib), so it is kept "
            "and this chart is not drawn. Move it away, then run `anneal plot %s`.",
            path,
            run_dir,
        )
    plt, style, c = pyplot(dark)
    with plt.rc_context(style):
        return [draw(out_dir / n) for n, draw in charts.items() if out_dir / n not in kept]


def _parent_downstream(record: RunRecord) -> list:
    """A cooldown branch's parent's downstream scores, drawn under the branch's; none when
    not a branch or they cannot be read."""
    from anneal import rundir
    from anneal.errors import UserError

    run = record.parent_run
    try:
        if run is None or not rundir.metrics_path(run).is_file():
            return []
        return downstream.read_scores(run, rundir.read_metrics(run))
    except UserError:
        return []


def _parent_rows(record: RunRecord) -> tuple[str, list[dict], list[dict]] | None:
    """A cooldown branch's parent (``anneal.resolution.cooldown``): its name, train and val rows,
    drawn under the branch's; None when not a branch or its metrics cannot be read."""
    from anneal import rundir
    from anneal.errors import UserError

    run = record.parent_run
    try:
        rows = rundir.read_metrics(run) if run is not None else None
    except UserError:
        rows = None
    if not rows:
        return None
    kinds = [[r for r in rows if r.get("kind") == k] for k in ("train", "val")]
    return f"parent ({run.name})", *kinds


def _plot_parent(ax, c, parent, key: str, *, x: str = "step") -> None:
    """The parent's ``key`` against ``x``, thin and grey, under the branch's lines."""
    if parent is None:
        return
    label, train, val = parent
    rows = train if key in ("loss", "lr") else val
    if key == "val_loss":  # a val row has no tokens: the train row of its step has them
        at = {r["step"]: r.get("tokens") for r in train}
        rows = [{**r, "tokens": at.get(r.get("step"))} for r in val]
    pts = [
        (r[x], r[key])
        for r in rows
        if isinstance(r.get(x), int | float) and is_finite_number(r.get(key))
    ]
    if pts:
        style = "o:" if key == "val_loss" else "-"
        ax.plot(
            *zip(*pts, strict=True),
            style,
            color=c["clip"],
            lw=1,
            ms=3,
            alpha=0.7,
            label=f"{label} {'val loss' if key == 'val_loss' else key}",
        )


def _plot_loss(plt, c, train, val, record, path, name, parent=None) -> Path:
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
        ax.plot(*zip(*pts, strict=True), "o-", color=c["second"], lw=1.5, ms=4, label="val loss")
    vocab = record.vocab_size
    if vocab:
        ax.axhline(
            math.log(vocab),
            color=c["clip"],
            ls="--",
            lw=1,
            label=f"random baseline ln V = {math.log(vocab):.2f}",
        )
    _plot_parent(ax, c, parent, "loss", x="tokens")
    _plot_parent(ax, c, parent, "val_loss", x="tokens")
    ax.set_xscale("log")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{name}: loss")
    ax.grid(alpha=0.4, which="both")
    ax.legend(fontsize=8)
    return save(fig, path)


def _plot_lr(plt, c, train, events, record, path, name, parent=None) -> Path:
    """Applied LR over the planned one. The phases come from config.json's schedule, which
    governs the steps after the last resume; the steps before it are shaded by the LR they
    were trained at (a run resumed with a larger --max-steps decayed under its old length),
    and each resume is marked."""
    sched = record.scheduler_params
    fig, ax = plt.subplots(figsize=SIZE)
    total = sched.get("total_num_steps")
    warm = sched.get("warmup_num_steps")
    peak = record.peak_lr
    resumes = sorted(
        {
            r["step"]
            for r in events
            if r.get("event") == "resume" and is_finite_number(r.get("step"))
        }
    )
    since = resumes[-1] if resumes else 0
    if all(isinstance(v, int | float) for v in (total, warm, peak)):
        from anneal.config.schedule import Schedule
        from anneal.observe.formula_plots import planned_lr, schedule_phases
        from anneal.resolution.cooldown import with_cooldown

        schedule = Schedule.resolved({"cos_min_ratio": 0.1, **sched}, record.optim)
        schedule = with_cooldown(schedule, record)
        decay = "cosine decay" if schedule.kind == "cosine" else f"{schedule.decay_shape} decay"
        _trained_phases(ax, c, train, upto=since, peak=peak, decay_label=decay)
        schedule_phases(ax, schedule, colors=c, from_step=since)
        t, plan = planned_lr(schedule, peak)
        keep = t >= since
        ax.plot(t[keep], np.asarray(plan)[keep], color=c["clip"], ls="--", lw=1, label="planned")
    _plot_parent(ax, c, parent, "lr")
    x, y = _series(train, "lr")
    ax.plot(x, y, color=c["main"], lw=2, label="applied")
    for step in resumes:
        ax.axvline(step, color=c["event"], ls=":", lw=1.5, label=f"resumed at step {step}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(f"{name}: learning rate")
    ax.grid(alpha=0.4)
    handles = dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    ax.legend(handles.values(), handles.keys(), fontsize=8)  # a phase drawn twice: one entry
    return save(fig, path)


def _trained_phases(ax, c, train, *, upto: int, peak: float, decay_label: str) -> None:
    """Shade steps 1 to ``upto`` by the LR each was trained at: warmup until the LR first
    reaches ``peak``, then stable at the peak and decay below it."""
    pts = sorted(
        (r["step"], r["lr"])
        for r in train
        if is_finite_number(r.get("lr"))
        and is_finite_number(r.get("step"))
        and 0 < r["step"] <= upto
    )
    kinds: list[tuple[int, str]] = []
    warming = True
    for step, lr in pts:
        at_peak = lr >= peak * (1 - 1e-6)
        if warming and not (at_peak and not kinds):  # a first step at the peak: no warmup
            kind, warming = "warm", not at_peak
        else:
            kind, warming = ("stable" if at_peak else "decay"), False
        kinds.append((step, kind))
    styles = {
        "warm": ("warm", 0.25, "linear warmup"),
        "stable": ("clip", 0.08, "stable (peak)"),
        "decay": ("cos", 0.18, decay_label),
    }
    start = 0
    for i, (step, kind) in enumerate(kinds):
        if i + 1 == len(kinds) or kinds[i + 1][1] != kind:
            colour, alpha, label = styles[kind]
            ax.axvspan(start, step, color=c[colour], alpha=alpha, lw=0, label=label)
            start = step


def _plot_grad_norm(plt, c, train, events, record, path, name) -> Path:
    fig, ax = plt.subplots(figsize=SIZE)
    x, y = _series(train, "grad_norm")
    ax.plot(x, y, color=c["main"], lw=1.2, label="grad norm (before clipping)")
    clip = record.gradient_clipping
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
    return save(fig, path)


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
    ax2.plot(mx, 100 * np.minimum(my, 1.0), color=c["second"], lw=1.2)  # capped, as logged
    ax2.set_ylabel("MFU (%)")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("optimizer step")
    ax2.grid(alpha=0.4)
    return save(fig, path)


def _plot_val_sources(plt, c, train, val, sources, path, name) -> Path:
    """A blend's validation per source against tokens: loss (nats/token) above, bits per byte
    below (comparable across sources whose tokens hold different numbers of bytes); the total,
    each source weighted by its size, dashed."""
    tokens = {r["step"]: r["tokens"] for r in train}
    fig, axes = plt.subplots(2, 1, figsize=(SIZE[0], SIZE[1] * 1.25), sharex=True)
    for ax, metric, unit in zip(
        axes, ("val_loss", "val_bpb"), ("nats/token", "bits/byte"), strict=True
    ):
        for key, label in [(f"{metric}/{s}", s) for s in sources] + [(metric, "total")]:
            pts = [(tokens.get(r["step"]), r.get(key)) for r in val]
            pts = [(x, y) for x, y in pts if x and isinstance(y, int | float)]
            if pts:  # the line style as a keyword only: a format string too would clash
                style = dict(color=c["clip"], ls="--") if label == "total" else dict(ls="-")
                ax.plot(*zip(*pts, strict=True), marker="o", lw=1.5, ms=3, label=label, **style)
        ax.set_ylabel(f"val {metric[4:]} ({unit})")
        ax.set_xscale("log")
        ax.grid(alpha=0.4, which="both")
    axes[0].set_title(f"{name}: validation per source")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("tokens seen")
    return save(fig, path)
