"""Tokenize work units into packed ids (in worker processes) and append them to shards.

A worker turns one unit into, per split, one array of ids with EOS after every document, the
offsets where documents end, and byte and document counts. The writer appends these arrays in
unit order to fixed-size shard files of the unit's (split, source), so the shards are the same
for any number of workers. :func:`pack_all` drives both, with at most two units per worker in
flight (bounded memory), and shows the progress (:class:`Progress`).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anneal.data import tokenizer
from anneal.data.prepare_config import PrepareConfig
from anneal.data.prepare_progress import Progress
from anneal.data.prepared_dir import SPLITS, PreparedDir
from anneal.data.readers import Problems, ReadOptions, Unit
from anneal.data.sources import Source
from anneal.data.units import read_unit, units_of

ENCODE_BATCH_CHARS = 1 << 18  # characters per tokenizer call (bounds list-of-int memory)

_WORKER: dict = {}


def utf8_bytes(text: str) -> int:
    """``len(text.encode("utf-8"))`` without the copy for ASCII text."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def doc_hash(label: str, name: str) -> float:
    """Where a document falls in [0, 1): a hash of its source and name, not its position."""
    digest = hashlib.sha256(f"{label}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def is_validation(label: str, name: str, *, val_fraction: float) -> bool:
    """Deterministic split by document: its hash (:func:`doc_hash`) below the fraction, so the
    same document lands in the same split whatever else the input holds. Besides these, a
    source of 2 or more documents none of which hashes below the fraction holds out its
    smallest-hash one (:func:`pack_all`), so that no source goes without validation."""
    return doc_hash(label, name) < val_fraction


@dataclass(kw_only=True)
class Part:
    """One split's share of one unit."""

    ids: np.ndarray
    doc_ends: np.ndarray
    """Offsets in ``ids`` just after each document's EOS (int64)."""
    documents: int = 0
    bytes: int = 0


@dataclass(kw_only=True)
class UnitResult:
    source: int
    parts: dict[str, Part]
    nbytes: int
    skipped: int = 0
    examples: list[str] = field(default_factory=list)
    smallest: tuple[float, str] | None = None
    """(hash, name) of the unit's training document with the smallest :func:`doc_hash`."""


def init_worker(
    tokenizer_dir: str,
    opts: ReadOptions,
    val_fraction: float,
    dtype: str,
    held_out: dict[int, str] | None = None,
) -> None:
    """Per process: load the tokenizer from the directory being prepared. ``held_out``: the
    document name, by source index, that goes to validation besides the hashed ones."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(
        tok=tokenizer.load(Path(tokenizer_dir)),
        opts=opts,
        val_fraction=val_fraction,
        dtype=np.dtype(dtype),
        held_out=held_out or {},
    )


def tokenize_unit(unit: Unit) -> UnitResult:
    """Read, split, encode and pack one unit (in a worker, after :func:`init_worker`)."""
    tok: tokenizer.Tokenizer = _WORKER["tok"]
    opts: ReadOptions = _WORKER["opts"]
    val_fraction: float = _WORKER["val_fraction"]
    dtype = _WORKER["dtype"]
    problems = Problems(opts.on_error)
    # Per split: the texts waiting to be encoded and whether each ends its document.
    pending: dict[str, tuple[list[str], list[bool]]] = {s: ([], []) for s in SPLITS}
    pending_chars = 0
    arrays: dict[str, list] = {s: [] for s in SPLITS}  # per split: (ids, doc_ends) arrays
    counts = {s: [0, 0, 0] for s in SPLITS}  # documents, bytes, tokens

    def flush():
        for split, (texts, lasts) in pending.items():
            if texts:
                ids, ends = tok.encode_packed(texts, lasts, dtype=dtype)
                arrays[split].append((ids, ends + counts[split][2]))
                counts[split][2] += len(ids)
                texts.clear()
                lasts.clear()

    held_out = _WORKER["held_out"].get(unit.source)
    smallest = None
    for rec in read_unit(unit, opts, problems):
        h = doc_hash(unit.label, rec.name)
        val = val_fraction > 0 and (h < val_fraction or rec.name == held_out)
        if not val and (smallest is None or (h, rec.name) < smallest):
            smallest = (h, rec.name)
        split = "val" if val else "train"
        texts, lasts = pending[split]
        texts.append(rec.text)
        lasts.append(rec.last)
        counts[split][0] += rec.first
        counts[split][1] += utf8_bytes(rec.text)
        pending_chars += len(rec.text)
        if pending_chars >= ENCODE_BATCH_CHARS:
            flush()
            pending_chars = 0
    flush()
    parts = {}
    for split in SPLITS:
        ids = [a for a, _ in arrays[split]]
        ends = [e for _, e in arrays[split]]
        parts[split] = Part(
            ids=np.concatenate(ids) if ids else np.zeros(0, dtype),
            doc_ends=np.concatenate(ends) if ends else np.zeros(0, np.int64),
            documents=counts[split][0],
            bytes=counts[split][1],
        )
    return UnitResult(
        source=unit.source,
        parts=parts,
        nbytes=unit.nbytes,
        skipped=problems.skipped,
        examples=problems.examples,
        smallest=smallest,
    )


class ShardWriter:
    """Appends one (split, source)'s ids to shard files of at most ``shard_tokens`` ids, and
    the end offset of each document to ``<source>_docs.bin`` (uint64, in the coordinates of
    this source's shards concatenated)."""

    def __init__(self, directory: Path, *, source: int, dtype: np.dtype, shard_tokens: int):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.source = source
        self.dtype = np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self.tokens = 0
        self.bytes = 0
        self.documents = 0
        self._file = None
        self._hash = None
        self._in_shard = 0
        self._docs_name = PreparedDir.docs_name(source)
        self._docs = None

    def add(self, part: Part) -> None:
        self.add_ends(part.doc_ends + self.tokens)
        self.bytes += part.bytes
        self.documents += part.documents
        self.add_ids(part.ids)

    def add_ends(self, ends: np.ndarray) -> None:
        """Append document end offsets, already in this writer's coordinates (the tokens
        written before them added)."""
        if self._docs is None:
            self._docs = open(self.dir / self._docs_name, "wb")  # noqa: SIM115 - closed in close()
        ends.astype("<u8", copy=False).tofile(self._docs)

    def add_ids(self, ids: np.ndarray) -> None:
        """Append ids, cut into shards of ``shard_tokens``."""
        self.tokens += len(ids)
        ids = ids.astype(self.dtype.newbyteorder("<"), copy=False)
        while len(ids):
            if self._file is None:
                self._open()
            take = ids[: self.shard_tokens - self._in_shard]
            self._file.write(take)  # the array's buffer, written and hashed without a copy
            self._hash.update(take)
            self._in_shard += len(take)
            ids = ids[len(take) :]
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def _open(self) -> None:
        name = PreparedDir.shard_name(self.source, len(self.shards))
        self._file = open(self.dir / name, "wb")  # noqa: SIM115 - closed in _close_shard()
        self._hash = hashlib.sha256()
        self.shards.append({"file": name, "tokens": 0, "source": self.source})

    def _close_shard(self) -> None:
        self._file.close()
        self.shards[-1].update(tokens=self._in_shard, sha256=self._hash.hexdigest())
        self._file, self._in_shard = None, 0

    def discard(self) -> None:
        """Close and delete what was written (the source is packed again)."""
        self.close()
        for shard in self.shards:
            (self.dir / shard["file"]).unlink()
        (self.dir / self._docs_name).unlink(missing_ok=True)

    def close(self) -> dict:
        if self._file is not None:
            self._close_shard()
        if self._docs is not None:
            self._docs.close()
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "documents": self.documents,
            "shards": self.shards,
            "doc_index": self._docs_name if self._docs is not None else None,
        }


def _ordered(fn, units: Iterator[Unit], *, workers: int, initargs: tuple) -> Iterator:
    """``fn`` over ``units`` in order, in ``workers`` processes with at most two units per
    worker in flight (bounded memory), or in this process for one worker."""
    if workers <= 1:
        init_worker(*initargs)
        for unit in units:
            yield fn(unit)
        return
    # fork is cheap and shares the unit lists. Forking a process that has threads can hang the
    # child (it gets their locks and pools, not the threads); the workers only encode, with no
    # thread pool, and the tokenizer, which has one, trains in a fresh interpreter (make_tokenizer).
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("fork" if "fork" in methods else "spawn")
    with ctx.Pool(workers, initializer=init_worker, initargs=initargs) as pool:
        pending: deque = deque()
        for unit in units:
            pending.append(pool.apply_async(fn, (unit,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
        pool.join()  # workers end here, so their CPU time is counted (pack_cpu_seconds)


def pack_all(
    partial: Path,
    cfg: PrepareConfig,
    sources: list[Source],
    units: dict,
    dtype: np.dtype,
    problems: Problems,
    *,
    workers: int,
) -> tuple[dict, dict, int]:
    """Tokenize every unit of ``sources`` in ``workers`` processes and write the shards of
    each (split, source) under ``partial``. Returns the splits' totals and shard lists, the
    counts per split and source, and the input bytes read. ``units`` maps each source's index
    to its :func:`anneal.data.units.unit_list`; skipped records are added to ``problems``."""

    def writer(split: str, source: int) -> ShardWriter:
        directory = PreparedDir(partial).split_dir(split)
        return ShardWriter(directory, source=source, dtype=dtype, shard_tokens=cfg.shard_tokens)

    writers = {(split, s.index): writer(split, s.index) for split in SPLITS for s in sources}
    listed = [units[s.index] for s in sources]
    total = (
        sum(u.nbytes for us in listed for u in us)
        if all(isinstance(us, list) for us in listed)
        else None
    )
    progress = Progress(total, enabled=cfg.progress, workers=workers)
    all_units = (u for s in sources for u in units_of(units[s.index]))
    initargs = (str(partial), cfg.read, cfg.val_fraction, dtype.name)
    smallest = pack_units(
        all_units, writers, problems, progress, workers=workers, initargs=initargs
    )
    progress.close()
    # A source of 2 or more documents none of which hashed below the fraction: packed again,
    # with its smallest-hash document held out (the same one for any number of workers).
    held_out = {
        s.index: smallest[s.index][1]
        for s in sources
        if cfg.val_fraction > 0
        and writers["val", s.index].documents == 0
        and writers["train", s.index].documents >= 2
    }
    for index in held_out:
        for split in SPLITS:
            writers[split, index].discard()
            writers[split, index] = writer(split, index)
    if held_out:
        again = (u for s in sources if s.index in held_out for u in units_of(units[s.index]))
        quiet = Problems(cfg.read.on_error, quiet=True)  # counted on the first pass
        pack_units(again, writers, quiet, None, workers=workers, initargs=(*initargs, held_out))
    splits, per_source = summarize({k: w.close() for k, w in writers.items()}, sources)
    return splits, per_source, progress.done


def summarize(closed: dict, sources: list[Source]) -> tuple[dict, dict]:
    """Each split's totals and shard list, and the counts per split and source (meta.json's
    ``splits``), from ``closed``: {(split, source index): what ShardWriter.close returns}."""
    splits, per_source = {}, {}
    for split in SPLITS:
        groups = [(s, closed[split, s.index]) for s in sources]
        splits[split] = {
            "tokens": sum(g["tokens"] for _, g in groups),
            "bytes": sum(g["bytes"] for _, g in groups),
            "documents": sum(g["documents"] for _, g in groups),
            "shards": [sh for _, g in groups for sh in g["shards"]],
        }
        per_source[split] = {
            s.name: {k: g[k] for k in ("tokens", "bytes", "documents", "doc_index")}
            for s, g in groups
        }
    return splits, per_source


def pack_units(units, writers, problems, progress, *, workers, initargs) -> dict[int, tuple]:
    """Tokenize ``units`` into ``writers``; the smallest (hash, name) of a training document
    of each source."""
    smallest: dict[int, tuple] = {}
    for result in _ordered(tokenize_unit, units, workers=workers, initargs=initargs):
        for split, part in result.parts.items():
            writers[split, result.source].add(part)
        problems.skipped += result.skipped
        problems.examples += result.examples[: max(0, 20 - len(problems.examples))]
        if result.smallest is not None:
            smallest[result.source] = min(
                smallest.get(result.source, result.smallest), result.smallest
            )
        if progress is not None:
            progress.update(result.nbytes, sum(len(p.ids) for p in result.parts.values()))
    return smallest
