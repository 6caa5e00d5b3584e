"""The one owner of a prepared data directory's layout (the output of ``anneal data prepare``;
docs/data.md): the names of its files, reading and writing ``meta.json`` (its structure checked
by ``read_meta``), the ``token_bytes.npy`` table, where each shard lies, and the tokenizer's
files with the sha256 of each that meta.json records (``tokenizer_files``, every file the
tokenizer was saved as: tokenizer.model, tokenizer.json, tokenizer_config.json, ...), and those
that differ now, which ``check_prepared`` refuses and ``anneal data verify`` lists. Every other
module reaches these files through a ``PreparedDir``.

A directory prepared before ``tokenizer_files`` existed records only ``tokenizer_sha256``, the
hash of the file that defines the ids (``anneal.data.tokenizer.tokenizer_sha256``); its other
tokenizer files are not covered, and ``anneal data verify`` says so.

```
DIR/
  meta.json          vocab size, dtype, counts per split and source, tokenizer hashes, ...
  provenance.json    how it was made: the command, seconds, workers (not hashed)
  token_bytes.npy    the UTF-8 bytes each id stands for (bits per byte)
  tokenizer.*        the tokenizer's files (meta.json's tokenizer_files records their hashes)
  train/ val/        each split's shards (SS_NNNNN.bin: source SS, shard NNNNN; meta.json's
                     splits.<split>.shards[].file) and SS_docs.bin (where documents end)
```

A synthetic corpus (``anneal data synth``) carries a ``meta.json`` too, read as a JSON object
through ``PreparedDir.meta_object``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from anneal.data.tokenizer import ids_file
from anneal.errors import UserError
from anneal.files import confined, sha256_file

META = "meta.json"
TOKEN_BYTES = "token_bytes.npy"
PROVENANCE = "provenance.json"
"""How the directory was made (the command, the Python, seconds, workers; for a merge, each
task's): the one file that differs between two preparations of the same data, which
:func:`content_sha256` leaves out."""
TOKENIZER_MODEL = "tokenizer.model"
NOT_TOKENIZER = (META, TOKEN_BYTES, PROVENANCE)
"""The files of a prepared directory's top level that are not the tokenizer's."""
SPLITS = ("train", "val")
FORMAT_VERSION = 2
"""meta.json's ``format_version`` written by this Anneal; also the marker that ``--force``
looks for before it replaces a directory (``anneal.data.checks.is_prepared_dir``)."""
ID_DTYPES = ("uint16", "uint32")
SHA256_CHARS = 64
MAX_COUNT = 1 << 40


@dataclasses.dataclass(frozen=True)
class PreparedDir:
    """A prepared data directory: where each of its files lies, and its ``meta.json`` and
    ``token_bytes.npy`` read and written."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def of(cls, where: str | Path | PreparedDir) -> PreparedDir:
        """``where`` as a PreparedDir (itself when it is one)."""
        return where if isinstance(where, PreparedDir) else cls(Path(where))

    @property
    def meta_file(self) -> Path:
        return self.path / META

    @property
    def token_bytes_file(self) -> Path:
        return self.path / TOKEN_BYTES

    def split_dir(self, split: str) -> Path:
        return self.path / split

    def shard_path(self, split: str, shard: dict) -> Path:
        """The file of one shard entry of a meta.json checked by :func:`read_meta`."""
        return self.split_dir(split) / shard["file"]

    @staticmethod
    def shard_name(source: int, index: int) -> str:
        """The name ``anneal data prepare`` gives shard ``index`` of source ``source`` in a
        split's directory (meta.json's ``file``)."""
        return f"{source:02d}_{index:05d}.bin"

    @staticmethod
    def docs_name(source: int) -> str:
        """The file of a split's directory that holds the end offset of each document of
        source ``source`` (uint64, in the coordinates of its shards concatenated)."""
        return f"{source:02d}_docs.bin"

    def meta(self, *, splits: tuple[str, ...] = SPLITS) -> dict:
        """``meta.json``, its structure checked (:func:`read_meta`)."""
        return read_meta(self.path, splits=splits)

    def meta_object(self) -> dict | None:
        """``meta.json`` when it is a readable JSON object, else None, its structure not
        checked (the markers that ``--force`` looks for, a comparison of two directories)."""
        try:
            meta = json.loads(self.meta_file.read_bytes())
        except (OSError, ValueError, RecursionError):
            return None
        return meta if isinstance(meta, dict) else None

    def eos_id(self, meta: dict) -> int:
        """The id that ends each document of the shards: meta.json's ``eos_id``, or, in a
        directory prepared before meta.json recorded it, the saved tokenizer's."""
        from anneal.data.tokenizer import load

        return meta["eos_id"] if "eos_id" in meta else load(self.path).eos_id

    def token_bytes(self, *, mmap_mode: str | None = None) -> np.ndarray:
        """``token_bytes.npy``: the UTF-8 bytes of each id (one entry per id)."""
        return np.load(self.token_bytes_file, mmap_mode=mmap_mode)

    def write_meta(self, meta: dict) -> None:
        self.meta_file.write_text(json.dumps(meta, indent=2) + "\n")

    def write_provenance(self, record: dict) -> None:
        (self.path / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")

    def provenance(self) -> dict:
        """provenance.json as a JSON object ({} when absent or unreadable: it is a log, read
        by people and benchmarks, never by training). A directory prepared before it existed
        has these keys in meta.json."""
        try:
            record = json.loads((self.path / PROVENANCE).read_bytes())
        except (OSError, ValueError, RecursionError):
            return {}
        return record if isinstance(record, dict) else {}

    def content_sha256(self, *, meta: dict | None = None, checked: dict | None = None) -> str:
        """One sha256 over the whole tree but provenance.json: ``sha256sum``'s line for every
        file (its sha256, two spaces, its path relative to the directory), sorted by path as
        bytes, hashed. In the directory: ``find . -type f ! -path ./provenance.json -printf
        '%P\\n' | LC_ALL=C sort | xargs sha256sum | sha256sum``. Two preparations of the same
        inputs with the same settings, on one node or merged from many tasks, have the same
        one. ``meta``: meta.json, its shards' sha256 just verified (``anneal data verify``), taken
        for theirs instead of reading them again; ``checked``: {relative path: sha256} of other
        files just checked against their records, taken likewise."""
        known = (checked or {}) | {
            f"{split}/{shard['file']}": shard["sha256"]
            for split in SPLITS
            for shard in (meta or {}).get("splits", {}).get(split, {}).get("shards", [])
        }
        files = {p.relative_to(self.path).as_posix(): p for p in self.path.rglob("*")}
        lines = [
            f"{known.get(rel) or sha256_file(files[rel])}  {rel}\n"
            for rel in sorted(files, key=os.fsencode)
            if files[rel].is_file() and rel != PROVENANCE
        ]
        return hashlib.sha256("".join(lines).encode()).hexdigest()

    def write_token_bytes(self, table: np.ndarray) -> None:
        np.save(self.token_bytes_file, table)

    def tokenizer_files(self, *, hashed: bool = True) -> dict[str, str]:
        """{file: sha256 (or "" unless ``hashed``)} of every file of the top level but
        dotfiles and ``NOT_TOKENIZER``: called right after the tokenizer is saved into a new
        prepared directory, these are the tokenizer's files."""
        return {
            p.name: sha256_file(p) if hashed else ""
            for p in sorted(self.path.iterdir())
            if p.is_file() and p.name[:1] != "." and p.name not in NOT_TOKENIZER
        }

    def tokenizer_records(self, meta: dict) -> dict[str, str]:
        """{file: sha256} of the tokenizer as ``meta`` (its meta.json) records it: each of
        ``tokenizer_files`` and the file that defines the ids (``tokenizer_sha256``: all that a
        directory prepared before ``tokenizer_files`` records)."""
        records = dict(meta.get("tokenizer_files") or {})
        if "tokenizer_sha256" in meta:
            has_json = (self.path / "tokenizer.json").is_file()
            ids = ids_file(self.path).name if has_json else TOKENIZER_MODEL
            if records.setdefault(ids, meta["tokenizer_sha256"]) != meta["tokenizer_sha256"]:
                return {**records, ids: ""}  # two records disagree: neither can be matched
        return records

    def tokenizer_changes(self, meta: dict) -> list[tuple[str, str | None, str]]:
        """(file, its sha256 now or None when missing, the sha256 recorded) for every tokenizer
        file that differs from ``tokenizer_records``."""
        changes = []
        for name, want in self.tokenizer_records(meta).items():
            path = self.path / name
            actual = sha256_file(path) if path.is_file() else None
            if actual != want:
                changes.append((name, actual, want))
        return changes


def how_to_prepare(data_dir: Path) -> str:
    """The end of a message about a directory that is not prepared: a directory that holds
    files (most likely the user's raw corpus) is prepared into a new one beside it, never into
    itself (prepare refuses a directory that is not empty); a missing or empty one is prepared
    in place."""
    data_dir = Path(data_dir)
    try:
        holds_files = data_dir.is_dir() and any(data_dir.iterdir())
    except OSError:
        holds_files = False
    if holds_files:
        new = data_dir.with_name(f"{data_dir.name}-prepared")
        return (
            f"If it holds your text, prepare it into a new directory: `anneal data prepare "
            f"--input {data_dir} --out {new}`, then give {new}."
        )
    return (
        f"Prepare one with `anneal data prepare --input YOUR_TEXT --out {data_dir}` "
        f"(`--input stdlib` for the embedded demo corpus)."
    )


def prepare_again(data_dir: Path) -> str:
    """The end of a message about a damaged directory: how to prepare it again."""
    return f"Prepare it again with `anneal data prepare --input ... --out {data_dir} --force`."


def _meta_error(meta_path: Path, key: str, what: str) -> UserError:
    return UserError(
        f"{meta_path}: key {key} {what}. This meta.json is damaged or was not written by "
        f"`anneal data prepare`. {prepare_again(meta_path.parent)}"
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
    meta_path = PreparedDir(data_dir).meta_file
    try:
        meta = json.loads(meta_path.read_bytes())
    except FileNotFoundError:
        raise UserError(
            f"{meta_path}: missing, so {data_dir} is not a prepared data directory. "
            f"{how_to_prepare(data_dir)}"
        ) from None
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(
            f"{meta_path}: cannot be read as JSON ({e}). {prepare_again(data_dir)}"
        ) from None
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
    if dtype not in ID_DTYPES:
        raise _meta_error(meta_path, "dtype", f"is {_short(dtype)}, not one of {ID_DTYPES}")
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
        _check_split(
            info, PreparedDir(data_dir).split_dir(split), n_sources, at=f"splits.{split}", **kw
        )
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
