"""A prepared data directory checked and read back (the output of ``anneal data prepare``;
docs/data.md): is it one, is it intact, does it match a run, and its entropy baselines.

Training, the demo and the scripts import this module, never :mod:`anneal.data.prepare`, so
that reading data does not load the multiprocessing writer.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from anneal import rundir
from anneal.data import tokenizer
from anneal.data.prepared_dir import SPLITS, PreparedDir, how_to_prepare, prepare_again
from anneal.errors import UserError
from anneal.files import sha256_file


def is_prepared_dir(path: Path) -> bool:
    """Whether ``path`` carries the marker of ``anneal data prepare``: a meta.json object with
    an integer ``format_version`` (what ``--force`` may replace)."""
    version = (PreparedDir(path).meta_object() or {}).get("format_version")
    return isinstance(version, int) and not isinstance(version, bool)


def has_validation(meta: dict, *, seq_len: int = 0) -> bool:
    """Whether the directory described by ``meta`` (its meta.json) has validation data: at
    least one window of ``seq_len + 1`` tokens in one validation shard (windows never cross
    shards; see :class:`anneal.data.stream.PackedSplit`). ``seq_len=0``: any token at all.
    False for data prepared with ``--val-fraction 0``."""
    shards = meta.get("splits", {}).get("val", {}).get("shards", [])
    return any(shard["tokens"] >= seq_len + 1 for shard in shards)


def check_prepared(data: Path | PreparedDir) -> dict:
    """meta.json of a complete prepared directory, or a UserError saying what is wrong and
    how to fix it: missing, interrupted, garbage in meta.json, truncated shards, a tokenizer
    replaced after the shards were made. Sizes only: :func:`verify` re-hashes the shards."""
    prepared = PreparedDir.of(data)
    data_dir = prepared.path
    if not prepared.meta_file.is_file():
        prefix = f"{data_dir.name}.partial-"
        partials = sorted(
            p for p in data_dir.parent.glob("*.partial-*") if p.name.startswith(prefix)
        )
        hint = "it does not exist" if not data_dir.exists() else "it has no meta.json"
        if partials:
            hint += f"; {partials[0].name} is an interrupted prepare"
        raise UserError(
            f"--data {data_dir}: not a prepared data directory ({hint}). {how_to_prepare(data_dir)}"
        )
    redo = prepare_again(data_dir)
    meta = prepared.meta()
    vocab, dtype = meta["vocab_size"], np.dtype(meta["dtype"])
    for split in SPLITS:
        for shard in meta["splits"][split]["shards"]:
            path = prepared.shard_path(split, shard)
            want = shard["tokens"] * dtype.itemsize
            size = path.stat().st_size if path.is_file() else None
            if size != want:
                raise UserError(
                    f"{path}: {'missing' if size is None else f'{size} bytes'}, meta.json says "
                    f"{want} ({shard['tokens']} tokens). The directory is damaged. {redo}"
                )
    token_bytes = prepared.token_bytes_file
    try:
        n_entries = len(prepared.token_bytes(mmap_mode="r")) if token_bytes.is_file() else None
    except (OSError, ValueError, TypeError):
        n_entries = None
    if n_entries != vocab:
        raise UserError(f"{token_bytes}: missing or not one entry per id ({vocab}). {redo}")
    if changes := prepared.tokenizer_changes(meta):
        name, actual, want = changes[0]
        now = f"its sha256 {actual[:12]}... differs from" if actual else "missing, but part of"
        raise UserError(
            f"{data_dir / name}: {now} the tokenizer the shards were made with ({want[:12]}... "
            f"in meta.json): the ids in the shards would be read, or a model exported, with "
            f"another vocabulary. Put the original file back, or {redo[0].lower()}{redo[1:]}"
        )
    return meta


def verify(data_dir: Path, *, written: dict[str, str] | None = None) -> dict:
    """``anneal data verify``: re-hash every shard against the sha256 in meta.json (a thread per
    core: hashlib and reads release the GIL), and every
    tokenizer file (``PreparedDir.tokenizer_records``). Returns the shards checked, their bytes, the
    tokenizer files checked, the top-level files meta.json has no hash for ("uncovered": a
    directory prepared before ``tokenizer_files``) and the tree's ``content_sha256`` (the same
    for any two preparations of the same inputs and flags); a UserError lists every file that is
    missing, of the wrong size or differs.

    ``written``: {"split/file": sha256} of shards whose sha256 the caller computed from the very
    bytes it wrote to them just now (the merge of tasks); those are checked for presence and
    size and their sha256 taken as read, not read back (a read-back of a file just written
    comes from the page cache, so it finds no more than the size check does)."""
    prepared = PreparedDir(data_dir)
    data_dir, meta = prepared.path, prepared.meta()
    dtype = np.dtype(meta["dtype"])
    bad: list[str] = []
    files = nbytes = 0
    to_hash = []  # (rel, path, sha256 recorded)
    for split in SPLITS:
        for shard in meta["splits"][split]["shards"]:
            path = prepared.shard_path(split, shard)
            rel = f"{split}/{shard['file']}"
            files += 1
            want_size = shard["tokens"] * dtype.itemsize
            if not path.is_file():
                bad.append(f"{rel} (missing)")
            elif path.stat().st_size != want_size:
                bad.append(f"{rel} ({path.stat().st_size} bytes, meta.json says {want_size})")
            elif "sha256" not in shard:
                bad.append(f"{rel} (meta.json records no sha256 for it)")
            else:
                nbytes += want_size
                to_hash.append((rel, path, shard["sha256"]))
    written = written or {}
    unread = [path for rel, path, _ in to_hash if rel not in written]
    read = {}
    if unread:
        with ThreadPoolExecutor(_cores()) as pool:  # hashlib and reads release the GIL
            read = dict(zip(unread, pool.map(sha256_file, unread), strict=True))
    hashes = [written.get(rel) or read[path] for rel, path, _ in to_hash]
    bad += [
        f"{rel} (sha256 differs: the bytes changed)"
        for (rel, _, want), sha in zip(to_hash, hashes, strict=True)
        if sha != want
    ]
    records = prepared.tokenizer_records(meta)
    shards, tokenizer_names = files, sorted(records)
    files += len(tokenizer_names)
    changed = prepared.tokenizer_changes(meta)
    bad += [f"{n} ({'sha256 differs' if a else 'missing'})" for n, a, _ in changed]
    if bad:
        listed = "; ".join(bad[:20]) + (f"; and {len(bad) - 20} more" if len(bad) > 20 else "")
        export = ", and an export would ship another tokenizer" if changed else ""
        raise UserError(
            f"{data_dir}: {len(bad)} of {files} files do not match meta.json: {listed}. "
            f"Training on them would read wrong token ids{export}. {prepare_again(data_dir)}"
        )
    uncovered = sorted(set(prepared.tokenizer_files(hashed=False)) - set(tokenizer_names))
    return {
        # the tokenizer's files matched their records just now: those are their sha256
        "content_sha256": prepared.content_sha256(meta=meta, checked=records),
        "shards": shards,
        "bytes": nbytes,
        "tokenizer": tokenizer_names,
        "uncovered": uncovered,
    }


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def unigram_entropy_bits_per_byte(data_dir: Path, split: str = "train") -> float:
    """Baseline a model must beat: entropy of the unigram token distribution of ``split``,
    in bits per UTF-8 byte."""
    prepared = PreparedDir(data_dir)
    meta = prepared.meta()
    counts = np.zeros(meta["vocab_size"], dtype=np.int64)
    dtype = np.dtype(meta["dtype"])
    chunk = 1 << 20  # ids read at a time: bounded memory for any split size
    for shard in meta["splits"][split]["shards"]:
        for k in range(0, shard["tokens"], chunk):
            ids = np.fromfile(
                prepared.shard_path(split, shard),
                dtype=dtype,
                count=min(chunk, shard["tokens"] - k),
                offset=k * dtype.itemsize,
            )
            counts += np.bincount(ids, minlength=meta["vocab_size"])
    p = counts[counts > 0] / counts.sum()
    bits_per_token = float(-(p * np.log2(p)).sum())
    split_meta = meta["splits"][split]
    return bits_per_token * split_meta["tokens"] / split_meta["bytes"]


def split_text(data_dir: Path, split: str = "val") -> bytes:
    """The UTF-8 text of ``split``, decoded from its token ids document by document (documents
    end at ``eos_id``): the bytes its bits-per-byte figures count (``token_bytes.npy``)."""
    prepared = PreparedDir(data_dir)
    meta = prepared.meta()
    tok = tokenizer.load(prepared.path)
    ids = np.concatenate(
        [
            np.fromfile(prepared.shard_path(split, shard), dtype=meta["dtype"])
            for shard in meta["splits"][split]["shards"]
        ]
    )
    ends = np.flatnonzero(ids == meta["eos_id"])
    docs = np.split(ids, ends + 1)
    return b"".join(tok.decode(d[d != meta["eos_id"]].tolist()).encode() for d in docs if d.size)


def compressor_bits_per_byte(data_dir: Path, split: str = "val") -> dict[str, float]:
    """What the best general-purpose compressors reach on ``split``'s text, in bits per byte:
    ``zlib -9`` (gzip's) and ``xz -9e`` (LZMA2, the extreme preset). A language model that
    does not beat them has learned less about the text than a dictionary coder."""
    import lzma
    import zlib

    text = split_text(data_dir, split)
    packed = {
        "zlib -9": zlib.compress(text, 9),
        "xz -9e": lzma.compress(text, preset=9 | lzma.PRESET_EXTREME),
    }
    return {name: 8 * len(c) / max(1, len(text)) for name, c in packed.items()}


def check_matches_run(meta: dict, *, data_dir: Path, run_dir: Path) -> None:
    """Resuming: the data's tokenizer must be the one the run's model was built for. Compares
    with the run's ``config.json`` (the vocabulary size, and the tokenizer hash of the data
    directory it was started with, when that still exists); UserError on a mismatch."""
    record = rundir.record_or_empty(run_dir)
    old_vocab, old_path = record.vocab_size, record.data_path
    if old_vocab is None or old_path is None:
        return  # not a config.json Anneal wrote; resolve_run's own checks of it apply
    old_data = Path(old_path)
    fix = (
        f"Resume with the data the run was started with (--data {old_data}), or start a "
        f"new run with another --out."
    )
    if old_vocab != meta["vocab_size"]:
        raise UserError(
            f"--data {data_dir}: its tokenizer has {meta['vocab_size']:,} ids, but the model in "
            f"{run_dir} was built for {old_vocab:,} ({record.path}): the checkpoint cannot read "
            f"these ids. {fix}"
        )
    try:
        same_dir = old_data.resolve() == Path(data_dir).resolve()
        old_meta = PreparedDir(old_data).meta_object() if not same_dir else None
    except OSError:
        old_meta = None
    old_sha = old_meta.get("tokenizer_sha256") if isinstance(old_meta, dict) else None
    if isinstance(old_sha, str) and old_sha and old_sha != meta.get("tokenizer_sha256"):
        raise UserError(
            f"--data {data_dir}: its tokenizer ({meta.get('tokenizer_sha256', '?')[:12]}...) "
            f"differs from the one of {old_data} ({old_sha[:12]}...) that the run in {run_dir} "
            f"was trained on; the same ids would mean other text. {fix}"
        )
