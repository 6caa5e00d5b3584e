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
``read_evals``); ``write_results`` writes a scoring's document and row. ``anneal eval`` writes
only where it may: ``check_out`` claims ``--out`` as ``anneal export`` claims its own (never
another run, a checkpoint, an input, ``.``), ``check_results_file`` lets ``--force`` replace
only this run's own document of the step, and ``check_samples_file`` lets ``--samples`` replace
only a file that ``samples_text`` wrote (its first key, ``SAMPLES_MARK``), never inside a
checkpoint or an input.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from anneal import rundir
from anneal.errors import UserError
from anneal.files import claim_output, read_regular
from anneal.resilience.manifest import MANIFEST
from anneal.rundir import holds_run


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


def _resolved_path(path) -> Path:
    return Path(os.path.realpath(path))


def _scored_in_place(target) -> bool:
    """Whether ``target``'s scores go into its own run (no ``--out``, or ``--out RUN``)."""
    run = target.run_dir
    return run is not None and _resolved_path(target.results_dir) == _resolved_path(run)


def _inputs(target) -> list[Path]:
    """What ``anneal eval`` reads of ``target``: never written into."""
    run = target.run_dir
    found = [target.tag_dir, target.hf_dir, target.data_dir, target.tokenizer_dir]
    found += [rundir.checkpoints_dir(run), rundir.config_path(run)] if run is not None else []
    return [Path(p) for p in found if p is not None]


def _in_a_checkpoint(path: Path, *, or_run: bool = True) -> Path | None:
    """The run that ``path`` is (``anneal.rundir.holds_run``; with ``or_run``), or the
    checkpoints directory or checkpoint (a manifest) that it is or lies in; None for none."""
    real = _resolved_path(path)
    if or_run and real.is_dir() and holds_run(real):
        return real
    for p in [real, *real.parents]:
        if p.name == rundir.CHECKPOINTS or (p / MANIFEST).is_file():
            return p
    return None


def check_out(target) -> None:
    """``--out`` (``target.results_dir`` other than its run), claimed as ``anneal export``
    claims its own (``anneal.files.claim_output``, scores added beside what is there): never
    ``.``, one of its parents or the root, an input (the checkpoint, the prepared data, the
    tokenizer, a Hugging Face directory), a run or a checkpoint (one run's scores are never
    filed under another's), nor inside the run scored (its scores go to its own ``evals/``)."""
    out, run = Path(target.results_dir), target.run_dir
    if _scored_in_place(target):
        return
    if run is not None and _resolved_path(out).is_relative_to(_resolved_path(run)):
        raise UserError(
            f"--out {out}: lies inside the run {run}, whose scores go to its own "
            f"{rundir.evals_dir(run)}: drop --out for that, or name a directory outside the run.",
            every_rank=True,
        )
    if (held := _in_a_checkpoint(out)) is not None:
        where = "is" if held == _resolved_path(out) else "lies in"
        raise UserError(
            f"--out {out}: {where} {held}, a run or its "
            f"checkpoints, and one run's scores are never filed under another's (anneal report "
            f"would show them as its own). Name a directory of their own for these scores.",
            every_rank=True,
        )
    try:
        claim_output(out, in_place=True, what="scores", inputs=_inputs(target))
    except UserError as e:
        raise UserError(str(e), every_rank=True) from None


def check_results_file(target, *, force: bool) -> None:
    """An ``evals/step-<N>.json`` already there is kept unless ``--force``, and replaced then
    only when it is this run's own document of the step (``anneal.rundir.read_eval``): any in
    the run's own ``evals/``; under ``--out``, one that names a checkpoint of this run (a
    Hugging Face directory's: one of a Hugging Face directory)."""
    existing = rundir.eval_path(target.results_dir, target.step)
    if not (existing.exists() or existing.is_symlink()):
        return
    if not force:
        raise UserError(
            f"{existing}: step {target.step} is scored already. Read it, or pass --force to "
            f"score it again and replace it.",
            every_rank=True,
        )
    doc = rundir.read_eval(target.results_dir, target.step)
    if doc is None:
        raise UserError(
            f"{existing}: --force replaces only scores that anneal eval wrote, and this is not "
            f"one (not such a JSON document, or a link). Move it away first.",
            every_rank=True,
        )
    named = doc.get("checkpoint")
    if target.hf_dir is not None:
        ours = doc.get("source") == "hf"
    else:
        ours = isinstance(named, str) and _resolved_path(
            rundir.of_checkpoint(named)
        ) == _resolved_path(target.run_dir)
    if ours or _scored_in_place(target):
        return
    raise UserError(
        f"{existing}: --force replaces only this run's own scores of step {target.step}, and "
        f"these are of {named or 'another model'}. Name another --out for these scores.",
        every_rank=True,
    )


SAMPLES_MARK = "per-request records written by anneal eval --samples"
"""The first key's value of a ``--samples`` file (``samples_text``): what ``--force`` replaces."""
_SAMPLES_HEAD = json.dumps({"anneal": SAMPLES_MARK})[:-1].encode()


def samples_text(step: int, samples: dict) -> str:
    """The ``--samples`` file: ``{"anneal": SAMPLES_MARK, "samples": {task: [records]},
    "step": N}``, its mark first."""
    doc = {"anneal": SAMPLES_MARK, "samples": samples, "step": step}
    return json.dumps(doc, default=str, sort_keys=True) + "\n"


def check_samples_file(path: Path, *, force: bool, target) -> None:
    """``--samples FILE`` lies outside what ``anneal eval`` reads (a checkpoint, a run's
    checkpoints, the prepared data, the tokenizer, a Hugging Face directory) and is new, or
    (with ``--force``) a file that an earlier ``--samples`` wrote (``SAMPLES_MARK``, first)."""
    inside = [i for i in _inputs(target) if _resolved_path(path).is_relative_to(_resolved_path(i))]
    held = _in_a_checkpoint(path.parent, or_run=False)
    if inside or (inside := [held] if held is not None else []):
        raise UserError(
            f"--samples {path}: lies inside {inside[0]}, which anneal eval reads and never writes "
            f"into. Give a path outside the checkpoints and the inputs.",
            every_rank=True,
        )
    if not (path.exists() or path.is_symlink()):
        return
    try:
        ours = force and read_regular(path, limit=len(_SAMPLES_HEAD), head=True) == _SAMPLES_HEAD
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise UserError(
            f"--samples {path}: the file exists. Give a new name, or --force to replace the "
            f"records an earlier --samples wrote there (only such a file: it begins with "
            f"{_SAMPLES_HEAD.decode()}).",
            every_rank=True,
        )
