"""What ``anneal data prepare --input`` accepts, cut into work units of bounded size.

``--input SRC[:WEIGHT]``, where SRC is one of

- ``stdlib``: the running Python's standard library source (the embedded default);
- a plain-text file (one document per file), or ``.gz`` of one;
- a JSON Lines file (``.jsonl``, ``.ndjson``, optionally ``.gz``): one document per line, its
  text in ``--text-field``;
- a Parquet file (``.parquet``): one document per row, its text in the ``--text-field`` column;
- a directory: every file below it (recursive, sorted, hidden files skipped) whose path
  relative to it matches ``--include`` and not ``--exclude`` globs, each read by its suffix;
  a directory written by ``datasets``' ``save_to_disk`` is read as that dataset, and one written
  by ``anneal data synth`` as its text;
- a glob (``'shards/*.jsonl'``): the matching files, sorted;
- ``hf:NAME[?config=C&split=S&revision=R&streaming=1]``: a Hugging Face dataset by hub name or
  local path, through ``datasets.load_dataset``.

A unit is a byte range of a text or JSON Lines file (records belong to the unit holding their
first byte), a Parquet row group, a row range of an Arrow file, or a batch of documents read
from a stream. Workers read units independently and the writer takes them in order, so the
output does not depend on the number of workers.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import json
import logging
import os
import re
import socket
import sysconfig
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qsl, urlparse

from anneal.errors import UserError

log = logging.getLogger(__name__)

ON_ERROR = ("stop", "skip")
HUB_TIMEOUT_S = 5.0
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """How sources are read; the same for every input of one prepare."""

    text_field: str = "text"
    """JSON Lines key / Parquet or dataset column holding a document's text."""
    include: tuple[str, ...] = ()
    """Globs on a directory's relative file paths; empty: every file."""
    exclude: tuple[str, ...] = ()
    on_error: str = "stop"
    """stop: a bad record (invalid JSON or UTF-8, missing field) is an error naming it; skip:
    leave it out, count it in meta.json and warn."""
    streaming: bool = False
    """Hub datasets: stream records instead of downloading the dataset first."""
    unit_bytes: int = 4 << 20
    """Target input bytes per work unit (bounds each worker's memory)."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """One ``--input``."""

    index: int
    spec: str
    """The --input value without its weight."""
    name: str
    """Label in meta.json, log lines and the validation hash of its documents."""
    kind: str
    """stdlib | files | arrow | hub"""
    weight: float | None
    """Share of training samples (the stream blends sources by it); None: by size."""
    path: str = ""
    query: dict = field(default_factory=dict)
    synth: dict | None = None
    """meta.json of a directory written by ``anneal data synth`` (its entropy rate)."""


class Record(NamedTuple):
    """A document or a piece of one (a text file larger than a unit is read in pieces)."""

    name: str
    text: str
    first: bool
    last: bool


@dataclass(frozen=True, kw_only=True)
class Unit:
    """A bounded piece of work: a worker reads it, tokenizes it and returns its ids."""

    source: int
    label: str
    fmt: str
    """text | jsonl | parquet | arrow | inline"""
    path: str = ""
    rel: str = ""
    """Name of the file within its source (document names, messages)."""
    start: int = 0
    """Byte offset (text, jsonl), row group (parquet) or first row (arrow)."""
    end: int = 0
    size: int = 0
    """Whole file size in bytes (text, jsonl)."""
    first_row: int = 0
    """Index of the unit's first row in its file (parquet), for document names."""
    compressed: bool = False
    records: tuple = ()
    nbytes: int = 0
    """Input bytes this unit covers (progress)."""


class Problems:
    """Bad records: an error (``stop``) or counted and skipped (``skip``)."""

    def __init__(self, on_error: str, *, quiet: bool = False):
        if on_error not in ON_ERROR:
            raise UserError(f"--on-error {on_error}: choose one of {', '.join(ON_ERROR)}.")
        self.on_error = on_error
        self.quiet = quiet
        self.skipped = 0
        self.empty_files = 0
        self.empty_examples: list[str] = []
        self.examples: list[str] = []

    def empty(self, path: str) -> None:
        """An empty file: nothing to read (counted; one summary warning at the end)."""
        self.empty_files += 1
        if len(self.empty_examples) < 3:
            self.empty_examples.append(path)

    def bad(self, where: str, what: str, fix: str) -> None:
        if self.on_error == "stop":
            raise UserError(
                f"{where}: {what}. {fix} or pass --on-error skip to leave such records out."
            )
        self.skipped += 1
        if len(self.examples) < 20:
            self.examples.append(f"{where}: {what}")
        if not self.quiet:
            log.warning("skipped %s: %s", where, what)


# ---------------------------------------------------------------------------------------------
# --input parsing


_WEIGHT = re.compile(r"^(?P<src>.+):(?P<w>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")


def parse_inputs(specs: list[str]) -> list[Source]:
    """``--input`` values -> sources. Weights go on every input or on none."""
    sources = [_parse(spec, i) for i, spec in enumerate(specs)]
    weighted = [s for s in sources if s.weight is not None]
    if weighted and len(weighted) != len(sources):
        raise UserError(
            f"--input: {len(weighted)} of {len(sources)} inputs have a weight "
            f"({', '.join(s.spec for s in weighted)}). Give every input a weight "
            f"(--input a.jsonl:0.7 --input b/:0.3) or none (blend by size)."
        )
    names = [s.name for s in sources]
    for s in sources:
        if names.count(s.name) > 1:
            raise UserError(
                f"--input: two inputs are both named {s.name!r}; give each "
                f"source once (a directory covers all its files)."
            )
    return sources


def _parse(spec: str, index: int) -> Source:
    weight = None
    m = _WEIGHT.match(spec)
    if m and not Path(spec).exists():
        spec, weight = m["src"], float(m["w"])
        if not weight > 0:
            raise UserError(f"--input {spec}:{m['w']}: a weight must be above 0.")
    if spec == "stdlib":
        return Source(index=index, spec=spec, name="stdlib", kind="stdlib", weight=weight)
    if spec.startswith("hf:"):
        url = urlparse(spec[3:])
        query = dict(parse_qsl(url.query))
        unknown = set(query) - {"config", "split", "revision", "streaming"}
        if unknown:
            raise UserError(
                f"--input {spec}: unknown option(s) {', '.join(sorted(unknown))}; "
                f"use config=, split=, revision=, streaming=1."
            )
        name = url.path
        if not name:
            raise UserError(f"--input {spec}: give a dataset name or path after 'hf:'.")
        if _is_saved_dataset(Path(name)):  # save_to_disk output: load_dataset cannot read it
            return Source(
                index=index,
                spec=spec,
                name=_saved_dataset_name(Path(name), query),
                kind="arrow",
                weight=weight,
                path=name,
                query=query,
            )
        return Source(
            index=index, spec=spec, name=name, kind="hub", weight=weight, path=name, query=query
        )
    path = Path(spec)
    if path.is_dir():
        if _is_saved_dataset(path):
            return Source(
                index=index,
                spec=spec,
                name=_saved_dataset_name(path, {}),
                kind="arrow",
                weight=weight,
                path=str(path),
            )
        synth = _synth_meta(path)
        return Source(
            index=index,
            spec=spec,
            name=path.resolve().name,
            kind="files",
            weight=weight,
            path=str(path),
            synth=synth,
        )
    if path.is_file():
        return Source(
            index=index, spec=spec, name=path.name, kind="files", weight=weight, path=str(path)
        )
    if glob.has_magic(spec):
        if not glob.glob(spec, recursive=True):
            raise UserError(f"--input {spec}: the glob matches no file.")
        return Source(index=index, spec=spec, name=spec, kind="files", weight=weight, path=spec)
    raise UserError(
        f"--input {spec}: no such file or directory. Give a file, a directory, a glob, "
        f"'stdlib', or hf:NAME for a Hugging Face dataset."
    )


def _is_saved_dataset(path: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _saved_dataset_name(path: Path, query: dict) -> str:
    """The directory's name, and the split's for a DatasetDict (``dd/test``)."""
    name = path.resolve().name
    if (path / "dataset_dict.json").is_file():
        name += "/" + query.get("split", "train")
    return name


def _synth_meta(path: Path) -> dict | None:
    meta = path / "meta.json"
    if not meta.is_file():
        return None
    try:
        data = json.loads(meta.read_text())
    except ValueError:
        return None
    return data.get("synth") if isinstance(data, dict) else None


# ---------------------------------------------------------------------------------------------
# Sources -> units


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


def file_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def list_units(source: Source, opts: ReadOptions, problems: Problems) -> Iterator[Unit]:
    """The units of ``source`` in their fixed order. Empty files are skipped with a warning."""
    if source.kind == "hub":
        yield from _hub_units(source, opts)
        return
    if source.kind == "arrow":
        yield from _arrow_units(source, _arrow_files(Path(source.path), source), opts)
        return
    files = source_files(source, opts)
    if not files:
        raise UserError(
            f"--input {source.spec}: no files"
            + (f" match --include {' '.join(opts.include)}" if opts.include else "")
            + ". Check the path and the --include/--exclude globs."
        )
    for path, rel in files:
        yield from _file_units(source, path, rel, opts, problems)


def _file_units(source: Source, path: Path, rel: str, opts: ReadOptions, problems: Problems):
    size = path.stat().st_size
    fmt = file_format(path)
    if size == 0:
        problems.empty(f"{source.name}:{rel}")
        return
    common = dict(source=source.index, label=source.name, path=str(path), rel=rel, size=size)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if opts.text_field not in pf.schema_arrow.names:
            raise UserError(
                f"{path}: no column {opts.text_field!r} (columns: "
                f"{', '.join(pf.schema_arrow.names)}). Pass --text-field with the text column."
            )
        first_row = 0
        md = pf.metadata
        for g in range(md.num_row_groups):
            rows = md.row_group(g).num_rows
            group_bytes = md.row_group(g).total_byte_size
            yield Unit(
                **common,
                first_row=first_row,
                fmt="parquet",
                start=g,
                end=rows,
                nbytes=group_bytes,
            )
            first_row += rows
        return
    if path.name.lower().endswith(".gz"):
        yield Unit(**common, fmt=fmt, start=0, end=size, compressed=True, nbytes=size)
        return
    n = max(1, -(-size // opts.unit_bytes))
    for k in range(n):
        start, end = k * size // n, (k + 1) * size // n
        yield Unit(**common, fmt=fmt, start=start, end=end, nbytes=end - start)


def _arrow_files(path: Path, source: Source) -> list[Path]:
    """Arrow files of a ``save_to_disk`` directory (a Dataset, or one split of a
    DatasetDict)."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        split = source.query.get("split", "train")
        if split not in splits:
            raise UserError(
                f"--input {source.spec}: this DatasetDict has splits {', '.join(splits)}; "
                f"choose one with --input 'hf:{path}?split=NAME'."
            )
        path = path / split
    state = json.loads((path / "state.json").read_text())
    return [path / f["filename"] for f in state["_data_files"]]


def _arrow_units(source: Source, files: list[Path], opts: ReadOptions) -> Iterator[Unit]:
    import pyarrow as pa

    for path in files:
        with pa.memory_map(str(path)) as mm:
            table = pa.ipc.open_stream(mm).read_all()
        if opts.text_field not in table.column_names:
            raise UserError(
                f"{path}: no column {opts.text_field!r} (columns: "
                f"{', '.join(table.column_names)}). Pass --text-field with the text column."
            )
        size = path.stat().st_size
        rows = table.num_rows
        n = max(1, -(-size // opts.unit_bytes))
        for k in range(n):
            start, end = k * rows // n, (k + 1) * rows // n
            if end > start:
                yield Unit(
                    source=source.index,
                    label=source.name,
                    fmt="arrow",
                    path=str(path),
                    rel=path.name,
                    start=start,
                    end=end,
                    nbytes=(end - start) * size // max(rows, 1),
                )


# ---------------------------------------------------------------------------------------------
# Hugging Face Hub


def _hub_offline() -> bool:
    return any(
        os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _probe_hub(spec: str, timeout_s: float = HUB_TIMEOUT_S) -> None:
    """Fail within ``timeout_s`` when the Hub cannot be reached, instead of hanging in retries
    (name resolution has no timeout of its own, so it runs in a thread)."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    outcome: list[BaseException | None] = []

    def connect():
        try:
            socket.create_connection((url.hostname, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(e)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome or outcome[0] is not None:
        why = f"{outcome[0]}" if outcome else f"no answer within {timeout_s:.0f} s"
        raise UserError(
            f"--input {spec}: cannot reach the Hugging Face Hub at {endpoint} ({why}); this "
            f"machine looks offline. To use a copy in the local cache, set HF_HUB_OFFLINE=1; "
            f"otherwise save the dataset on a machine with network access "
            f"(datasets' save_to_disk) and pass that directory as --input."
        )


def load_hub_dataset(source: Source, opts: ReadOptions):
    """``datasets.load_dataset`` for an ``hf:`` input, failing fast and clearly offline."""
    local = Path(source.path).exists()
    offline = _hub_offline()
    if not local and not offline:
        _probe_hub(source.spec)
    import datasets

    streaming = opts.streaming or source.query.get("streaming", "") in ("1", "true", "yes")
    try:
        ds = datasets.load_dataset(
            source.path,
            source.query.get("config"),
            split=source.query.get("split", "train"),
            revision=source.query.get("revision"),
            streaming=streaming,
        )
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; all end here
        hint = (
            " HF_HUB_OFFLINE is set, so only the local cache is used and this dataset is not "
            "in it: unset it on a machine with network access, or pass a local copy."
            if offline and not local
            else " Check the name, config= and split=."
        )
        raise UserError(
            f"--input {source.spec}: datasets.load_dataset failed ({type(e).__name__}: {e}).{hint}"
        ) from None
    return ds


def _hub_units(source: Source, opts: ReadOptions) -> Iterator[Unit]:
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
            yield Unit(
                source=source.index,
                label=source.name,
                fmt="inline",
                records=tuple(batch),
                nbytes=size,
            )
            batch, size = [], 0
    if batch:
        yield Unit(
            source=source.index, label=source.name, fmt="inline", records=tuple(batch), nbytes=size
        )


# ---------------------------------------------------------------------------------------------
# Units -> records (runs in the workers)


def read_unit(unit: Unit, opts: ReadOptions, problems: Problems) -> Iterator[Record]:
    if unit.fmt == "inline":
        yield from unit.records
    elif unit.fmt == "text":
        yield from _read_text(unit, opts, problems)
    elif unit.fmt == "jsonl":
        yield from _read_jsonl(unit, opts, problems)
    elif unit.fmt == "parquet":
        yield from _read_parquet(unit, opts, problems)
    elif unit.fmt == "arrow":
        yield from _read_arrow(unit, opts, problems)
    else:
        raise AssertionError(unit.fmt)


def _decode(data: bytes, where: str, offset: int, problems: Problems) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        problems.bad(
            f"{where}: byte {offset + e.start}",
            "not valid UTF-8",
            "Convert the file to UTF-8 (iconv -f SOURCE -t UTF-8)",
        )
        return None


def _aligned_lines(path: str, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the lines whose first byte lies in [start, end)."""
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # finish the line that started before this unit
        pos = f.tell()
        while pos < end:
            line = f.readline()
            if not line:
                return
            yield pos, line
            pos += len(line)


def _read_text(unit: Unit, opts: ReadOptions, problems: Problems) -> Iterator[Record]:
    if unit.compressed:
        # One document, streamed in pieces of about unit_bytes.
        with gzip.open(unit.path, "rb") as f:
            buf, size, pos, first = [], 0, 0, True
            for line in f:
                buf.append(line)
                size += len(line)
                if size >= opts.unit_bytes:
                    text = _decode(b"".join(buf), unit.path, pos, problems)
                    if text is not None:
                        yield Record(unit.rel, text, first, False)
                    first, pos, buf, size = False, pos + size, [], 0
            text = _decode(b"".join(buf), unit.path, pos, problems)
            yield Record(unit.rel, text or "", first, True)
        return
    if unit.start == 0 and unit.end == unit.size:
        with open(unit.path, "rb") as f:
            data = f.read()
        text = _decode(data, unit.path, 0, problems)
        if text is not None:
            yield Record(unit.rel, text, True, True)
        return
    data = b"".join(line for _, line in _aligned_lines(unit.path, unit.start, unit.end))
    first, last = unit.start == 0, unit.end == unit.size
    offset = unit.start
    if not data and not last:
        return
    text = _decode(data, unit.path, offset, problems)
    # A bad piece of a large document is left out; its end (EOS) is kept.
    yield Record(unit.rel, text or "", first, last)


def _line_number(path: str, offset: int) -> int:
    """1-based line number of the byte at ``offset`` (only computed for messages)."""
    count, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            chunk = f.read(min(1 << 20, offset - done))
            if not chunk:
                break
            count += chunk.count(b"\n")
            done += len(chunk)
    return count


def _jsonl_lines(unit: Unit) -> Iterator[tuple[int, bytes, int]]:
    """(offset, line, line number or 0 when not counted) of the unit's lines."""
    if unit.compressed:
        with gzip.open(unit.path, "rb") as f:
            for n, line in enumerate(f, start=1):
                yield n, line, n
        return
    for pos, line in _aligned_lines(unit.path, unit.start, unit.end):
        yield pos, line, 0


def _read_jsonl(unit: Unit, opts: ReadOptions, problems: Problems) -> Iterator[Record]:
    key = opts.text_field

    def where(pos: int, lineno: int) -> str:  # counted only for a message
        return f"{unit.path}:{lineno or _line_number(unit.path, pos)}"

    for pos, line, lineno in _jsonl_lines(unit):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except UnicodeDecodeError:
            _decode(line, where(pos, lineno), 0, problems)
            continue
        except ValueError as e:
            problems.bad(where(pos, lineno), f"not JSON ({e})", "Fix or remove the line")
            continue
        if not isinstance(obj, dict):
            problems.bad(
                where(pos, lineno),
                f"a JSON {type(obj).__name__}, not an object",
                "Each line must be one JSON object",
            )
            continue
        text = obj.get(key)
        if not isinstance(text, str):
            what = (
                f"no field {key!r} (fields: {', '.join(list(obj)[:10])})"
                if key not in obj
                else f"field {key!r} is {type(text).__name__}, not a string"
            )
            problems.bad(where(pos, lineno), what, "Pass --text-field with the text's key")
            continue
        if text:
            yield Record(f"{unit.rel}:{pos}", text, True, True)


def _read_parquet(unit: Unit, opts: ReadOptions, problems: Problems) -> Iterator[Record]:
    import pyarrow.parquet as pq

    row = unit.first_row
    pf = pq.ParquetFile(unit.path)
    for batch in pf.iter_batches(
        batch_size=1024, row_groups=[unit.start], columns=[opts.text_field]
    ):
        texts = batch.column(0).to_pylist()
        yield from _column_records(texts, first_row=row, unit=unit, opts=opts, problems=problems)
        row += len(texts)


def _column_records(
    texts: list, *, first_row: int, unit: Unit, opts: ReadOptions, problems: Problems
) -> Iterator[Record]:
    """Records of one column's values; a value that is not a string is a bad record."""
    for row, text in enumerate(texts, start=first_row):
        if not isinstance(text, str):
            problems.bad(
                f"{unit.path}: row {row}",
                f"{opts.text_field!r} is {type(text).__name__}, not a string",
                "Pass --text-field with the text column",
            )
        elif text:
            yield Record(f"{unit.rel}#{row}", text, True, True)


def _read_arrow(unit: Unit, opts: ReadOptions, problems: Problems) -> Iterator[Record]:
    import pyarrow as pa

    with pa.memory_map(unit.path) as mm:
        table = pa.ipc.open_stream(mm).read_all()
        column = table.column(opts.text_field).slice(unit.start, unit.end - unit.start)
        row = unit.start
        for chunk in column.chunks:
            texts = chunk.to_pylist()
            yield from _column_records(
                texts, first_row=row, unit=unit, opts=opts, problems=problems
            )
            row += len(texts)
