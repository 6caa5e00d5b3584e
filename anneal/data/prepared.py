"""Reading a prepared data directory (the output of ``anneal data prepare``; docs/data.md).

Training, the demo and the scripts import this module, never :mod:`anneal.data.prepare`, so
that reading data does not load the multiprocessing writer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from anneal.data import tokenizer as toklib
from anneal.errors import UserError

SPLITS = ("train", "val")


def read_meta(data_dir: Path) -> dict:
    """``meta.json`` of a prepared directory, unchecked (see :func:`check_prepared`)."""
    return json.loads((Path(data_dir) / "meta.json").read_text())


def has_validation(meta: dict, *, seq_len: int = 0) -> bool:
    """Whether the directory described by ``meta`` (its meta.json) has validation data: at
    least one window of ``seq_len + 1`` tokens in one validation shard (windows never cross
    shards; see :class:`anneal.data.stream.PackedSplit`). ``seq_len=0``: any token at all.
    False for data prepared with ``--val-fraction 0``."""
    shards = meta.get("splits", {}).get("val", {}).get("shards", [])
    return any(shard["tokens"] >= seq_len + 1 for shard in shards)


def check_prepared(data_dir: Path) -> dict:
    """meta.json of a complete prepared directory, or a UserError saying what is wrong and
    how to fix it: missing, interrupted, truncated shards, a tokenizer replaced after the
    shards were made, ids that do not fit the dtype."""
    data_dir = Path(data_dir)
    redo = f"Prepare it again with `anneal data prepare --input ... --out {data_dir} --force`."
    meta_path = data_dir / "meta.json"
    if not meta_path.is_file():
        partials = sorted(data_dir.parent.glob(f"{data_dir.name}.partial-*"))
        hint = "it does not exist" if not data_dir.exists() else "it has no meta.json"
        if partials:
            hint += f"; {partials[0].name} is an interrupted prepare"
        raise UserError(
            f"--data {data_dir}: not a prepared data directory ({hint}). Prepare one with "
            f"`anneal data prepare --input stdlib --out {data_dir}`."
        )
    try:
        meta = json.loads(meta_path.read_text())
        vocab, dtype = int(meta["vocab_size"]), np.dtype(meta["dtype"])
        splits = {s: meta["splits"][s] for s in SPLITS}
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{meta_path}: unreadable or incomplete ({e!r}). {redo}") from None
    if vocab > np.iinfo(dtype).max + 1:
        raise UserError(f"{meta_path}: vocab_size {vocab} does not fit dtype {dtype}. {redo}")
    for split, info in splits.items():
        for shard in info["shards"]:
            path = data_dir / split / shard["file"]
            want = shard["tokens"] * dtype.itemsize
            size = path.stat().st_size if path.is_file() else None
            if size != want:
                raise UserError(
                    f"{path}: {'missing' if size is None else f'{size} bytes'}, meta.json says "
                    f"{want} ({shard['tokens']} tokens). The directory is damaged. {redo}"
                )
    token_bytes = data_dir / "token_bytes.npy"
    if not token_bytes.is_file() or len(np.load(token_bytes, mmap_mode="r")) != vocab:
        raise UserError(f"{token_bytes}: missing or not one entry per id ({vocab}). {redo}")
    if "tokenizer_sha256" in meta:
        model = data_dir / "tokenizer.model"
        hf = data_dir / "tokenizer.json"
        if model.is_file() or hf.is_file():
            actual = toklib.tokenizer_sha256(data_dir)
            if actual != meta["tokenizer_sha256"]:
                name = "tokenizer.model" if model.is_file() else "tokenizer.json"
                raise UserError(
                    f"{data_dir / name}: its sha256 {actual[:12]}... differs from the tokenizer "
                    f"the shards were made with ({meta['tokenizer_sha256'][:12]}... in "
                    f"meta.json): the ids in the shards would be read with another "
                    f"vocabulary. Put the original tokenizer back, or {redo[0].lower()}{redo[1:]}"
                )
    return meta


def unigram_entropy_bits_per_byte(data_dir: Path, split: str = "train") -> float:
    """Baseline a model must beat: entropy of the unigram token distribution of ``split``,
    in bits per UTF-8 byte."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    counts = np.zeros(meta["vocab_size"], dtype=np.int64)
    dtype = np.dtype(meta["dtype"])
    chunk = 1 << 20  # ids read at a time: bounded memory for any split size
    for shard in meta["splits"][split]["shards"]:
        for k in range(0, shard["tokens"], chunk):
            ids = np.fromfile(
                data_dir / split / shard["file"],
                dtype=dtype,
                count=min(chunk, shard["tokens"] - k),
                offset=k * dtype.itemsize,
            )
            counts += np.bincount(ids, minlength=meta["vocab_size"])
    p = counts[counts > 0] / counts.sum()
    bits_per_token = float(-(p * np.log2(p)).sum())
    split_meta = meta["splits"][split]
    return bits_per_token * split_meta["tokens"] / split_meta["bytes"]


def check_matches_run(meta: dict, *, data_dir: Path, run_dir: Path) -> None:
    """Resuming: the data's tokenizer must be the one the run's model was built for. Compares
    with the run's ``config.json`` (the vocabulary size, and the tokenizer hash of the data
    directory it was started with, when that still exists); UserError on a mismatch."""
    config_path = Path(run_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
        old_vocab = config["model"]["vocab_size"]
        old_data = Path(config["run"]["data"]["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    fix = (
        f"Resume with the data the run was started with (--data {old_data}), or start a "
        f"new run with another --out."
    )
    if old_vocab != meta["vocab_size"]:
        raise UserError(
            f"--data {data_dir}: its tokenizer has {meta['vocab_size']:,} ids, but the model in "
            f"{run_dir} was built for {old_vocab:,} ({config_path}): the checkpoint cannot read "
            f"these ids. {fix}"
        )
    try:
        same_dir = old_data.resolve() == Path(data_dir).resolve()
        old_meta = json.loads((old_data / "meta.json").read_text()) if not same_dir else None
    except (OSError, ValueError):
        old_meta = None
    old_sha = (old_meta or {}).get("tokenizer_sha256")
    if old_sha and old_sha != meta.get("tokenizer_sha256"):
        raise UserError(
            f"--data {data_dir}: its tokenizer ({meta.get('tokenizer_sha256', '?')[:12]}...) "
            f"differs from the one of {old_data} ({old_sha[:12]}...) that the run in {run_dir} "
            f"was trained on; the same ids would mean other text. {fix}"
        )
