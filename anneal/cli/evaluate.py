"""``anneal eval TARGET --tasks SPEC,...``: score a run's checkpoint (or a Hugging Face model
directory) on lm-eval tasks, on one process or many (docs/evaluation.md, "anneal eval").

One process: ``anneal eval RUN --tasks ...``. Several ranks, on one host or many: DeepSpeed's
own runner starts the module on each, ``deepspeed [--hostfile H] --num_gpus N --no_local_rank
--module anneal.cli eval RUN --tasks ...``; every rank builds the same engine (any ZeRO stage,
tensor-parallel degree through ``--set ds.tensor_parallel.autotp_size``), scores in lockstep
(``anneal.eval.lm``), and rank 0 writes ``evals/step-<N>.json`` and the run's metrics row.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from anneal.cli import eval_watch
from anneal.cli.args import path
from anneal.errors import UserError
from anneal.files import write_atomic

DEFAULT_BATCH_SIZE = 16
"""Requests per forward call on each data-parallel replica."""
MAX_EVAL_COUNT = 10**12
"""The largest step, limit, shot count or batch size taken (a step of a run, a task's items)."""


def add_commands(sub) -> None:
    """``eval``, on the top-level subparsers ``sub``."""
    p = sub.add_parser(
        "eval",
        help="score a run's checkpoint or a Hugging Face directory on lm-eval tasks",
        description="Score a run's newest checkpoint that verifies (or --step N), one "
        "checkpoint tag directory, or a Hugging Face model directory, on loglikelihood tasks "
        "of lm-eval (names, task YAML paths, anneal_next_line). Writes RUN/evals/step-N.json "
        "and the run's metrics row (eval/<task>/<metric>). Several ranks: `deepspeed "
        "--num_gpus N --no_local_rank --module anneal.cli eval ...`. See docs/evaluation.md.",
    )
    p.add_argument(
        "target",
        metavar="TARGET",
        type=path,
        help="run directory, RUN/checkpoints/<tag>, or a Hugging Face model directory",
    )
    p.add_argument("--tasks", required=True, help="comma list of task names or YAML paths")
    p.add_argument(
        "--step", type=_bounded_count("--step", 0), help="the run's checkpoint saved at this step"
    )
    p.add_argument(
        "--limit",
        type=_bounded_count("--limit", 1),
        help="score at most this many items of each task",
    )
    p.add_argument(
        "--num-fewshot",
        type=_bounded_count("--num-fewshot", 0),
        help="demonstrations per item (task's default)",
    )
    p.add_argument(
        "--batch-size",
        type=_bounded_count("--batch-size", 1),
        default=DEFAULT_BATCH_SIZE,
        help=f"requests per forward call on each data-parallel replica ({DEFAULT_BATCH_SIZE})",
    )
    p.add_argument("--out", type=path, help="write OUT/evals/ (required for an HF directory)")
    p.add_argument("--force", action="store_true", help="replace an existing evals/step-N.json")
    p.add_argument("--ds-config", help="score under this ds_config (default: the run's own)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="ds.KEY=VALUE",
        help="override a ds_config key, e.g. ds.zero_optimization.stage=3",
    )
    p.add_argument("--tokenizer", type=path, help="the run's prepared data (default: the run's)")
    p.add_argument("--data", type=path, help="prepared data for anneal_next_line (the run's)")
    p.add_argument(
        "--samples",
        metavar="FILE",
        type=path,
        help="also write lm-eval's per-request records (JSON) to FILE",
    )
    eval_watch.add_options(p)  # --watch (anneal eval RUN --watch), from its own module
    p.set_defaults(func=_eval)


def _eval(args: argparse.Namespace) -> int:
    from anneal.dist import print0, shutdown, single_process_env
    from anneal.eval.tasks import check_specs
    from anneal.train.engine import setup_process

    specs = _specs(args.tasks)
    eval_watch.check(args)
    for note in check_specs(specs):  # before any process group or engine
        print0(note)  # a task YAML that runs Python
    overrides = _ds_overrides(args.set)
    saved_env, root = dict(os.environ), logging.getLogger()
    saved_log = (list(root.handlers), root.level)  # setup_process replaces the root handlers
    single_process_env()
    setup_process()
    try:
        if args.watch:
            return eval_watch.watch(args, specs, overrides, target_engine=target_engine)
        doc, target = run_eval(args, specs, overrides)
        _print_summary(doc, target)
    finally:
        shutdown()
        os.environ.clear()  # as it was (a command run in a test's process)
        os.environ.update(saved_env)
        root.handlers[:] = saved_log[0]
        root.setLevel(saved_log[1])
    return 1 if doc["failed"] else 0  # the others' scores are written


def run_eval(args: argparse.Namespace, specs: list[str], overrides: list[str]):
    """(the results document, the ``Target``): the target found and checked, its engine built
    on every rank, the tasks scored, the document written by rank 0. Collective."""
    from anneal.cli.eval_target import find_target
    from anneal.dist import is_main_process
    from anneal.eval.results import (
        check_out,
        check_results_file,
        check_samples_file,
        samples_text,
        write_results,
    )
    from anneal.eval.score import score_target
    from anneal.train.engine import data_replica

    target = find_target(
        Path(args.target),
        step=args.step,
        out=Path(args.out) if args.out else None,
        ds_config=args.ds_config,
        tokenizer=Path(args.tokenizer) if args.tokenizer else None,
        data=Path(args.data) if args.data else None,
    )
    check_out(target)
    check_results_file(target, force=args.force)
    if args.samples:
        check_samples_file(Path(args.samples), force=args.force, target=target)
    engine = target_engine(target, overrides)
    doc = score_target(
        engine,
        target,
        specs,
        replica=data_replica(engine),
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        samples=bool(args.samples),
    )
    samples = doc.pop("samples", None)
    if is_main_process():
        write_results(target, doc)
        if args.samples:
            write_atomic(Path(args.samples), samples_text(doc["step"], samples))
    return doc, target


def target_engine(target, overrides: list[str]):
    """The scoring engine of ``target`` on this world, its weights read by the exporter's
    verified readers (a checkpoint) or ``anneal.hf.load_weights`` (a Hugging Face
    directory). Collective."""
    from anneal.resolution import ds as ds_config
    from anneal.train.eval_engine import scoring_engine

    ds = target.ds_config
    if overrides:
        ds = ds_config.override_ds_config(
            ds, ds_config.ds_overrides(overrides), source=target.ds_source
        )
    if target.hf_dir is not None:
        from anneal.hf.load_weights import load_pretrained_

        def load(model, gather):
            load_pretrained_(model, target.hf_dir, gather=gather)

        return scoring_engine(target.preset, ds, source=target.ds_source, load_weights=load)
    from anneal.hf.expert_names import fused_loaders

    with _open_checkpoint(target) as ckpt:
        tensors = fused_loaders({s.name: s.load for s in ckpt.sources})  # a sparse run's
        from anneal.train.eval_engine import copy_weights_

        def load(model, gather):
            copy_weights_(model, tensors, gather=gather)

        return scoring_engine(target.preset, ds, source=target.ds_source, load_weights=load)


def _open_checkpoint(target):
    """The checkpoint's parameters, indexed lazily (merged over its tensor-parallel ranks'
    slices; a sparse run's experts read from their files, ``anneal.hf.autoep``), their names
    and shapes checked against the run's model."""
    from anneal import rundir
    from anneal.hf.source import open_weights, tensor_parallel_size
    from anneal.resilience.manifest import read_manifest

    tp = tensor_parallel_size(target.tag_dir, read_manifest(target.tag_dir))
    return open_weights(target.tag_dir, tp, target.preset, rundir.config_path(target.run_dir))


def _specs(tasks: str) -> list[str]:
    specs = [s.strip() for s in tasks.split(",") if s.strip()]
    if not specs:
        raise UserError("--tasks: name at least one task (e.g. --tasks anneal_next_line).")
    return specs


def _bounded_count(flag: str, low: int):
    """``type`` of a whole-number flag: ``low`` to ``MAX_EVAL_COUNT``, checked as argparse reads it
    (a UserError, one paragraph), so no later slice or range sees a number it cannot take."""

    def count(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or not low <= number <= MAX_EVAL_COUNT:
            raise UserError(
                f"{flag} {value[:40]}: give a whole number from {low} to {MAX_EVAL_COUNT:,}."
            )
        return number

    count.__name__ = "count"
    return count


def _ds_overrides(items: list[str]) -> list[str]:
    """The ``--set`` items: DeepSpeed keys only (the model is the checkpoint's)."""
    for item in items:
        key, eq, _ = item.partition("=")
        if not eq or not key.startswith("ds."):
            raise UserError(
                f"--set {item}: anneal eval takes ds_config keys only (ds.KEY=VALUE, e.g. "
                f"ds.zero_optimization.stage=3 or ds.tensor_parallel.autotp_size=2); the model "
                f"and its weights are the checkpoint's."
            )
    return list(items)


def _print_summary(doc: dict, target) -> None:
    """One line per task and metric, then the tasks that failed (rank 0)."""
    from anneal.dist import print0
    from anneal.observe.downstream import RATES

    where = target.tag_dir or target.hf_dir
    lines = [f"scored {where} (step {doc['step']}) in {doc.get('seconds') or 0:.1f} s"]
    lines.append(f"{'task':<28} {'metric':<16} {'value':>12} {'stderr':>12} {'chance':>8}")
    for task, entry in sorted(doc.get("tasks", {}).items()):
        metrics, chance = entry["metrics"], entry.get("chance")
        for name in sorted(m for m in metrics if not m.endswith("_stderr")):
            err = metrics.get(f"{name}_stderr")
            shown = f"{err:>12.6g}" if err is not None else f"{'':>12}"
            rate = name in RATES and chance is not None  # chance is a rate's
            shown += f" {chance:>8.3g}" if rate else ""
            lines.append(f"{task:<28} {name:<16} {metrics[name]:>12.6g} {shown}".rstrip())
    for task, why in sorted(doc.get("failed", {}).items()):
        lines.append(f"{task:<28} failed: {why}")
    print0("\n".join(lines))
