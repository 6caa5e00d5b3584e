"""One scoring: every loaded task through lm-eval's own evaluator over a model (``EngineLM``),
into the results document of ``anneal.eval.results``.

Each task is evaluated on its own (``lm_eval.evaluator.evaluate``), so a task that raises is
recorded in ``failed`` and the others still score; since every rank builds the same requests, a
task fails at the same point on every rank, before any forward call that another rank would wait
on. ``evaluate`` is called directly, not ``simple_evaluate``, which seeds python's, numpy's and
torch's global generators (lm-eval's defaults 0 and 1234) and would change a training run's
random stream; ``score`` also puts back every generator state it found (python, numpy, torch's
CPU and CUDA ones), whatever lm-eval or a task did in between, and the engine's train mode.

``Target`` is what ``anneal eval`` scores (found by ``anneal.cli.eval_target``), and
``score_target`` scores one on its engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import logging
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from anneal.eval.results import metrics_of
from anneal.model import ModelPreset

log = logging.getLogger(__name__)

BOOTSTRAP_ITERS = 1000
"""Resamples for the standard error of a metric that has no closed form (lm-eval bootstraps
perplexity, median, F1; accuracy's stderr is closed-form): lm-eval's command line takes
100,000, minutes of CPU per task on every rank; 1,000 give the stderr to a few percent. They run
in this process (lm-eval's ``DISABLE_MULTIPROC``), never in a pool forked from a rank that holds
process groups and device memory."""


def lm_eval_version() -> str:
    return importlib.metadata.version("lm_eval")


def score(
    lm,
    loaded,
    *,
    step: int,
    tokens: int | None,
    limit: int | float | None,
    num_fewshot: int | None,
    source: str,
    checkpoint: Path | None = None,
    manifest_sha256: str | None = None,
    samples: bool = False,
) -> dict:
    """Score every task of ``loaded`` (``anneal.eval.tasks.LoadedTasks``: ``tasks``, ``info``,
    ``failed``) with ``lm``; return the results document (``anneal.eval.results``) for
    ``step``. Collective: every rank calls it with the same tasks, and gets the same document.
    With ``samples``, the document also holds lm-eval's per-request records under
    ``"samples"`` (``{task: [{"doc_id", "resps", "filtered_resps", "target", ...}]}``), for
    tests and debugging; the document written to ``RUN/evals/`` never has them."""
    engine = getattr(lm, "engine", None)
    # DeepSpeed's engine.eval() and train() set its module's flag, never the engine's own
    training = getattr(engine, "module", engine).training if engine is not None else None
    tokens_before = getattr(lm, "tokens_scored", 0)
    start = time.perf_counter()
    doc = {
        "step": step,
        "tokens": tokens,
        "source": source,
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "manifest_sha256": manifest_sha256,
        "lm_eval_version": lm_eval_version(),
        "tasks": {},
        "failed": dict(loaded.failed),
    }
    logged = {}
    with rng_restored(), _bootstrap_in_process():
        try:
            for name, task in loaded.tasks.items():
                try:
                    out = _evaluate_one(lm, name, task, limit)
                except Exception as e:  # noqa: BLE001 - a task's failure is never fatal
                    log.warning("eval task %s failed: %s", name, _first_line(e))
                    doc["failed"][name] = _first_line(e)
                    continue
                doc["tasks"][name] = _task_entry(out, name, loaded.info.get(name, {}), limit)
                if num_fewshot is not None and doc["tasks"][name]["num_fewshot"] is None:
                    doc["tasks"][name]["num_fewshot"] = num_fewshot
                logged[name] = out.get("samples", {}).get(name, [])
        finally:
            if training is not None:
                engine.train(training)
    seconds = time.perf_counter() - start
    scored = getattr(lm, "tokens_scored", 0) - tokens_before
    doc |= {
        "seconds": round(seconds, 3),
        "tokens_scored": scored,
        "tokens_per_s": round(scored / seconds, 1) if seconds > 0 else None,
    }
    if samples:
        doc["samples"] = logged
    return doc


def _evaluate_one(lm, name: str, task, limit) -> dict:
    from lm_eval.evaluator import evaluate

    out = evaluate(
        lm,
        {"tasks": {name: task}, "groups": {}, "group_map": {}},
        limit=limit,
        log_samples=True,
        bootstrap_iters=BOOTSTRAP_ITERS,
    )
    if not out or name not in out.get("results", {}):
        raise RuntimeError(f"lm-eval returned no results for {name}")
    return out


def _task_entry(out: dict, name: str, info: dict, limit) -> dict:
    """One task's entry of the document from lm-eval's output."""
    n = out.get("n-samples", {}).get(name, {})
    shots = out.get("n-shot", {}).get(name)
    return {
        "metrics": metrics_of(out["results"][name]),
        "chance": info.get("chance"),
        "config_sha256": info.get("config_sha256"),
        "num_fewshot": shots,
        "limit": limit,
        "n_samples": n.get("effective", n.get("original")),
    }


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@contextlib.contextmanager
def rng_restored():
    """Put back python's, numpy's and torch's (CPU and every CUDA device's) generator states
    on the way out, whatever happened inside. ``score`` runs in it; loading tasks needs it too
    where a random stream must not move: lm-eval's ``TaskManager.load`` draws from python's
    generator (seen in 0.4.13: the state differs after loading one local YAML task)."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def _bootstrap_in_process():
    """lm-eval's bootstrap without its process pool (``BOOTSTRAP_ITERS``)."""
    before = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = before


@dataclasses.dataclass(frozen=True)
class Target:
    """One model to score and where its scores go."""

    source: str
    """``"checkpoint"`` (a run's tag directory) or ``"hf"`` (a Hugging Face directory)."""
    preset: ModelPreset
    ds_config: dict
    """The run's resolved ds_config (a checkpoint), or the --ds-config file's; before the
    --set overrides and the live world (``anneal.train.eval_engine.scoring_ds_config``)."""
    ds_source: str
    step: int
    tokens: int | None
    tokenizer_dir: Path
    data_dir: Path | None
    """The prepared data the run trained on (the shipped task reads its val split), if known."""
    results_dir: Path
    """The run directory (or ``--out``): its ``evals/step-<N>.json``."""
    run_dir: Path | None = None
    tag_dir: Path | None = None
    manifest_sha256: str | None = None
    hf_dir: Path | None = None


def score_target(
    engine, target: Target, specs, *, replica, limit, num_fewshot, batch_size, samples=False
) -> dict:
    """The results document of ``target``'s engine on ``specs`` (``score``; with ``samples``,
    lm-eval's per-request records under ``"samples"``). ``replica``: the engine's data-parallel
    replica (``anneal.train.engine.data_replica``). Collective: every rank builds the same
    tasks and requests."""
    from anneal.eval.lm import EngineLM
    from anneal.eval.tasks import load_tasks

    with tempfile.TemporaryDirectory(prefix="anneal-eval-") as work:
        loaded = load_tasks(
            specs,
            data_dir=target.data_dir,
            work_dir=Path(work),
            num_fewshot=num_fewshot,
            limit=limit,
        )
        lm = EngineLM(
            engine,
            target.tokenizer_dir,
            replica=replica,
            batch_size=batch_size,
            max_length=target.preset.seq_len,
        )
        return score(
            lm,
            loaded,
            step=target.step,
            tokens=target.tokens,
            limit=limit,
            num_fewshot=num_fewshot,
            source=target.source,
            checkpoint=target.tag_dir,
            manifest_sha256=target.manifest_sha256,
            samples=samples,
        )
