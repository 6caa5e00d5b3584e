"""A run's downstream scores, read back and judged: what ``anneal plot`` draws (downstream.png),
what ``anneal report`` lists per task, and what ``anneal compare`` sets side by side.

They come from the run's files only: the documents ``RUN/evals/step-<N>.json``
(``anneal.rundir.read_evals``; the format is ``anneal.eval.results``'), and, for a step that has
no document, the metrics rows of kind ``"eval"`` (``eval/<task>/<metric>`` keys). A document's
tokens, when it has none (a Hugging Face directory scored with ``--step``), are the train row's
of its step.

A task's **main metric** is ``acc_norm`` where it has one, else ``acc``, else its first metric by
name; a perplexity or bits per byte is better lower, anything else higher. A task **fell** when
its latest value is below its best earlier value (above it, where lower is better) by more than
``FELL_STDERR`` times the latest value's stderr.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

from anneal import rundir
from anneal.json_values import is_finite_number, is_number, is_printable_name

log = logging.getLogger(__name__)

FELL_STDERR = 2.0
"""A fall counts when it is more than this many standard errors (the latest value's)."""
LOWER_IS_BETTER = ("perplexity", "bits_per_byte")
"""Metric names holding one of these are better lower (lm-eval's rolling-loglikelihood ones)."""
PREFERRED = ("acc_norm", "acc")
RULE = (
    f"a task fell when its latest value is below its best earlier value (above it, for a "
    f"perplexity) by more than {FELL_STDERR:g} x the latest value's stderr"
)


@dataclasses.dataclass(frozen=True)
class Score:
    """One scoring of one task's main metric: its step, tokens seen (None when unknown)."""

    step: int
    tokens: int | None
    value: float
    stderr: float | None


@dataclasses.dataclass(frozen=True)
class TaskScores:
    """A task's main metric over the run's scorings, by step; ``chance`` from its newest
    document that gives one; ``failed``: why the run's latest scoring did not score it."""

    task: str
    metric: str
    scores: tuple[Score, ...]
    chance: float | None = None
    failed: str | None = None
    failed_step: int | None = None

    @property
    def lower_is_better(self) -> bool:
        return lower_is_better(self.metric)

    def better(self, a: float, b: float) -> bool:
        """Whether value ``a`` is better than ``b`` for this metric."""
        return a < b if self.lower_is_better else a > b

    def fell(self) -> tuple[Score, Score] | None:
        """(the best earlier score, the latest) when the latest fell below it by more than
        ``FELL_STDERR`` of its stderr; None when it did not, or cannot be told (one scoring,
        no stderr)."""
        if len(self.scores) < 2 or self.scores[-1].stderr is None:
            return None
        *earlier, latest = self.scores
        best = self.best(earlier)
        drop = latest.value - best.value if self.lower_is_better else best.value - latest.value
        return (best, latest) if drop > FELL_STDERR * latest.stderr else None

    def best(self, scores) -> Score:
        key = (lambda s: s.value) if self.lower_is_better else (lambda s: -s.value)
        return min(scores, key=key)


def lower_is_better(metric: str) -> bool:
    return any(word in metric for word in LOWER_IS_BETTER)


def stderr_name(metric: str) -> str:
    """The name of ``metric``'s stderr: ``acc`` -> ``acc_stderr``, ``acc/strict`` ->
    ``acc_stderr/strict`` (as ``anneal.eval.results.metric_name`` writes lm-eval's keys)."""
    name, slash, filt = metric.partition("/")
    return f"{name}_stderr{slash}{filt}"


def is_stderr(metric: str) -> bool:
    return metric.partition("/")[0].endswith("_stderr")


def main_metric(names) -> str | None:
    """``acc_norm`` if among ``names``, else ``acc``, else the first by name that is not a
    stderr; None when there is none."""
    values = sorted(n for n in names if not is_stderr(n))
    return next((p for p in PREFERRED if p in values), values[0] if values else None)


def _finite_float(value) -> float | None:
    return float(value) if is_number(value) and math.isfinite(value) else None


def _count_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _metrics(entry) -> dict[str, float]:
    """A document's task entry's finite metrics (anything else in a file from elsewhere is
    left out)."""
    metrics = entry.get("metrics") if isinstance(entry, dict) else None
    if not isinstance(metrics, dict):
        return {}
    pairs = ((_one_line(k, 80), _finite_float(v)) for k, v in metrics.items())
    return {k: v for k, v in pairs if v is not None}


def _from_rows(rows: list[dict]) -> dict[int, dict]:
    """Documents made from the metrics rows of kind "eval": step -> {step, tokens, tasks}."""
    docs: dict[int, dict] = {}
    for row in rows:
        step = _count_or_none(row.get("step"))
        if row.get("kind") != "eval" or step is None:
            continue
        tasks: dict[str, dict] = {}
        for key, value in row.items():
            parts = key.split("/", 2)
            if len(parts) == 3 and parts[0] == "eval" and _finite_float(value) is not None:
                tasks.setdefault(parts[1], {"metrics": {}})["metrics"][parts[2]] = value
        docs[step] = {"step": step, "tokens": row.get("tokens"), "tasks": tasks}
    return docs


def documents(run_dir: Path, rows: list[dict]) -> list[dict]:
    """The run's scorings by step: its evals/ documents, and a document made from the eval
    metrics rows for each step that has none. A document that ``rundir.read_evals`` or
    ``value_problem`` refuses is left out, with one warning naming it."""
    docs = {}
    for doc in rundir.read_evals(run_dir):
        if why := value_problem(doc):
            path = rundir.eval_path(run_dir, doc["step"])
            log.warning("%s: skipped, not a score document anneal eval writes (%s)", path, why)
            continue
        docs[doc["step"]] = doc
    for step, doc in _from_rows(rows).items():
        if why := value_problem(doc):
            log.warning("%s: eval row of step %d skipped (%s)", rundir.METRICS, step, why)
            continue
        docs.setdefault(step, doc)
    return [docs[s] for s in sorted(docs)]


RATES = ("acc", "acc_norm", "exact_match")
"""Metrics (and their stderrs) that are fractions, in [0, 1]."""
LARGEST = 1e15
"""Any other metric's bound either way: a perplexity past it is no score (1e308 breaks an axis)."""
MAX_FAILED_CHARS = 4000
"""A failed task's reason is shown whole up to this length (``value_problem``'s bound): its end
is usually the fix (the report wraps it; it never cuts a line)."""


def value_problem(doc: dict) -> str | None:
    """What in a scoring's values a table or chart cannot show (None: nothing): a task or
    metric name that is not printable (an ANSI escape would reach the terminal), a metric that
    is not a finite number within its range (``RATES``, ``LARGEST``), a ``chance`` outside
    [0, 1], a ``tokens`` that is not a count, a ``failed`` reason that is not printable text
    (newlines aside: the report puts it on one line)."""
    if doc.get("tokens") is not None and _count_or_none(doc["tokens"]) is None:
        return f"tokens {ascii(doc['tokens'])[:40]} is not a count"
    for task, entry in doc["tasks"].items():
        metrics = entry.get("metrics") if isinstance(entry, dict) else None
        if not is_printable_name(task) or not isinstance(metrics, dict):
            return f"task {ascii(task)[:60]}: not a printable name with its metrics"
        chance = entry.get("chance")
        if chance is not None and not (is_finite_number(chance) and 0 <= chance <= 1):
            return f"task {task}: chance {ascii(chance)[:40]} is not in [0, 1]"
        for name, x in metrics.items():
            rate = str(name).partition("/")[0].removesuffix("_stderr") in RATES
            low, high = (0, 1) if rate else (-LARGEST, LARGEST)
            if not (is_printable_name(name) and is_finite_number(x) and low <= x <= high):
                return f"task {task}: {ascii(name)[:40]} {ascii(x)[:40]} not in [{low:g}, {high:g}]"
    failed = doc.get("failed", {})
    if not isinstance(failed, dict) or not all(
        is_printable_name(k) and is_printable_name(" ".join(str(v).split()), limit=MAX_FAILED_CHARS)
        for k, v in failed.items()
    ):
        return "failed: task names and reasons that are not printable text"
    return None


def read_scores(
    run_dir: Path,
    rows: list[dict],
    *,
    metrics: dict[str, str] | None = None,
    docs: list[dict] | None = None,
) -> list[TaskScores]:
    """Each task's main metric over the run (``metrics`` picks a task's metric instead), by
    task name. ``rows``: the run's metrics rows (its train rows give a scoring's tokens when
    the document has none); ``docs``: its ``documents``, when read already."""
    docs = documents(Path(run_dir), rows) if docs is None else docs
    tokens_at = {r.get("step"): r.get("tokens") for r in rows if r.get("kind") == "train"}
    names: dict[str, set[str]] = {}
    for doc in docs:
        for task, entry in _tasks(doc).items():
            if found := _metrics(entry):  # a task with no finite metric is not listed
                names.setdefault(task, set()).update(found)
    latest_failed = _failed(docs[-1]) if docs else {}
    out = []
    for task in sorted(set(names) | set(latest_failed)):
        metric = (metrics or {}).get(task) or main_metric(names.get(task, ())) or "acc"
        scores, chance = [], None
        for doc in docs:
            entry = _tasks(doc).get(task)
            value = _metrics(entry).get(metric)
            if value is None:
                continue
            step = _count_or_none(doc.get("step"))
            tokens = _count_or_none(doc.get("tokens"))
            tokens = tokens if tokens is not None else _count_or_none(tokens_at.get(step))
            scores.append(Score(step, tokens, value, _metrics(entry).get(stderr_name(metric))))
            given = _finite_float(entry.get("chance"))
            chance = given if given is not None else chance
        failed = latest_failed.get(task)
        at = _count_or_none(docs[-1].get("step")) if failed else None
        out.append(TaskScores(task, metric, tuple(scores), chance, failed, at))
    return out


def _tasks(doc: dict) -> dict:
    tasks = doc.get("tasks")
    return {_one_line(k, 80): v for k, v in tasks.items()} if isinstance(tasks, dict) else {}


def _failed(doc: dict) -> dict[str, str]:
    failed = doc.get("failed")
    if not isinstance(failed, dict):
        return {}
    return {_one_line(k, 80): _one_line(v, MAX_FAILED_CHARS) for k, v in failed.items()}


def _one_line(text, limit: int) -> str:
    """``text`` as one line of at most ``limit`` characters (a file from elsewhere may hold
    newlines in a task name or a reason, which would break the report's lines)."""
    return " ".join(str(text).split())[:limit]


def show(score: Score) -> str:
    """``0.3125 ± 0.012``: a value and its stderr, as the report and compare print them."""
    text = f"{score.value:.4g}"
    return text + (f" ± {score.stderr:.2g}" if score.stderr is not None else "")


# -- the chart -----------------------------------------------------------------------------------

MAX_PANELS = 12
"""Panels of downstream.png (4 rows of 3); the report lists every task."""


def drawable(tasks: list[TaskScores]) -> list[TaskScores]:
    """The tasks with a score at a known number of tokens: the chart's panels."""
    return [t for t in tasks if any(s.tokens is not None for s in t.scores)]


def draw(plt, c, tasks, path: Path, name: str, parent: list[TaskScores] | None = None) -> Path:
    """downstream.png: one panel per task (``MAX_PANELS`` at most), its main metric against
    tokens seen with its stderr as error bars, the task's chance level dashed, a perplexity on
    a log axis, and a cooldown branch's parent thin and grey."""
    from anneal.observe.plot_style import SIZE, save

    shown = drawable(tasks)[:MAX_PANELS]
    cols = min(3, len(shown))
    rows = math.ceil(len(shown) / cols)
    size = (SIZE[0] if cols < 3 else 12, max(SIZE[1], 2.7 * rows + 0.8))
    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    by_task = {t.task: t for t in parent or () if t.metric}
    for ax, t in zip(axes.flat, shown, strict=False):
        theirs = by_task.get(t.task)
        if theirs is not None and theirs.metric == t.metric:
            _line(ax, theirs, color=c["clip"], style="o:", label="parent", lw=1, alpha=0.7)
        _line(ax, t, color=c["main"], style="o-", label=_text(t.metric), lw=1.5)
        if t.chance is not None and not t.lower_is_better:
            ax.axhline(t.chance, color=c["clip"], ls="--", lw=1, label=f"chance {t.chance:.3g}")
        if "perplexity" in t.metric:
            ax.set_yscale("log")
        xs = [s.tokens for s in t.scores if s.tokens is not None]
        if min(xs) > 0 and max(xs) > 4 * min(xs):  # a step-0 scoring has no place on a log axis
            ax.set_xscale("log")
        ax.set_title(_text(t.task), fontsize=10)
        ax.set_ylabel(_text(t.metric), fontsize=9)
        ax.grid(alpha=0.4, which="both")
        ax.legend(fontsize=7)
    for ax in axes.flat[len(shown) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("tokens seen")
    left = len(drawable(tasks)) - len(shown)
    more = f" ({len(shown)} of {len(shown) + left} tasks; anneal report lists all)" if left else ""
    if failed := [_text(t.task) for t in tasks if t.failed]:
        more += (
            f"\ndid not score at the latest scoring: {', '.join(failed)} (anneal report says why)"
        )
    fig.suptitle(f"{name}: downstream tasks{more}")
    return save(fig, path)


def _text(name: str) -> str:
    """A name from a document as Matplotlib's plain text (a ``$`` would start its math)."""
    return name.replace("$", r"\$")


def _line(ax, t: TaskScores, *, color: str, style: str, label: str, **kw) -> None:
    pts = [s for s in t.scores if s.tokens is not None]
    if not pts:
        return
    ax.errorbar(
        [s.tokens for s in pts],
        [s.value for s in pts],
        yerr=[s.stderr or 0.0 for s in pts],
        fmt=style,
        color=color,
        ms=4,
        capsize=2,
        label=label,
        **kw,
    )
