"""Step 3 of a preparation in tasks (:mod:`anneal.data.task_split`): ``--merge`` writes OUT from the
tasks' parts, byte for byte what one node's ``anneal data prepare`` writes from the same inputs
and flags (``PreparedDir.content_sha256`` is the same), verifies it as ``anneal data verify``
does, and then removes the parts.

It refuses, before writing anything, while a task has no completion marker (naming every such
task), when a marker belongs to another plan, and when a part's ``part.json`` is not the one its
marker recorded or a file of it has another size; a file whose bytes changed at the same size is
found while it is copied (the xxh3-128s of its ids, the sha256 of its document index), and the
directory being written is then removed. In
every case the parts and any earlier OUT are left as they were.

Each (split, source)'s shards are the concatenation of the tasks' pieces in task order, cut
again at ``--shard-tokens`` by a pool of threads (:mod:`anneal.data.merge_copy`): the copy is
I/O and hashing, no tokenizing. One case tokenizes: a
source of two or more documents none of which hashed into validation holds out its
smallest-hash document, as one node does (:func:`anneal.data.pack.pack_all`), and that source is
tokenized again here, as one node tokenizes it a second time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from anneal.data import merge_copy, tokenizer
from anneal.data.pack import ShardWriter, pack_units, summarize
from anneal.data.part import PART, read_done
from anneal.data.prepare_config import PrepareConfig
from anneal.data.prepared_dir import SPLITS, TOKEN_BYTES, PreparedDir
from anneal.data.readers import Problems
from anneal.data.task_split import (
    SPLIT_FILE,
    TOKENIZER,
    clear_parts,
    done_file,
    load_split,
    parts_dir,
    task_dir,
)
from anneal.data.units import units_of
from anneal.errors import UserError
from anneal.files import replace_dir, sha256_file

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
"""Bytes read at a time while a piece is copied."""


def merge(cfg: PrepareConfig, tasks: int | None = None) -> dict:
    """Step 3. Returns meta.json's dict with provenance.json's added."""
    from anneal.data import prepare as one_node
    from anneal.data.checks import verify

    t0 = time.time()
    plan, plan_sha, sources, units = load_split(cfg, tasks)
    parts = parts_dir(cfg.out)
    one_node.claim_out(cfg, sources)
    found = check_parts(plan, plan_sha, parts, cfg)
    one_node._remove_stale_partials(cfg.out)
    partial = one_node._make_partial(cfg.out)
    try:
        tok_dir = parts / TOKENIZER
        for name in [*plan["tokenizer"]["files"], TOKEN_BYTES]:
            shutil.copyfile(tok_dir / name, partial / name)
        t_copy = time.time()
        splits, per_source, copied, written = _write_shards(
            partial, plan, found, cfg, sources, units
        )
        copy_s = time.time() - t_copy
        problems = Problems(cfg.read.on_error, quiet=True)
        problems.empty_files = plan["empty_files"]
        problems.empty_examples = plan["empty_examples"]
        for part in found:
            problems.skipped += part["skipped"]
            problems.examples += part["examples"][: max(0, 20 - len(problems.examples))]
        one_node.check_counts(cfg, sources, splits, per_source, problems)
        tok = tokenizer.load(partial)
        meta = one_node.build_meta(
            cfg,
            sources,
            tok=tok,
            dtype=np.dtype(plan["tokenizer"]["dtype"]),
            tok_info=plan["tokenizer"]["info"],
            tok_files=plan["tokenizer"]["files"],
            tok_sha256=plan["tokenizer"]["sha256"],
            splits=splits,
            per_source=per_source,
            problems=problems,
            nbytes=sum(p["input_bytes"] for p in found),
        )
        PreparedDir(partial).write_meta(meta)
        (partial / one_node.PARTIAL_MARKER).unlink()  # not part of the tree that is hashed
        t_verify = time.time()
        verified = verify(partial, written=written)  # the shards' sha256 of what was written
        record = _provenance(cfg, plan_sha, parts, plan, copied, copy_s, time.time() - t_verify)
        record["content_sha256"] = verified["content_sha256"]
        record["seconds"] = round(time.time() - t0, 1)
        PreparedDir(partial).write_provenance(record)
        replace_dir(partial, cfg.out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    clear_parts(parts)  # the parts, markers, tokenizer and plan: OUT holds it all now
    return {**meta, **record}


def check_parts(plan: dict, plan_sha: str, parts: Path, cfg: PrepareConfig) -> list[dict]:
    """Every task's part.json, once every task is complete under this plan and every part is
    whole; otherwise one UserError naming the tasks and what to run."""
    tasks = plan["settings"]["tasks"]
    dones = [read_done(parts, t) for t in range(tasks)]
    missing = [t for t, d in enumerate(dones) if d is None]
    if missing:
        started = [t for t in missing if task_dir(parts, t).exists()]
        raise UserError(
            f"{parts}: {len(missing)} of {tasks} tasks have no completion marker: "
            f"{_list(missing)}"
            + (f" ({_list(started)} started and did not finish)" if started else "")
            + f". Run them (`anneal data prepare ... --task I --tasks {tasks}` with the plan's "
            f"flags, or `python -m launcher submit-prepare` again, which submits only the tasks "
            f"without a marker), then merge. Nothing was written; the parts are kept."
        )
    other = [t for t, d in enumerate(dones) if d.get("plan_sha256") != plan_sha]
    if other:
        raise UserError(
            f"{parts}: the parts of tasks {_list(other)} were made under another plan "
            f"(their markers name plan {str(dones[other[0]].get('plan_sha256'))[:12]}..., "
            f"{parts / SPLIT_FILE} is {plan_sha[:12]}...): another input list, tokenizer or flags. "
            f"Remove their markers ({done_file(parts, other[0]).name}, ...) and run those tasks "
            f"again. Nothing was written; the parts are kept."
        )
    found = []
    for t, done in enumerate(dones):
        path = task_dir(parts, t) / PART
        if not path.is_file() or sha256_file(path) != done.get("part_sha256"):
            raise _tampered(parts, t, path, "is missing or its sha256 differs from the marker's")
        part = json.loads(path.read_bytes())
        for split in SPLITS:
            for piece in part["pieces"][split].values():
                _check_sizes(parts, t, split, piece, plan)
        found.append(part)
    return found


def _check_sizes(parts: Path, task: int, split: str, piece: dict, plan: dict) -> None:
    itemsize = np.dtype(plan["tokenizer"]["dtype"]).itemsize
    directory = task_dir(parts, task) / split
    if piece["shards"] and not piece.get("xxh3_128"):
        raise _tampered(parts, task, task_dir(parts, task) / PART, "records no xxh3-128 of its ids")
    files = [(s["file"], s["tokens"] * itemsize) for s in piece["shards"]]
    if piece["doc_index"]:
        files.append((piece["doc_index"], piece["docs_bytes"]))
    for name, want in files:
        path = directory / name
        size = path.stat().st_size if path.is_file() else None
        if size != want:
            what = "is missing" if size is None else f"holds {size:,} bytes, not {want:,}"
            raise _tampered(parts, task, path, f"{what} (part.json)")


def _tampered(parts: Path, task: int, path: Path, what: str) -> UserError:
    return UserError(
        f"{path}: {what}: task {task}'s part changed after the task wrote it (a bad copy, a "
        f"disk error, an edit), so it cannot be merged. Run task {task} again: remove "
        f"{done_file(parts, task)} and run `anneal data prepare ... --task {task}` with the "
        f"plan's flags (or `python -m launcher submit-prepare` again, which runs only the tasks "
        f"without a marker). Nothing was written to --out; the parts are kept."
    )


def _list(tasks: list[int]) -> str:
    shown = ", ".join(map(str, tasks[:20]))
    return shown + (f" and {len(tasks) - 20} more" if len(tasks) > 20 else "")


def _write_shards(partial: Path, plan, found, cfg: PrepareConfig, sources, units):
    """Every (split, source)'s shards under ``partial``: the pieces in task order, or a source
    tokenized again with its held-out document. Returns the splits, the counts per source, the
    bytes copied and {"split/file": sha256} of the copied shards, hashed from the bytes written."""
    from anneal.data.prepare import default_workers

    dtype = np.dtype(plan["tokenizer"]["dtype"])
    workers = cfg.workers or default_workers()
    held_out = _held_out(cfg, sources, found)
    parts = parts_dir(cfg.out)
    closed, shards, entries = {}, [], []
    for split in SPLITS:
        PreparedDir(partial).split_dir(split).mkdir()
    for s in sources:
        if s.index in held_out:
            closed.update(_tokenize_again(partial, s, units, held_out, dtype, cfg, workers))
            continue
        for split in SPLITS:
            directory = PreparedDir(partial).split_dir(split)
            pieces = [
                (task_dir(parts, p["task"]) / split, p["pieces"][split][str(s.index)], p["task"])
                for p in found
                if str(s.index) in p["pieces"][split]
            ]
            mine = merge_copy.cut(
                [
                    (
                        d / pc["shards"][0]["file"] if pc["shards"] else d,
                        pc["tokens"],
                        pc["xxh3_128"],
                        pc["xxh3_128_chunk"],
                        t,
                    )
                    for d, pc, t in pieces
                ],
                directory=directory,
                source=s.index,
                itemsize=dtype.itemsize,
                shard_tokens=cfg.shard_tokens,
                name=PreparedDir.shard_name,
            )
            listed = [{"file": sh.path.name, "tokens": sh.tokens, "source": s.index} for sh in mine]
            shards += mine
            entries += listed
            closed[split, s.index] = {
                "tokens": sum(pc["tokens"] for _, pc, _ in pieces),
                "bytes": sum(pc["bytes"] for _, pc, _ in pieces),
                "documents": sum(pc["documents"] for _, pc, _ in pieces),
                "shards": listed,
                "doc_index": _write_ends(directory, s.index, pieces, parts),
            }
    hashes = merge_copy.write_all(shards, workers=workers, tampered=_tampered_in(parts))
    written = {}
    for entry, sh, sha in zip(entries, shards, hashes, strict=True):
        entry["sha256"] = written[f"{sh.path.parent.name}/{sh.path.name}"] = sha
    splits, per_source = summarize(closed, sources)
    return splits, per_source, sum(sh.tokens for sh in shards) * dtype.itemsize, written


def _tampered_in(parts: Path):
    return lambda task, path, what: _tampered(parts, task, path, what)


def _tokenize_again(partial, source, units, held_out, dtype, cfg, workers) -> dict:
    """A source whose held-out document one node adds on a second pass: tokenized again here,
    all of it, with that document in validation (``pack_units``, as one node does)."""
    writers = {
        (split, source.index): ShardWriter(
            PreparedDir(partial).split_dir(split),
            source=source.index,
            dtype=dtype,
            shard_tokens=cfg.shard_tokens,
        )
        for split in SPLITS
    }
    parts = parts_dir(cfg.out)
    initargs = (
        str(parts / TOKENIZER),
        cfg.read,
        cfg.val_fraction,
        dtype.name,
        {source.index: held_out[source.index]},
    )
    quiet = Problems(cfg.read.on_error, quiet=True)  # counted by the tasks
    pack_units(
        units_of(units[source.index]), writers, quiet, None, workers=workers, initargs=initargs
    )
    return {key: w.close() for key, w in writers.items()}


def _write_ends(directory: Path, source: int, pieces: list, parts: Path) -> str | None:
    """The document index of one (split, source): each piece's end offsets, moved by the
    tokens before it, checked against its sha256 as it is read. Its name, or None when no
    task had units of the source."""
    if not any(pc["doc_index"] for _, pc, _ in pieces):
        return None
    name = PreparedDir.docs_name(source)
    base = 0
    with open(directory / name, "wb") as out:
        for d, pc, task in pieces:
            if pc["doc_index"]:
                for chunk in _checked_chunks(d / pc["doc_index"], pc["docs_sha256"], parts, task):
                    (np.frombuffer(chunk, dtype="<u8") + np.uint64(base)).tofile(out)
            base += pc["tokens"]
    return name


def _held_out(cfg: PrepareConfig, sources, found: list[dict]) -> dict[int, str]:
    """{source index: document name} of the sources that hold out their smallest-hash document
    (no document of theirs hashed into validation, two or more documents): one node's rule."""
    held = {}
    for s in sources:
        key = str(s.index)
        docs = {
            split: sum(p["pieces"][split].get(key, {}).get("documents", 0) for p in found)
            for split in SPLITS
        }
        smallest = [tuple(p["smallest"][key]) for p in found if key in p["smallest"]]
        if cfg.val_fraction > 0 and docs["val"] == 0 and docs["train"] >= 2 and smallest:
            held[s.index] = min(smallest)[1]
    return held


def _checked_chunks(path: Path, sha256: str, parts: Path, task: int):
    """The bytes of ``path`` in chunks (each a fresh buffer, handed on before the next read);
    a UserError after the last one when their sha256 is not ``sha256``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK_BYTES)
            if not chunk:
                break
            h.update(chunk)
            yield chunk
    if h.hexdigest() != sha256:
        raise _tampered(parts, task, path, "its sha256 differs from the one in part.json")


def _provenance(cfg, plan_sha, parts, plan, copied, copy_s, verify_s) -> dict:
    from anneal.data.prepare import command_line

    dones = [read_done(parts, t) or {} for t in range(plan["settings"]["tasks"])]
    keep = ("task", "host", "units", "input_bytes", "tokens", "seconds", "pack_cpu_seconds")
    return {
        "command": command_line(cfg),
        "python": sys.version.split()[0],
        "plan_sha256": plan_sha,
        "tasks": [{k: d.get(k) for k in (*keep, "workers")} for d in dones],
        "pack_cpu_seconds": round(sum(d.get("pack_cpu_seconds", 0) for d in dones), 2),
        "merge_bytes": copied,
        "merge_seconds": round(copy_s, 4),
        "merge_mb_per_s": round(copied / 1e6 / max(copy_s, 1e-9), 2),
        "verify_seconds": round(verify_s, 4),
    }
