"""``anneal compare RUN...``: runs side by side, as the cooldown branches of one parent
(``anneal.resolution.cooldown``) are compared to choose the one to keep.

Each run's final validation (``val_loss`` and ``val_bpb`` of its last validation row) and its
latest downstream scores (each task's main metric with its stderr,
``anneal.observe.downstream``), one row per figure and one column per run; the best of each row
is marked ``*`` (the lowest loss, bits per byte or perplexity, the highest score otherwise), and
the last lines say which run wins on what. A win on a downstream task by no more than
``CLEAR_WIN_STDERR`` standard errors of the difference (sqrt(se1^2 + se2^2)) is said to be no
clear win. Reads the runs' files only; writes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from anneal import rundir
from anneal.errors import UserError
from anneal.json_values import is_finite_number
from anneal.observe import downstream
from anneal.observe.downstream import Score, TaskScores
from anneal.run_record import RunRecord

CLEAR_WIN_STDERR = 2.0
MISSING = "-"
VALIDATION = ("val_loss", "val_bpb")


@dataclasses.dataclass(frozen=True)
class RunScores:
    """One run's column: its label, directory, config.json, final validation and tasks."""

    label: str
    path: Path
    record: RunRecord
    val: dict[str, Score]
    tasks: dict[str, TaskScores]


@dataclasses.dataclass(frozen=True)
class Row:
    """One figure across the runs: its name, whether lower is better, each run's score."""

    name: str
    lower_is_better: bool
    scores: dict[str, Score]
    failed: tuple[str, ...] = ()
    """The labels of the runs whose latest scoring did not score this task."""

    def best(self) -> list[str]:
        """The labels of the runs with the best score (more than one on a tie)."""
        if not self.scores:
            return []
        pick = min if self.lower_is_better else max
        top = pick(s.value for s in self.scores.values())
        return [label for label, s in self.scores.items() if s.value == top]


def load(paths: list[Path]) -> list[RunScores]:
    """The runs at ``paths``, each read once: a path that is not a run (no readable
    config.json), a run named twice, or fewer than two runs are a UserError."""
    if len(paths) < 2:
        raise UserError(
            f"anneal compare needs two or more runs to set side by side (got {len(paths)}): "
            f"e.g. the cooldown branches of one parent, anneal compare RUN_A RUN_B."
        )
    seen: dict[Path, Path] = {}
    for p in paths:
        if p.resolve() in seen:
            raise UserError(f"{p}: the same run as {seen[p.resolve()]}; name each run once.")
        seen[p.resolve()] = p
    names = [p.resolve().name for p in paths]
    labels = [n if names.count(n) == 1 else str(p) for n, p in zip(names, paths, strict=True)]
    read = [
        (label, p, rundir.read_record(p), _metrics_rows(p))
        for label, p in zip(labels, paths, strict=True)
    ]
    docs = {label: downstream.documents(p, rows) for label, p, _, rows in read}
    first = {label: downstream.read_scores(p, rows, docs=docs[label]) for label, p, _, rows in read}
    tasks = {t.task for scores in first.values() for t in scores}
    metric = {
        task: downstream.main_metric(
            {t.metric for s in first.values() for t in s if t.task == task}
        )
        for task in tasks
    }
    return [
        RunScores(
            label,
            p,
            record,
            _final_validation(rows),
            {t.task: t for t in downstream.read_scores(p, rows, metrics=metric, docs=docs[label])},
        )
        for label, p, record, rows in read
    ]


def _metrics_rows(run: Path) -> list[dict]:
    """The run's metrics rows; none for a run that has not written its metrics.jsonl yet."""
    return rundir.read_metrics(run) if rundir.metrics_path(run).is_file() else []


def _final_validation(rows: list[dict]) -> dict[str, Score]:
    """``val_loss`` and ``val_bpb`` of the last validation row that has a finite loss."""
    val = [r for r in rows if r.get("kind") == "val" and is_finite_number(r.get("val_loss"))]
    if not val:
        return {}
    last = val[-1]
    step = last.get("step") if isinstance(last.get("step"), int) else -1
    return {
        k: Score(step, None, float(last[k]), None)
        for k in VALIDATION
        if is_finite_number(last.get(k))
    }


def table_rows(runs: list[RunScores]) -> list[Row]:
    """val_loss, val_bpb, then each task's main metric (tasks by name); a row may be empty."""
    rows = [
        Row(key, True, {r.label: r.val[key] for r in runs if key in r.val}) for key in VALIDATION
    ]
    for task in sorted({t for r in runs for t in r.tasks}):
        metric = next(r.tasks[task].metric for r in runs if task in r.tasks)
        latest = {r.label: _latest(r.tasks.get(task)) for r in runs}
        scores = {label: s for label, s in latest.items() if s is not None}
        failed = tuple(r.label for r in runs if task in r.tasks and r.tasks[task].failed)
        rows.append(Row(f"{task} {metric}", downstream.lower_is_better(metric), scores, failed))
    return rows


def _latest(t: TaskScores | None) -> Score | None:
    return t.scores[-1] if t is not None and t.scores else None


def format_compare(runs: list[RunScores]) -> str:
    """The runs' lineage, the table (the best of each row marked ``*``) and who wins on what."""
    rows = [row for row in table_rows(runs) if row.scores or row.failed]
    lines = [f"compare {len(runs)} runs: {_parentage(runs)}"]
    width = max(len(r.label) for r in runs)
    for r in runs:
        lines.append(f"  {r.label:<{width}}  {r.path}: {_about(r)}")
    if not rows:
        return "\n".join([*lines, "  none of them has a validation or downstream score yet"])
    cells = {(row.name, r.label): _cell(row, r) for row in rows for r in runs}
    first = max(len(row.name) for row in rows)
    widths = {
        r.label: max([len(r.label), *(len(cells[row.name, r.label]) for row in rows)]) for r in runs
    }
    header = "".join(f"  {r.label:<{widths[r.label]}}" for r in runs)
    lines.append(f"  {'':<{first}}{header}".rstrip())
    for row in rows:
        line = "".join(f"  {cells[row.name, r.label]:<{widths[r.label]}}" for r in runs)
        lines.append(f"  {row.name:<{first}}{line}".rstrip())
    lines.append(
        "  * the best of its row: the lowest loss, bits per byte or perplexity, the highest "
        "score otherwise"
    )
    lines += [f"  {line}" for line in wins(rows, [r.label for r in runs])]
    lines += [
        f"  {label}: {row.name.rpartition(' ')[0]} did not score at its latest scoring "
        f"(anneal report {next(r.path for r in runs if r.label == label)} says why)"
        for row in rows
        for label in row.failed
    ]
    return "\n".join(lines)


def _cell(row: Row, run: RunScores) -> str:
    score = row.scores.get(run.label)
    if score is None:
        return "failed" if run.label in row.failed else MISSING
    shown = f"{score.value:.4f}" if row.name in VALIDATION else downstream.show(score)
    text = shown + ("*" if run.label in row.best() else "")
    newest = max((s.step for t in run.tasks.values() for s in t.scores), default=score.step)
    return text if row.name in VALIDATION or score.step == newest else f"{text} @{score.step}"


def wins(rows: list[Row], labels: list[str]) -> list[str]:
    """One line per run: the rows it is best on, a tie, a win within ``CLEAR_WIN_STDERR``
    stderr of the runner-up, or a row that only it has, said so."""
    won: dict[str, list[str]] = {label: [] for label in labels}
    said: dict[str, list[str]] = {label: [] for label in labels}  # each with its own clause
    for row in rows:
        best = row.best()
        for label in best:
            how = _how(row, label, best)
            if how:
                said[label].append(how)
            else:
                won[label].append(row.name)
    return [
        f"{label} wins on {', '.join(won[label]) or 'nothing'}"
        + "".join(f"; {h}" for h in said[label])
        for label in labels
    ]


def _how(row: Row, label: str, best: list[str]) -> str:
    """A best that is not a plain win, as a clause of its own about that row alone (empty: a
    plain win): the only run with the row, a tie, or a lead within the stderr."""
    others = [k for k in row.scores if k not in best]
    if len(row.scores) == 1:
        return f"only it has {row.name}"
    if len(best) > 1:
        return f"ties on {row.name} with {', '.join(k for k in best if k != label)}"
    pick = min if row.lower_is_better else max
    runner = pick(others, key=lambda k: row.scores[k].value)
    a, b = row.scores[label], row.scores[runner]
    if a.stderr is None or b.stderr is None:
        return ""
    if abs(a.value - b.value) <= CLEAR_WIN_STDERR * math.hypot(a.stderr, b.stderr):
        return f"no clear win on {row.name} (within {CLEAR_WIN_STDERR:g} stderr of {runner})"
    return ""


def _parentage(runs: list[RunScores]) -> str:
    """Whether the runs are cooldown branches of one parent, and of which."""
    parents = {
        str(Path(r.record.parent_run).resolve()) if r.record.parent_run else None for r in runs
    }
    if len(parents) == 1 and None not in parents:
        return f"cooldown branches of {parents.pop()}"
    if parents == {None}:
        return "none of them a cooldown branch; compared as they are"
    return "not all cooldown branches of one parent; compared as they are"


def _about(run: RunScores) -> str:
    """Where a run comes from and the steps its figures are from."""
    branch = run.record.cooldown
    if branch is not None:
        length = f"{branch.get('cooldown_steps')} steps of cooldown"
        where = f"branch at step {branch.get('step')} ({length})"
    else:
        where = "not a cooldown branch"
    val = run.val.get("val_loss")
    steps = [s.step for t in run.tasks.values() for s in t.scores]
    return (
        f"{where}; last validation at step {val.step if val else MISSING}, "
        f"downstream at step {max(steps) if steps else MISSING}"
    )
