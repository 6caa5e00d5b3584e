"""What every chart shares: the light and dark looks (the dark one is the seed's chart), the
headless pyplot, the one way a figure is saved, the claim on the paths a chart will replace,
and the warmup/cosine zones that the schedule chart and a run's learning-rate chart both shade."""

from __future__ import annotations

from pathlib import Path

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


def pyplot(dark: bool):
    """(pyplot on the headless Agg backend, the rc style to draw in, the colours by role)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, (DARK if dark else {}), COLORS["dark" if dark else "light"]


def claim_pngs(paths: list[Path], *, flag: str = "--out", keep_others: bool = False) -> list[Path]:
    """Before drawing: each chart's path is new, or a PNG that Matplotlib wrote (an earlier
    chart, replaced); never a directory, a link or any other file (``anneal.rundir.
    written_by_anneal`` decides). Such a path is a UserError naming the file; with
    ``keep_others`` it is returned instead (the caller keeps the file and skips that chart)."""
    from anneal.errors import UserError
    from anneal.rundir import written_by_anneal

    others = []
    for path in map(Path, paths):
        if (path.exists() or path.is_symlink()) and not written_by_anneal(path):
            if not keep_others:
                raise UserError(
                    f"{flag}: {path} is there and is not a chart Anneal drew (a PNG written by "
                    f"Matplotlib), so it is not replaced. Choose another {flag}, or move it away."
                )
            others.append(path)
    return others


def save(fig, path: Path) -> Path:
    """Write the figure as a PNG and close it (pyplot keeps every open figure alive)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
