"""Reading a prepared data directory (the output of ``anneal data prepare``; docs/data.md).

Training, the demo and the scripts import this module, never :mod:`anneal.data.prepare`, so
that reading data does not load the multiprocessing writer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from anneal import rundir
from anneal.data import tokenizer as toklib
from anneal.data import tokenizer_files
from anneal.data.tokenizer_files import tokenizer_changes, tokenizer_records
from anneal.errors import UserError
from anneal.files import confined, sha256_file

SPLITS = ("train", "val")
FORMAT_VERSION = 2
"""meta.json's ``format_version`` written by this Anneal; also the marker that ``--force``
looks for before it replaces a directory (:func:`is_prepared_dir`)."""
DTYPES = ("uint16", "uint32")
SHA256_CHARS = 64
MAX_COUNT = 1 << 40


def _redo(data_dir: Path) -> str:
    return f"Prepare it again with `anneal data prepare --input ... --out {data_dir} --force`."


def _meta_error(meta_path: Path, key: str, what: str) -> UserError:
    return UserError(
        f"{meta_path}: key {key} {what}. This meta.json is damaged or was not written by "
        f"`anneal data prepare`. {_redo(meta_path.parent)}"
    )


def _typed(obj: dict, key: str, kind, *, meta_path: Path, at: str, required: bool = True):
    """``obj[key]`` if it has type ``kind`` (for ``int``: not a bool; for ``float``: any
    finite number), else a UserError naming meta.json and the key path ``at``."""
    if key not in obj:
        if required:
            raise _meta_error(meta_path, at, "is missing")
        return None
    value = obj[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    else:
        ok = isinstance(value, kind)
    if not ok:
        name = {
            int: "an integer",
            float: "a finite number",
            str: "a string",
            dict: "an object",
            list: "a list",
        }[kind]
        raise _meta_error(meta_path, at, f"is {_short(value)}, not {name}")
    return value


def _short(value: object) -> str:
    text = json.dumps(value) if isinstance(value, int | float | str | bool | None) else None
    if text is None:
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _count(obj: dict, key: str, *, meta_path: Path, at: str, required: bool = True):
    """A non-negative integer below 2**40 (a trillion ids, far more than any shard or split
    holds), so that sums of them stay exact in int64."""
    value = _typed(obj, key, int, meta_path=meta_path, at=at, required=required)
    if value is not None and not 0 <= value < MAX_COUNT:
        raise _meta_error(meta_path, at, f"is {value}, not 0 to {MAX_COUNT - 1}")
    return value


def read_meta(data_dir: Path, *, splits: tuple[str, ...] = SPLITS) -> dict:
    """``meta.json`` of a prepared directory, its structure checked: any value of the wrong
    type, out of range, a shard named outside the directory (:func:`confined`) or counts that
    disagree is a UserError naming meta.json and the key. Only ``splits`` must be present
    (the token stream reads one). Files are not opened: see :func:`check_prepared`."""
    data_dir = Path(data_dir)
    meta_path = data_dir / "meta.json"
    try:
        meta = json.loads(meta_path.read_bytes())
    except FileNotFoundError:
        raise UserError(
            f"{meta_path}: missing, so {data_dir} is not a prepared data directory. Prepare "
            f"one with `anneal data prepare --input stdlib --out {data_dir}`."
        ) from None
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{meta_path}: cannot be read as JSON ({e}). {_redo(data_dir)}") from None
    if not isinstance(meta, dict):
        raise _meta_error(meta_path, "(top level)", f"is {_short(meta)}, not an object")
    kw = {"meta_path": meta_path}
    version = _count(meta, "format_version", at="format_version", required=False, **kw)
    if version is not None and not 1 <= version <= FORMAT_VERSION:
        raise _meta_error(
            meta_path, "format_version", f"is {version}; this Anneal reads 1 to {FORMAT_VERSION}"
        )
    vocab = _count(meta, "vocab_size", at="vocab_size", **kw)
    dtype = _typed(meta, "dtype", str, at="dtype", **kw)
    if dtype not in DTYPES:
        raise _meta_error(meta_path, "dtype", f"is {_short(dtype)}, not one of {DTYPES}")
    if not 1 <= vocab <= np.iinfo(dtype).max + 1:
        raise _meta_error(meta_path, "vocab_size", f"is {vocab}, not 1 to {dtype}'s ids")
    eos = _count(meta, "eos_id", at="eos_id", required=False, **kw)
    if eos is not None and eos >= vocab:
        raise _meta_error(meta_path, "eos_id", f"is {eos}, not below vocab_size {vocab}")
    _typed(meta, "tokenizer_sha256", str, at="tokenizer_sha256", required=False, **kw)
    files = _typed(meta, "tokenizer_files", dict, at="tokenizer_files", required=False, **kw)
    for name in files or {}:
        confined(data_dir, name, where=f"{meta_path}, key tokenizer_files")
        _sha256(files, name, at=f"tokenizer_files[{name!r}]", **kw)
    n_sources = _check_sources(meta, **kw)
    all_splits = _typed(meta, "splits", dict, at="splits", **kw)
    for split in splits:
        info = _typed(all_splits, split, dict, at=f"splits.{split}", **kw)
        _check_split(info, data_dir / split, n_sources, at=f"splits.{split}", **kw)
    return meta


def _check_sources(meta: dict, *, meta_path: Path) -> int:
    sources = _typed(meta, "sources", list, at="sources", meta_path=meta_path, required=False)
    blend = meta.get("blend", "natural")
    if blend not in ("natural", "weighted"):
        raise _meta_error(meta_path, "blend", f"is {_short(blend)}, not natural or weighted")
    if sources is None:
        if blend == "weighted":
            raise _meta_error(meta_path, "sources", "is missing (blend is weighted)")
        return 1
    if not sources:
        raise _meta_error(meta_path, "sources", "is empty")
    for i, source in enumerate(sources):
        at = f"sources[{i}]"
        if not isinstance(source, dict):
            raise _meta_error(meta_path, at, f"is {_short(source)}, not an object")
        _typed(source, "name", str, at=f"{at}.name", meta_path=meta_path)
        if source.get("weight") is None and blend != "weighted":
            continue  # blended by size: no weight needed
        weight = _typed(source, "weight", float, at=f"{at}.weight", meta_path=meta_path)
        if not weight > 0:
            raise _meta_error(meta_path, f"{at}.weight", f"is {weight}, not above 0")
    return len(sources)


def _check_split(info: dict, directory: Path, n_sources: int, *, meta_path: Path, at: str):
    kw = {"meta_path": meta_path}
    shards = _typed(info, "shards", list, at=f"{at}.shards", **kw)
    total = 0
    for i, shard in enumerate(shards):
        where = f"{at}.shards[{i}]"
        if not isinstance(shard, dict):
            raise _meta_error(meta_path, where, f"is {_short(shard)}, not an object")
        name = _typed(shard, "file", str, at=f"{where}.file", **kw)
        confined(directory, name, where=f"{meta_path}, key {where}.file")
        total += _count(shard, "tokens", at=f"{where}.tokens", **kw)
        source = _count(shard, "source", at=f"{where}.source", required=False, **kw)
        if source is not None and source >= n_sources:
            raise _meta_error(
                meta_path, f"{where}.source", f"is {source}, but there are {n_sources} sources"
            )
        _sha256(shard, "sha256", at=f"{where}.sha256", required=False, **kw)
    for key in ("tokens", "bytes", "documents"):
        _count(info, key, at=f"{at}.{key}", required=False, **kw)
    if "tokens" in info and info["tokens"] != total:
        raise _meta_error(
            meta_path, f"{at}.tokens", f"is {info['tokens']}, but its shards hold {total}"
        )


def _sha256(obj: dict, key: str, *, meta_path: Path, at: str, required: bool = True) -> None:
    sha = _typed(obj, key, str, meta_path=meta_path, at=at, required=required)
    if sha is not None and (len(sha) != SHA256_CHARS or not _is_hex(sha)):
        raise _meta_error(meta_path, at, "is not 64 hexadecimal digits")


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return text.isascii() and text.isalnum()


def is_prepared_dir(path: Path) -> bool:
    """Whether ``path`` carries the marker of ``anneal data prepare``: a meta.json object with
    an integer ``format_version`` (what ``--force`` may replace)."""
    try:
        meta = json.loads((Path(path) / "meta.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    version = meta.get("format_version") if isinstance(meta, dict) else None
    return isinstance(version, int) and not isinstance(version, bool)


def has_validation(meta: dict, *, seq_len: int = 0) -> bool:
    """Whether the directory described by ``meta`` (its meta.json) has validation data: at
    least one window of ``seq_len + 1`` tokens in one validation shard (windows never cross
    shards; see :class:`anneal.data.stream.PackedSplit`). ``seq_len=0``: any token at all.
    False for data prepared with ``--val-fraction 0``."""
    shards = meta.get("splits", {}).get("val", {}).get("shards", [])
    return any(shard["tokens"] >= seq_len + 1 for shard in shards)


def shard_path(data_dir: Path, split: str, shard: dict) -> Path:
    """The file of one shard entry of a meta.json checked by :func:`read_meta`."""
    return Path(data_dir) / split / shard["file"]


def check_prepared(data_dir: Path) -> dict:
    """meta.json of a complete prepared directory, or a UserError saying what is wrong and
    how to fix it: missing, interrupted, garbage in meta.json, truncated shards, a tokenizer
    replaced after the shards were made. Sizes only: :func:`verify` re-hashes the shards."""
    data_dir = Path(data_dir)
    meta_path = data_dir / "meta.json"
    if not meta_path.is_file():
        prefix = f"{data_dir.name}.partial-"
        partials = sorted(
            p for p in data_dir.parent.glob("*.partial-*") if p.name.startswith(prefix)
        )
        hint = "it does not exist" if not data_dir.exists() else "it has no meta.json"
        if partials:
            hint += f"; {partials[0].name} is an interrupted prepare"
        raise UserError(
            f"--data {data_dir}: not a prepared data directory ({hint}). Prepare one with "
            f"`anneal data prepare --input stdlib --out {data_dir}`."
        )
    redo = _redo(data_dir)
    meta = read_meta(data_dir)
    vocab, dtype = meta["vocab_size"], np.dtype(meta["dtype"])
    for split in SPLITS:
        for shard in meta["splits"][split]["shards"]:
            path = shard_path(data_dir, split, shard)
            want = shard["tokens"] * dtype.itemsize
            size = path.stat().st_size if path.is_file() else None
            if size != want:
                raise UserError(
                    f"{path}: {'missing' if size is None else f'{size} bytes'}, meta.json says "
                    f"{want} ({shard['tokens']} tokens). The directory is damaged. {redo}"
                )
    token_bytes = data_dir / "token_bytes.npy"
    try:
        n_entries = len(np.load(token_bytes, mmap_mode="r")) if token_bytes.is_file() else None
    except (OSError, ValueError, TypeError):
        n_entries = None
    if n_entries != vocab:
        raise UserError(f"{token_bytes}: missing or not one entry per id ({vocab}). {redo}")
    if changes := tokenizer_changes(data_dir, meta):
        name, actual, want = changes[0]
        now = f"its sha256 {actual[:12]}... differs from" if actual else "missing, but part of"
        raise UserError(
            f"{data_dir / name}: {now} the tokenizer the shards were made with ({want[:12]}... "
            f"in meta.json): the ids in the shards would be read, or a model exported, with "
            f"another vocabulary. Put the original file back, or {redo[0].lower()}{redo[1:]}"
        )
    return meta


def verify(data_dir: Path) -> dict:
    """``anneal data verify``: re-hash every shard against the sha256 in meta.json, and every
    tokenizer file (``tokenizer_records``). Returns the shards checked, their bytes, the
    tokenizer files checked and the top-level files meta.json has no hash for ("uncovered": a
    directory prepared before ``tokenizer_files``); a UserError lists every file that is
    missing, of the wrong size or differs."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    dtype = np.dtype(meta["dtype"])
    bad: list[str] = []
    files = nbytes = 0
    for split in SPLITS:
        for shard in meta["splits"][split]["shards"]:
            path = shard_path(data_dir, split, shard)
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
                if sha256_file(path) != shard["sha256"]:
                    bad.append(f"{rel} (sha256 differs: the bytes changed)")
    shards, tokenizer = files, sorted(tokenizer_records(data_dir, meta))
    files += len(tokenizer)
    changed = tokenizer_changes(data_dir, meta)
    bad += [f"{n} ({'sha256 differs' if a else 'missing'})" for n, a, _ in changed]
    if bad:
        listed = "; ".join(bad[:20]) + (f"; and {len(bad) - 20} more" if len(bad) > 20 else "")
        export = ", and an export would ship another tokenizer" if changed else ""
        raise UserError(
            f"{data_dir}: {len(bad)} of {files} files do not match meta.json: {listed}. "
            f"Training on them would read wrong token ids{export}. {_redo(data_dir)}"
        )
    uncovered = sorted(set(tokenizer_files.record(data_dir, hashed=False)) - set(tokenizer))
    return {"shards": shards, "bytes": nbytes, "tokenizer": tokenizer, "uncovered": uncovered}


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
                shard_path(data_dir, split, shard),
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
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    tok = toklib.load(data_dir)
    ids = np.concatenate(
        [
            np.fromfile(shard_path(data_dir, split, shard), dtype=meta["dtype"])
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
    config_path = rundir.config_path(run_dir)
    config = rundir.config_or_empty(run_dir)
    try:
        old_vocab = config["model"]["vocab_size"]
        old_data = Path(config["run"]["data"]["path"])
    except (KeyError, TypeError):
        return
    if not isinstance(old_vocab, int):
        return  # not a config.json Anneal wrote; resolve_run's own checks of it apply
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
    except (OSError, ValueError, RecursionError):
        old_meta = None
    old_sha = old_meta.get("tokenizer_sha256") if isinstance(old_meta, dict) else None
    if isinstance(old_sha, str) and old_sha and old_sha != meta.get("tokenizer_sha256"):
        raise UserError(
            f"--data {data_dir}: its tokenizer ({meta.get('tokenizer_sha256', '?')[:12]}...) "
            f"differs from the one of {old_data} ({old_sha[:12]}...) that the run in {run_dir} "
            f"was trained on; the same ids would mean other text. {fix}"
        )
