"""Sources cut into work units, and units read back: the registry of readers by name
(:data:`READERS`), the reader of a file by its suffix, and how each kind of ``--input``
(:attr:`Source.kind`) lists its units (:data:`_LISTERS`).

Units come in a fixed order that depends only on the input and ``unit_bytes``; a unit names
its reader, so a worker process reads it with :func:`read_unit` and nothing else. A streamed
dataset's documents travel inside the unit (:class:`Inline`).
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from anneal.data.hub import load_hub_dataset
from anneal.data.readers import Problems, Reader, ReadOptions, Record, Unit
from anneal.data.sources import Source
from anneal.data.table_readers import Arrow, Parquet
from anneal.data.text_readers import JsonLines, TextDocuments, TextFile
from anneal.errors import UserError

_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@dataclass(frozen=True, kw_only=True)
class Inline:
    """A batch of a streamed dataset's documents, read by the source and carried in the unit."""

    records: tuple[Record, ...]


class Stream(Reader):
    """Documents already read (from a streamed dataset), carried in the unit itself."""

    name = "inline"

    def units(self, **_):
        raise AssertionError("stream units are made by the source that reads the stream")

    def read(self, part: Inline, opts, problems):
        yield from part.records


READERS: dict[str, Reader] = {
    r.name: r for r in (TextFile(), TextDocuments(), JsonLines(), Parquet(), Arrow(), Stream())
}


def file_reader(path: Path, *, whole_input: bool = False) -> Reader:
    """The reader of a file by its suffix: JSON Lines, Parquet, else text. A text file that is
    a whole ``--input`` by itself is cut into documents (:class:`TextDocuments`)."""
    name = path.name.lower()
    for reader in (READERS["jsonl"], READERS["parquet"]):
        if name.endswith(reader.suffixes):
            return reader
    return READERS["text-documents" if whole_input else "text"]


def read_unit(unit: Unit, opts: ReadOptions, problems: Problems) -> Iterator[Record]:
    return READERS[unit.reader].read(unit.part, opts, problems)


def source_files(source: Source, opts: ReadOptions) -> list[tuple[Path, str]]:
    """(path, name within the source) of every file of a ``files``/``stdlib`` source,
    sorted."""
    if source.kind == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return [
            (p, p.relative_to(root).as_posix())
            for p in sorted(root.rglob("*.py"))
            if not _STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1])
        ]
    path = Path(source.path)
    if source.synth is not None:
        return [(p, p.relative_to(path).as_posix()) for p in sorted((path / "text").glob("*.txt"))]
    if path.is_file():
        return [(path, path.name)]
    if path.is_dir():
        found = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                full = Path(dirpath) / name
                rel = full.relative_to(path).as_posix()
                if _selected(rel, opts):
                    found.append((full, rel))
        return found
    return [
        (Path(p), p)
        for p in sorted(glob.glob(source.path, recursive=True))
        if Path(p).is_file() and _selected(p, opts)
    ]


def _selected(rel: str, opts: ReadOptions) -> bool:
    if opts.include and not any(fnmatch.fnmatch(rel, g) for g in opts.include):
        return False
    return not any(fnmatch.fnmatch(rel, g) for g in opts.exclude)


def list_units(source: Source, opts: ReadOptions, problems: Problems) -> Iterator[Unit]:
    """The units of ``source`` in their fixed order. Empty files are skipped (counted)."""
    yield from _LISTERS[source.kind](source, opts, problems)


def _file_units(source: Source, opts: ReadOptions, problems: Problems) -> Iterator[Unit]:
    files = source_files(source, opts)
    if not files:
        raise UserError(
            f"--input {source.spec}: no files"
            + (f" match --include {' '.join(opts.include)}" if opts.include else "")
            + ". Check the path and the --include/--exclude globs."
        )
    whole_input = Path(source.path).is_file()  # one file is the whole input: cut it
    for path, rel in files:
        size = path.stat().st_size
        if size == 0:
            problems.empty(f"{source.name}:{rel}")
            continue
        reader = file_reader(path, whole_input=whole_input)
        yield from reader.units(
            source=source.index, label=source.name, path=path, rel=rel, size=size, opts=opts
        )


def arrow_files(path: Path, source: Source) -> list[Path]:
    """Arrow files of a ``save_to_disk`` directory (a Dataset, or one split of a
    DatasetDict). The file names come from its JSON files and must stay inside it."""
    from anneal.files import confined

    if (path / "dataset_dict.json").is_file():
        splits = _json_field(path / "dataset_dict.json", "splits", list)
        split = source.query.get("split", "train")
        if split not in splits:
            raise UserError(
                f"--input {source.spec}: this DatasetDict has splits "
                f"{', '.join(map(str, splits))}; choose one with --input 'hf:{path}?split=NAME'."
            )
        path = confined(path, split, where=f"{path / 'dataset_dict.json'}, key splits")
    files = _json_field(path / "state.json", "_data_files", list)
    where = f"{path / 'state.json'}, key _data_files"
    if not all(isinstance(f, dict) for f in files):
        raise UserError(f"{where}: not a list of objects. Save the dataset again (save_to_disk).")
    return [confined(path, f.get("filename"), where=where) for f in files]


def _json_field(path: Path, key: str, kind: type):
    """``key`` of the JSON object in ``path`` if it has type ``kind``, else a UserError."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{path}: cannot be read as JSON ({e}). Save the dataset again.") from None
    value = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(value, kind):
        raise UserError(
            f"{path}: key {key} is missing or not a {kind.__name__}. The directory is damaged "
            f"or not written by datasets' save_to_disk: save the dataset again."
        )
    return value


def _saved_dataset_units(source: Source, opts: ReadOptions, problems: Problems):
    yield from _arrow_units(source, arrow_files(Path(source.path), source), opts)


def _arrow_units(source: Source, files: list[Path], opts: ReadOptions) -> Iterator[Unit]:
    for path in files:
        yield from READERS["arrow"].units(
            source=source.index,
            label=source.name,
            path=path,
            rel=path.name,
            size=path.stat().st_size,
            opts=opts,
        )


def _hub_units(source: Source, opts: ReadOptions, problems: Problems) -> Iterator[Unit]:
    ds = load_hub_dataset(source, opts)
    if hasattr(ds, "cache_files") and ds.cache_files and getattr(ds, "_indices", None) is None:
        yield from _arrow_units(source, [Path(f["filename"]) for f in ds.cache_files], opts)
        return
    batch, size = [], 0
    for row, example in enumerate(ds):
        text = example.get(opts.text_field)
        if not isinstance(text, str):
            raise UserError(
                f"--input {source.spec}: row {row} has no text field {opts.text_field!r} "
                f"(fields: {', '.join(example)}). Pass --text-field."
            )
        batch.append(Record(f"#{row}", text, True, True))
        size += len(text)
        if size >= opts.unit_bytes:
            yield _inline(source, batch, size)
            batch, size = [], 0
    if batch:
        yield _inline(source, batch, size)


def _inline(source: Source, batch: list[Record], size: int) -> Unit:
    part = Inline(records=tuple(batch))
    return Unit(source=source.index, label=source.name, reader="inline", part=part, nbytes=size)


_LISTERS = {
    "stdlib": _file_units,
    "files": _file_units,
    "arrow": _saved_dataset_units,
    "hub": _hub_units,
}
"""How each kind of --input (Source.kind) lists its units."""


def unit_list(source: Source, opts: ReadOptions, problems: Problems) -> list[Unit] | Callable:
    """A source's units: a list when they can be listed up front (files, Arrow), else a
    function that streams them afresh (hub datasets read by streaming)."""
    if source.kind == "hub" and (opts.streaming or source.query.get("streaming")):
        return functools.partial(list_units, source, opts, problems)  # pickles, unlike a lambda
    return list(list_units(source, opts, problems))


def units_of(units: list[Unit] | Callable) -> Iterator[Unit]:
    """The units of a :func:`unit_list`, from the start."""
    return iter(units()) if callable(units) else iter(units)


def input_files(source: Source, opts: ReadOptions) -> list[list]:
    """[path, size, mtime_ns] of every file ``source`` reads: the inputs as the plan of a
    preparation in tasks saw them (``anneal.data.task_split``); a hub dataset is refused."""
    if source.kind == "hub":
        raise UserError(
            f"--input {source.spec}: a dataset read through the Hugging Face hub cannot be split "
            f"into tasks (each task would download or stream it again). Save it to disk first "
            f"(datasets' save_to_disk) and give that directory, or prepare it on one node "
            f"without --tasks."
        )
    if source.kind == "arrow":
        paths = arrow_files(Path(source.path), source)
    else:
        paths = [p for p, _ in source_files(source, opts)]
    files = []
    for p in paths:
        st = p.stat()
        files.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    return files


def listing_sha256(units: dict) -> str:
    """The hash of every unit (its source, reader, part and bytes), in order: a task that lists
    other units than the plan did would write parts that do not fit together."""
    h = hashlib.sha256()
    for source in sorted(units):
        for u in units[source]:
            h.update(repr((u.source, u.label, u.reader, u.part, u.nbytes)).encode())
    return h.hexdigest()
