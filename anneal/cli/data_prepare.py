"""What ``anneal data prepare`` prints, and ``anneal data prepare --tasks N [--task I |
--merge]``: a preparation split into tasks, run by hand or by any scheduler (``python -m
launcher submit-prepare`` for Slurm); see :mod:`anneal.data.task_split` and docs/data.md, "Preparing
tens of terabytes"."""

from __future__ import annotations

import argparse
from pathlib import Path

from anneal.errors import UserError


def print_prepared(out: str, meta: dict) -> None:
    """What ``anneal data prepare`` (or its merge step) prints: the splits and, for a blend,
    each source."""
    from anneal.data.checks import unigram_entropy_bits_per_byte

    splits = meta["splits"]
    skipped = meta["skipped"]
    baseline_split = "val" if splits["val"]["tokens"] else "train"
    print(
        f"prepared {out}: vocab {meta['vocab_size']} ({meta['dtype']}), "
        f"train {splits['train']['tokens']:,} tokens / {splits['train']['documents']} docs, "
        f"val {splits['val']['tokens']:,} tokens / {splits['val']['documents']} docs, "
        f"in {meta['seconds']} s; unigram baseline "
        f"{unigram_entropy_bits_per_byte(Path(out), baseline_split):.3f} bits/byte "
        f"({baseline_split})"
        + (f"; skipped {skipped['records']} bad records" if skipped["records"] else "")
        + (f", {skipped['empty_files']} empty files" if skipped["empty_files"] else "")
    )
    if len(meta["sources"]) > 1:  # a blend: what each source holds, validation included
        for source in meta["sources"]:
            train, val = (splits[s]["sources"][source["name"]] for s in ("train", "val"))
            print(
                f"  {source['name']}: train {train['tokens']:,} tokens / {train['documents']} "
                f"docs, val {val['tokens']:,} tokens / {val['documents']} docs"
            )


def prepare_in_tasks(cfg, args: argparse.Namespace) -> int:
    from anneal.data.task_split import parts_dir

    if args.task is not None and args.merge:
        raise UserError("--task and --merge: give one (a task's share, or the merge after all).")
    parts = parts_dir(cfg.out)
    if args.merge:
        return _merge_parts(cfg, args)
    if args.tasks is None:
        raise UserError(
            f"--task {args.task}: give --tasks N too (the plan's count), e.g. --task "
            f"{args.task} --tasks 8."
        )
    if args.task is not None:
        return _task(cfg, args, parts)
    from anneal.data.task_split import make_split

    plan, made = make_split(cfg, args.tasks)
    units = sum(plan["units"]["per_source"])
    empty = sum(1 for a, b in plan["ranges"] if a == b)
    print(
        f"{'wrote' if made else 'kept (same flags and inputs)'} the plan of {args.tasks} tasks: "
        f"{parts / 'plan.json'}, {units:,} work unit{'s' if units != 1 else ''}, "
        f"{plan['units']['bytes'] / 1e6:,.1f} MB, "
        f"tokenizer {plan['tokenizer']['sha256'][:12]}..."
        + (f"; {empty} of the tasks get no unit (more tasks than units)" if empty else "")
    )
    print(
        f"next: the same command with --task I for I in 0..{args.tasks - 1} (in any order, "
        f"on any machine that sees these paths), then with --merge"
    )
    return 0


def _task(cfg, args, parts) -> int:
    from anneal.data.part import run_task

    done = run_task(cfg, args.task, args.tasks)
    where = parts / f"task-{args.task:05d}"
    if not done["again"]:
        print(f"task {args.task} of {args.tasks}: complete already ({where}); not run again")
        return 0
    print(
        f"task {args.task} of {args.tasks}: {done['units']:,} "
        f"unit{'s' if done['units'] != 1 else ''}, "
        f"{done['input_bytes'] / 1e6:,.1f} MB, {done['tokens']:,} tokens in {done['seconds']} s "
        f"({done['workers']} worker{'s' if done['workers'] != 1 else ''}) -> {where}"
    )
    return 0


def _merge_parts(cfg, args) -> int:
    from anneal.data.merge import merge

    meta = merge(cfg, args.tasks)
    print_prepared(str(args.out), meta)
    print(
        f"merged {len(meta['tasks'])} tasks: {meta['merge_bytes'] / 1e6:,.1f} MB in "
        f"{meta['merge_seconds']} s, verified in {meta['verify_seconds']} s; content sha256 "
        f"{meta['content_sha256']}"
    )
    return 0
