"""The tokenizer's files in a prepared data directory: the sha256 of each that ``anneal data
prepare`` records in meta.json (``tokenizer_files``, every file the tokenizer was saved as:
tokenizer.model, tokenizer.json, tokenizer_config.json, ...), and those that differ now, which
``check_prepared`` refuses and ``anneal data verify`` lists (docs/data.md).

A directory prepared before ``tokenizer_files`` existed records only ``tokenizer_sha256``, the
hash of the file that defines the ids (``anneal.data.tokenizer.tokenizer_sha256``); its other
tokenizer files are not covered, and ``anneal data verify`` says so.
"""

from __future__ import annotations

from pathlib import Path

from anneal.data.prepared_dir import META, TOKEN_BYTES
from anneal.data.tokenizer import ids_file
from anneal.files import sha256_file

MODEL = "tokenizer.model"
NOT_TOKENIZER = (META, TOKEN_BYTES)
"""The files of a prepared directory's top level that are not the tokenizer's."""


def record(directory: Path, *, hashed: bool = True) -> dict[str, str]:
    """{file: sha256 (or "" unless ``hashed``)} of every file of ``directory``'s top level but
    dotfiles and ``NOT_TOKENIZER``: called right after the tokenizer is saved into a new
    prepared directory, these are the tokenizer's files."""
    return {
        p.name: sha256_file(p) if hashed else ""
        for p in sorted(Path(directory).iterdir())
        if p.is_file() and p.name[:1] != "." and p.name not in NOT_TOKENIZER
    }


def tokenizer_records(data_dir: Path, meta: dict) -> dict[str, str]:
    """{file: sha256} of the tokenizer as meta.json records it: each of ``tokenizer_files``
    (every file the tokenizer was saved as: tokenizer.model, tokenizer.json,
    tokenizer_config.json, ...) and the file that defines the ids (``tokenizer_sha256``: all
    that a directory prepared before ``tokenizer_files`` records)."""
    records = dict(meta.get("tokenizer_files") or {})
    if "tokenizer_sha256" in meta:
        ids = ids_file(data_dir).name if (data_dir / "tokenizer.json").is_file() else MODEL
        if records.setdefault(ids, meta["tokenizer_sha256"]) != meta["tokenizer_sha256"]:
            return {**records, ids: ""}  # two records disagree: neither can be matched
    return records


def tokenizer_changes(data_dir: Path, meta: dict) -> list[tuple[str, str | None, str]]:
    """(file, its sha256 now or None when missing, the sha256 recorded) for every tokenizer
    file that differs from ``tokenizer_records``."""
    changes = []
    for name, want in tokenizer_records(data_dir, meta).items():
        path = data_dir / name
        actual = sha256_file(path) if path.is_file() else None
        if actual != want:
            changes.append((name, actual, want))
    return changes
