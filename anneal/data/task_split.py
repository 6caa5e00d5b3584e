"""A preparation split into tasks (docs/data.md, "Preparing tens of terabytes"): the task split
("the plan step", its file ``plan.json``; not the Chinchilla planner of ``anneal plan``).

``anneal data prepare ... --tasks N`` runs in three steps, by hand, over ssh, or as Slurm jobs
(``python -m launcher submit-prepare``):

1. the plan (this module): the inputs listed and cut into work units, the tokenizer trained
   (or installed) once, and ``OUT.parts/plan.json`` written last: the settings, every input
   file with its size and mtime, the units' count and hash, the range of units of each task
   and the tokenizer's hashes. Nothing is pickled: each step reads this JSON and its own
   command line, and refuses to go on when they disagree.
2. ``--task I`` (:mod:`anneal.data.part`): tokenizes and packs the units of task I into
   ``OUT.parts/task-0000I/``, then writes its completion marker ``task-0000I.done.json``.
3. ``--merge`` (:mod:`anneal.data.merge`): writes OUT, byte for byte the directory one node
   writes, verifies it, and removes the parts.

Tasks take contiguous ranges of the global unit order (sources in order, each source's units
in order) of about equal input bytes, so one large file spreads over every task as well as many
small ones do, and each (split, source)'s ids of a task follow those of the task before.

```
OUT.parts/
  .anneal-prepare-parts   marker: made by this command (what --force may replace)
  plan.json               the plan (written last by step 1)
  tokenizer/              the tokenizer's files and token_bytes.npy
  task-00000/             task 0's part: train/ and val/ as a prepared directory's, one shard
                          per (split, source), and part.json (counts and sha256 of each file)
  task-00000.done.json    the completion marker: the plan's and part.json's sha256
  slurm/                  the batch scripts and their logs (submit-prepare)
```
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from anneal.data import tokenizer
from anneal.data.make_tokenizer import make_tokenizer
from anneal.data.prepare_config import PrepareConfig
from anneal.data.prepared_dir import TOKEN_BYTES, PreparedDir
from anneal.data.readers import Problems
from anneal.data.sources import Source, parse_inputs
from anneal.data.units import input_files, listing_sha256, unit_list
from anneal.errors import UserError
from anneal.files import make_dir, sha256_file, write_atomic

log = logging.getLogger(__name__)

SPLIT_FILE = "plan.json"
PARTS_MARKER = ".anneal-prepare-parts"
TOKENIZER = "tokenizer"
SPLIT_VERSION = 1
MAX_TASKS = 100_000

SETTING_FLAGS = {
    "inputs": "--input",
    "vocab_size": "--vocab-size",
    "model_type": "--model-type",
    "tokenizer": "--tokenizer",
    "tokenizer_sample_mb": "--tokenizer-sample-mb",
    "val_fraction": "--val-fraction",
    "seq_len": "--seq-len",
    "seed": "--seed",
    "dtype": "--dtype",
    "shard_tokens": "--shard-tokens",
    "text_field": "--text-field",
    "include": "--include",
    "exclude": "--exclude",
    "on_error": "--on-error",
    "streaming": "--streaming",
    "unit_bytes": "--unit-mb (in bytes)",
    "out": "--out",
    "tasks": "--tasks",
}
"""Every setting that changes what is written, and the flag that gives it."""


def parts_dir(out: Path) -> Path:
    """Where the plan, the tokenizer and the tasks' parts of ``out`` live: ``OUT.parts``."""
    return Path(out).with_name(f"{Path(out).name}.parts")


def task_dir(parts: Path, task: int) -> Path:
    return parts / f"task-{task:05d}"


def done_file(parts: Path, task: int) -> Path:
    return parts / f"task-{task:05d}.done.json"


def settings(cfg: PrepareConfig, tasks: int) -> dict:
    """What the plan records of the command line: every setting that changes the output."""
    return {
        "inputs": list(cfg.inputs),
        "vocab_size": cfg.vocab_size,
        "model_type": cfg.model_type,
        "tokenizer": str(cfg.tokenizer) if cfg.tokenizer is not None else None,
        "tokenizer_sample_mb": cfg.tokenizer_sample_mb,
        "val_fraction": cfg.val_fraction,
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "dtype": cfg.dtype,
        "shard_tokens": cfg.shard_tokens,
        "text_field": cfg.read.text_field,
        "include": list(cfg.read.include),
        "exclude": list(cfg.read.exclude),
        "on_error": cfg.read.on_error,
        "streaming": cfg.read.streaming,
        "unit_bytes": cfg.read.unit_bytes,
        "out": os.path.abspath(cfg.out),
        "tasks": tasks,
    }


def check_tasks(tasks: int) -> None:
    if not 1 <= tasks <= MAX_TASKS:
        raise UserError(f"--tasks {tasks}: give 1 to {MAX_TASKS:,} tasks.")


def task_ranges(sizes: list[int], tasks: int) -> list[list[int]]:
    """[start, end) of the global unit indices of each task: contiguous, about equal input
    bytes. A unit goes to the task in whose share of the bytes its first byte falls; with more
    tasks than units some tasks get none."""
    total = max(1, sum(sizes))
    ranges, start, seen = [], 0, 0
    task_of = []
    for size in sizes:
        task_of.append(min(tasks - 1, seen * tasks // total))
        seen += size
    for t in range(tasks):
        end = start
        while end < len(task_of) and task_of[end] == t:
            end += 1
        ranges.append([start, end])
        start = end
    return ranges


def read_split(parts: Path) -> tuple[dict, str]:
    """(plan.json, its sha256); a UserError when it is missing or not a plan."""
    path = parts / SPLIT_FILE
    try:
        raw = path.read_bytes()
        plan = json.loads(raw)
    except FileNotFoundError:
        raise UserError(
            f"{path}: missing, so the plan step has not run (or did not finish). Run it first: "
            f"the same command with --tasks N and neither --task nor --merge."
        ) from None
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(
            f"{path}: cannot be read as JSON ({e}). Run the plan step again with --force."
        ) from None
    if not isinstance(plan, dict) or plan.get("anneal_prepare_plan") != SPLIT_VERSION:
        raise UserError(
            f"{path}: not a plan written by this Anneal's `anneal data prepare --tasks`. Run "
            f"the plan step again with --force."
        )
    return plan, hashlib.sha256(raw).hexdigest()


def check_same(plan: dict, cfg: PrepareConfig, tasks: int | None, *, parts: Path) -> None:
    """The command's flags must be the plan's (``tasks`` None: take the plan's count), given
    in the plan's working directory (relative paths mean the same files)."""
    if plan.get("cwd") != os.getcwd():
        raise UserError(
            f"{parts / SPLIT_FILE}: the plan was made in {plan.get('cwd')}, and this command "
            f"runs in {os.getcwd()}: relative --input and --out paths would name other files. "
            f"Run every step from the plan's working directory (`cd {plan.get('cwd')}`). "
            f"Nothing was written."
        )
    want = settings(cfg, plan["settings"]["tasks"] if tasks is None else tasks)
    have = plan["settings"]
    changed = [k for k in SETTING_FLAGS if want.get(k) != have.get(k)]
    if changed:
        shown = "; ".join(
            f"{SETTING_FLAGS[k]} {want.get(k)!r} (the plan: {have.get(k)!r})" for k in changed
        )
        raise UserError(
            f"{parts / SPLIT_FILE}: this command's flags differ from the plan's: {shown}. "
            f"Every step of one preparation (the plan, each --task, --merge) takes the same "
            f"flags, so that the parts fit together. Give the plan's flags again, or start over "
            f"with the new ones: the plan step with --force replaces {parts} (which it made). "
            f"Nothing was written."
        )


def check_inputs(plan: dict, cfg: PrepareConfig, sources: list[Source], *, parts: Path) -> None:
    """Every input file as the plan saw it: the same paths, sizes and mtimes."""
    for s, recorded in zip(sources, plan["inputs"], strict=True):
        now = input_files(s, cfg.read)
        if now == recorded["files"]:
            continue
        before = {f[0]: f[1:] for f in recorded["files"]}
        after = {f[0]: f[1:] for f in now}
        what = next(
            (f"{p} is new" for p in after if p not in before),
            None,
        ) or next((f"{p} is gone" for p in before if p not in after), None)
        if what is None:
            p = next(p for p in after if after[p] != before[p])
            what = f"{p} changed (size {before[p][0]:,} -> {after[p][0]:,} bytes, or its mtime)"
        raise UserError(
            f"--input {s.spec}: {what} since the plan ({parts / SPLIT_FILE}) was made, "
            f"so parts made before and after would not fit together. Put the input back as it "
            f"was, or start over: the plan step with --force replaces {parts}. Nothing was written."
        )


def make_split(cfg: PrepareConfig, tasks: int) -> tuple[dict, bool]:
    """Step 1: list the inputs, train or install the tokenizer, write ``plan.json`` last.
    Returns (the plan, whether it was made now): a plan already there with the same flags and
    inputs is kept (a resubmission), one with other flags refused unless ``cfg.force``."""
    from anneal.data.prepare import check_config, claim_out

    check_tasks(tasks)
    check_config(cfg)
    sources = parse_inputs(list(cfg.inputs))
    claim_out(cfg, sources)
    parts = parts_dir(cfg.out)
    claim_parts(parts, out=cfg.out, force=cfg.force)
    if (parts / SPLIT_FILE).is_file():
        plan, _ = read_split(parts)
        try:
            check_same(plan, cfg, tasks, parts=parts)
            check_inputs(plan, cfg, sources, parts=parts)
        except UserError:
            if not cfg.force:
                raise
            log.warning("replacing %s (another plan; --force)", parts)
            clear_parts(parts)
        else:
            return plan, False
    problems = Problems(cfg.read.on_error)
    inputs = [{"source": s.index, "files": input_files(s, cfg.read)} for s in sources]
    units = {s.index: unit_list(s, cfg.read, problems) for s in sources}
    created = not parts.exists()
    make_dir(parts, flag="--out")
    (parts / PARTS_MARKER).write_text("made by anneal data prepare --tasks\n")
    try:
        plan = _write_split(cfg, tasks, parts, sources, units, inputs, problems)
    except BaseException:
        if created:  # nothing of it is left behind; a directory submit-prepare made stays
            shutil.rmtree(parts, ignore_errors=True)
        raise
    return plan, True


def _write_split(cfg, tasks, parts, sources, units, inputs, problems) -> dict:
    """The tokenizer into ``parts/tokenizer/``, then plan.json, last."""
    from anneal.data.prepare import choose_dtype

    tok_dir = parts / TOKENIZER
    if tok_dir.exists():
        shutil.rmtree(tok_dir)  # a plan step that died before plan.json: ours, redone
    partial = parts / f"{TOKENIZER}.partial-{os.getpid()}"
    make_dir(partial)
    try:
        tok_info = make_tokenizer(partial, cfg, sources, units)
        tok_files = PreparedDir(partial).tokenizer_files()
        tok = tokenizer.load(partial)
        dtype = choose_dtype(cfg.dtype, tok.vocab_size)
        PreparedDir(partial).write_token_bytes(tok.token_bytes())
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(tok_dir)
    sizes = [u.nbytes for s in sources for u in units[s.index]]
    plan = {
        "anneal_prepare_plan": SPLIT_VERSION,
        "settings": settings(cfg, tasks),
        "cwd": os.getcwd(),
        "inputs": inputs,
        "units": {
            "per_source": [len(units[s.index]) for s in sources],
            "bytes": sum(sizes),
            "sha256": listing_sha256(units),
        },
        "ranges": task_ranges(sizes, tasks),
        "tokenizer": {
            "info": tok_info,
            "files": tok_files,
            "sha256": tokenizer.tokenizer_sha256(tok_dir),
            "token_bytes_sha256": sha256_file(PreparedDir(tok_dir).token_bytes_file),
            "dtype": dtype.name,
        },
        "empty_files": problems.empty_files,
        "empty_examples": problems.empty_examples,
    }
    write_atomic(parts / SPLIT_FILE, json.dumps(plan, indent=1) + "\n", durable=True)
    return plan


def claim_parts(parts: Path, *, out: Path, force: bool = False) -> None:
    """``OUT.parts`` may be used: absent, or made by this command (its marker file)."""
    if not parts.exists() and not parts.is_symlink():
        return
    if parts.is_symlink() or not parts.is_dir() or not (parts / PARTS_MARKER).is_file():
        raise UserError(
            f"--out {out}: {parts}, where a preparation in tasks keeps its parts, exists and was "
            f"not made by `anneal data prepare --tasks`, so it is neither used nor replaced"
            f"{' (even with --force)' if force else ''}. Move it away, or choose another --out."
        )


SLURM = "slurm"
"""``OUT.parts/slurm/``: the batch scripts and logs of ``submit-prepare``, which outlive the
parts."""


def clear_parts(parts: Path) -> None:
    """Remove everything in ``OUT.parts`` but its marker and ``slurm/`` (the scripts and logs
    of the jobs at work), and ``OUT.parts`` itself when nothing else is left."""
    for p in parts.iterdir():
        if p.name in (PARTS_MARKER, SLURM):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    if not (parts / SLURM).exists():
        shutil.rmtree(parts)


def check_tokenizer(plan: dict, parts: Path) -> Path:
    """The plan's tokenizer directory, its files as the plan recorded them."""
    tok_dir = parts / TOKENIZER
    recorded = {
        **plan["tokenizer"]["files"],
        TOKEN_BYTES: plan["tokenizer"]["token_bytes_sha256"],
    }
    for name, want in recorded.items():
        path = tok_dir / name
        if not path.is_file() or sha256_file(path) != want:
            raise UserError(
                f"{path}: {'missing' if not path.is_file() else 'its sha256 differs from'} "
                f"the tokenizer the plan recorded, so the tasks' ids would not agree. Start over: "
                f"the plan step with --force replaces {parts}. Nothing was written."
            )
    return tok_dir


def load_split(cfg: PrepareConfig, tasks: int | None) -> tuple[dict, str, list[Source], dict]:
    """For a task or the merge: the plan and its sha256, the sources, and the units listed
    again, all checked against the plan (flags, input files, units, tokenizer)."""
    from anneal.data.prepare import check_config

    check_config(cfg)
    parts = parts_dir(cfg.out)
    claim_parts(parts, out=cfg.out)
    plan, plan_sha = read_split(parts)
    check_same(plan, cfg, tasks, parts=parts)
    sources = parse_inputs(list(cfg.inputs))
    check_inputs(plan, cfg, sources, parts=parts)
    problems = Problems(cfg.read.on_error, quiet=True)
    units = {s.index: unit_list(s, cfg.read, problems) for s in sources}
    if listing_sha256(units) != plan["units"]["sha256"]:
        raise UserError(
            f"{parts / SPLIT_FILE}: the inputs cut into other work units than the plan's (another "
            f"Anneal, or another reader of a format). Run every step with the same Anneal, or "
            f"start over with --force on the plan step. Nothing was written."
        )
    check_task_ranges(plan, sum(map(len, units.values())), parts=parts)  # lists: no hub source
    check_tokenizer(plan, parts)
    return plan, plan_sha, sources, units


def check_task_ranges(plan: dict, n_units: int, *, parts: Path) -> None:
    """The plan's ``ranges`` as the plan step cuts them (``task_ranges``): one [start, end) per
    task, each from where the one before ended, from unit 0 to the last. Overlapping ranges
    would pack some units twice (and count their input bytes twice), a gap would lose some."""
    ranges, tasks = plan.get("ranges"), plan["settings"]["tasks"]
    if not isinstance(ranges, list) or len(ranges) != tasks:
        why = f"it holds {json.dumps(ranges)[:40]} for {tasks} tasks"
    else:
        why, end = None, 0
        for t, r in enumerate(ranges):
            whole = isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
            if not whole or r[1] < r[0]:
                why = f"task {t}'s range {json.dumps(r)[:40]} is no [start, end) of units"
            elif r[0] != end:
                how = "overlaps" if r[0] < end else "leaves a gap after"
                why = f"task {t}'s units {r} {how} task {t - 1}'s {ranges[t - 1]}"
            if why:
                break
            end = r[1]
        if why is None and end != n_units:
            why = f"the ranges end at unit {end}, and the inputs cut into {n_units:,} units"
    if why:
        raise UserError(
            f"{parts / SPLIT_FILE}: its task ranges are not the plan step's: {why}. Each work "
            f"unit belongs to exactly one task, in order, so that the parts fit together and "
            f"every byte is counted once. Start over: the plan step with --force replaces "
            f"{parts}. Nothing was written."
        )
