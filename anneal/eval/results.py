"""One scoring of one step: the document ``RUN/evals/step-<N>.json`` and its metrics row.

The document (written whole, atomically, by rank 0)::

    {"step": N, "tokens": T,
     "source": "loop" | "checkpoint" | "hf",      # live weights in the loop, a tag, an HF dir
     "checkpoint": "RUN/checkpoints/<tag>" | null, "manifest_sha256": "<hex>" | null,
     "lm_eval_version": "0.4.13",
     "tasks": {"<task>": {"metrics": {"acc": 0.31, "acc_stderr": 0.02, ...},
                          "chance": 0.25 | null, "config_sha256": "<hex>",
                          "num_fewshot": 0, "limit": 200 | null, "n_samples": 200}},
     "failed": {"<task>": "<one line: why it did not score>"},
     "seconds": 12.3, "tokens_scored": 45678, "tokens_per_s": 3712.0}

Metric names are lm-eval's without its ``,none`` filter suffix (``acc``, ``acc_norm``,
``acc_stderr``, ``word_perplexity``); a metric under another filter keeps it after a slash
(``acc/strict``). The metrics row is ``{"kind": "eval", "step", "tokens",
"eval/<task>/<metric>": value, ..., "eval_s"}``, one per scoring, besides the train and val rows.

The file itself is the run directory's (``anneal.rundir.write_eval``, ``read_eval``,
``read_evals``); ``write_results`` writes a scoring's document and row, and
``check_results_file`` and ``check_samples_file`` keep ``anneal eval`` from replacing a file
that it did not write.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from anneal import rundir
from anneal.errors import UserError


def metric_name(key: str) -> str | None:
    """lm-eval's result key (``acc,none``, ``acc_stderr,none``) as Anneal names the metric;
    None for what is not a metric (``alias``, ``samples``)."""
    if "," not in key:
        return None
    name, filt = key.split(",", 1)
    return name if filt == "none" else f"{name}/{filt}"


def metrics_of(lm_eval_result: dict) -> dict[str, float]:
    """One task's metrics from lm-eval's ``results[task]`` (numbers only; an undefined stderr,
    lm-eval's ``"N/A"``, is left out)."""
    out = {}
    for key, value in lm_eval_result.items():
        name = metric_name(key)
        if name is not None and isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def metrics_row(doc: dict) -> dict:
    """The metrics row of a scoring: every finite metric of every task as
    ``eval/<task>/<metric>``, against the step and tokens."""
    row = {"kind": "eval", "step": doc["step"], "tokens": doc.get("tokens")}
    for task, entry in sorted(doc.get("tasks", {}).items()):
        for name, value in sorted(entry["metrics"].items()):
            if math.isfinite(value):
                row[f"eval/{task}/{name}"] = value
    row["eval_s"] = doc.get("seconds")
    return row


def write(run_dir: Path, doc: dict) -> Path:
    """``RUN/evals/step-<N>.json``, replaced whole (a reader never sees a part): the run
    directory's owner (``anneal.rundir.write_eval``) writes it."""
    return rundir.write_eval(run_dir, doc)


def write_results(target, doc: dict) -> Path:
    """``evals/step-<N>.json`` under the target's results directory; for a run scored in place,
    its metrics row too (metrics.jsonl and TensorBoard). Rank 0."""
    from anneal.observe.metrics import MetricsLogger

    path = write(target.results_dir, doc)
    if target.run_dir is not None and target.results_dir == target.run_dir:
        metrics = MetricsLogger(target.run_dir)
        try:
            metrics.write(metrics_row(doc))
        finally:
            metrics.close()
    return path


def check_results_file(target, *, force: bool) -> None:
    """An ``evals/step-<N>.json`` already there is kept unless ``--force``, and replaced then
    only when it is a document ``anneal eval`` writes (never another file under its name)."""
    existing = rundir.eval_path(target.results_dir, target.step)
    if not (existing.exists() or existing.is_symlink()):
        return
    if not force:
        raise UserError(
            f"{existing}: step {target.step} is scored already. Read it, or pass --force to "
            f"score it again and replace it.",
            every_rank=True,
        )
    if rundir.read_eval(target.results_dir, target.step) is None:
        raise UserError(
            f"{existing}: --force replaces only scores that anneal eval wrote, and this is not "
            f"one (not such a JSON document, or a link). Move it away first.",
            every_rank=True,
        )


def check_samples_file(path: Path, *, force: bool) -> None:
    """``--samples FILE`` is new, or (with ``--force``) records that ``--samples`` wrote: a
    JSON object of lists, never another file under its name."""
    if not (path.exists() or path.is_symlink()):
        return
    try:
        doc = json.loads(path.read_text()) if force and path.is_file() else None
    except (OSError, ValueError, RecursionError):
        doc = None
    if not (isinstance(doc, dict) and all(isinstance(v, list) for v in doc.values())):
        raise UserError(
            f"--samples {path}: the file exists. Give a new name, or --force to replace the "
            f"records an earlier --samples wrote there (only such a file).",
            every_rank=True,
        )
