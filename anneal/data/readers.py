"""Readers of work units: one class per input format, found by name in :data:`READERS`.

A unit is a bounded piece of one source that a worker reads on its own: a byte range of a text
or JSON Lines file (a record belongs to the unit holding its first byte), a Parquet row group, a
row range of an Arrow file, or a batch of documents read from a stream. Each reader cuts a file
into units (:meth:`Reader.units`) and turns one unit back into records (:meth:`Reader.read`);
its unit carries a ``part`` of the reader's own type, so no field changes meaning with the
format. Units depend only on the input and ``unit_bytes``, never on the number of workers.

Document names (what the validation hash sees) are ``file`` for a text file read whole,
``file:byte-offset`` for a line-based record or a document cut from a single text file, and
``file#row`` for a table row.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from anneal.errors import UserError

log = logging.getLogger(__name__)

ON_ERROR = ("stop", "skip")
DOC_BYTES = 16 << 10
"""A single text file is cut into documents of at most about this many bytes (see
:class:`TextDocuments`)."""


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
    reader: str
    """Key of its reader in :data:`READERS`."""
    part: object
    """What the reader needs to find the piece again (its own frozen dataclass)."""
    nbytes: int = 0
    """Input bytes this unit covers (progress)."""


@dataclass(frozen=True, kw_only=True)
class ByteRange:
    """Lines of a file whose first byte lies in [start, end); the whole file when compressed."""

    path: str
    rel: str
    """Name of the file within its source (document names, messages)."""
    start: int
    end: int
    size: int
    """Whole file size in bytes."""
    compressed: bool = False


@dataclass(frozen=True, kw_only=True)
class RowGroup:
    path: str
    rel: str
    group: int
    first_row: int
    """Index of the group's first row in its file, for document names."""


@dataclass(frozen=True, kw_only=True)
class RowRange:
    path: str
    rel: str
    start: int
    end: int


@dataclass(frozen=True, kw_only=True)
class Inline:
    records: tuple[Record, ...]


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


class Reader:
    """One input format: how a file is cut into units and how a unit is read."""

    name: str = ""

    def units(self, *, source: int, label: str, path: Path, rel: str, size: int, opts):
        raise NotImplementedError

    def read(self, part, opts: ReadOptions, problems: Problems) -> Iterator[Record]:
        raise NotImplementedError


def _byte_ranges(reader: str, source: int, label: str, path: Path, rel: str, size: int, opts):
    """Units of about ``unit_bytes`` each (one unit for a gzip file, which cannot be seeked)."""
    if path.name.lower().endswith(".gz"):
        part = ByteRange(path=str(path), rel=rel, start=0, end=size, size=size, compressed=True)
        yield Unit(source=source, label=label, reader=reader, part=part, nbytes=size)
        return
    n = max(1, -(-size // opts.unit_bytes))
    for k in range(n):
        start, end = k * size // n, (k + 1) * size // n
        part = ByteRange(path=str(path), rel=rel, start=start, end=end, size=size)
        yield Unit(source=source, label=label, reader=reader, part=part, nbytes=end - start)


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


class TextFile(Reader):
    """A text file as one document (the files of a directory, a glob or ``stdlib``). A file
    larger than a unit is read in pieces of one document."""

    name = "text"

    def units(self, *, source, label, path, rel, size, opts):
        yield from _byte_ranges(self.name, source, label, path, rel, size, opts)

    def read(self, part: ByteRange, opts, problems):
        if part.compressed:
            # One document, streamed in pieces of about unit_bytes.
            with gzip.open(part.path, "rb") as f:
                buf, size, pos, first = [], 0, 0, True
                for line in f:
                    buf.append(line)
                    size += len(line)
                    if size >= opts.unit_bytes:
                        text = _decode(b"".join(buf), part.path, pos, problems)
                        if text is not None:
                            yield Record(part.rel, text, first, False)
                        first, pos, buf, size = False, pos + size, [], 0
                text = _decode(b"".join(buf), part.path, pos, problems)
                yield Record(part.rel, text or "", first, True)
            return
        if part.start == 0 and part.end == part.size:
            with open(part.path, "rb") as f:
                data = f.read()
            text = _decode(data, part.path, 0, problems)
            if text is not None:
                yield Record(part.rel, text, True, True)
            return
        data = b"".join(line for _, line in _aligned_lines(part.path, part.start, part.end))
        first, last = part.start == 0, part.end == part.size
        if not data and not last:
            return
        text = _decode(data, part.path, part.start, problems)
        # A bad piece of a large document is left out; its end (EOS) is kept.
        yield Record(part.rel, text or "", first, last)


def starts_document(prev_start: int, prev_line: bytes, start: int, line: bytes) -> bool:
    """Whether the line at byte ``start`` begins a document of a cut text file, given the line
    before it (at ``prev_start``): a paragraph's first line (a non-blank line after a blank
    one), or the first line that begins at or after a multiple of :data:`DOC_BYTES`. The rule
    looks at two lines only, so any unit can find its documents on its own."""
    paragraph = not prev_line.strip() and bool(line.strip())
    return paragraph or start // DOC_BYTES > prev_start // DOC_BYTES


def _line_before(f, pos: int) -> tuple[int, bytes]:
    """(start, bytes) of the line that ends just before the line start ``pos`` > 0."""
    lo = pos - 1
    while lo > 0:
        at = max(0, lo - 4096)
        f.seek(at)
        i = f.read(lo - at).rfind(b"\n")
        if i >= 0:
            lo = at + i + 1
            break
        lo = at
    f.seek(lo)
    return lo, f.read(pos - lo)


def _document_start(f, pos: int, size: int) -> int:
    """The first document start at or after byte ``pos`` (``size`` if none)."""
    if pos <= 0:
        return 0
    if pos >= size:
        return size
    f.seek(pos - 1)
    f.readline()  # finish the line holding byte pos - 1
    start = f.tell()
    if start >= size:
        return size
    prev_start, prev = _line_before(f, start)
    f.seek(start)
    while start < size:
        line = f.readline()
        if starts_document(prev_start, prev, start, line):
            return start
        prev_start, prev, start = start, line, start + len(line)
    return size


class TextDocuments(Reader):
    """A single text file given as an ``--input`` of its own (``book.txt``, ``wiki.txt.gz``),
    cut into documents at line boundaries: a new document begins at each paragraph (a
    non-blank line after a blank line) and, at the latest, at the first line that begins at or
    after every :data:`DOC_BYTES` (16 KiB) of the file. So one large file holds many documents
    and the validation split (a hash of each document's name, ``file:byte-offset``) gets its
    share; joined, the documents are the file byte for byte. A unit holds the documents that
    begin in its byte range, so the cut does not depend on the unit size or the workers."""

    name = "text-documents"

    def units(self, *, source, label, path, rel, size, opts):
        yield from _byte_ranges(self.name, source, label, path, rel, size, opts)

    def read(self, part: ByteRange, opts, problems):
        if part.compressed:
            with gzip.open(part.path, "rb") as f:
                yield from self._cut(f, 0, part, problems)
            return
        with open(part.path, "rb") as f:
            start = _document_start(f, part.start, part.size)
            end = _document_start(f, part.end, part.size)
            if start >= end:
                return
            f.seek(start)
            data = f.read(end - start)
        yield from self._cut(io.BytesIO(data), start, part, problems)

    def _cut(self, lines, offset: int, part: ByteRange, problems) -> Iterator[Record]:
        """Documents of ``lines`` (a binary file whose first byte is at ``offset`` and begins a
        document)."""
        doc, doc_start = [], offset
        prev_start, prev, pos = -1, b"", offset
        for line in lines:
            if doc and starts_document(prev_start, prev, pos, line):
                yield from self._record(b"".join(doc), doc_start, part, problems)
                doc, doc_start = [], pos
            doc.append(line)
            prev_start, prev, pos = pos, line, pos + len(line)
        if doc:
            yield from self._record(b"".join(doc), doc_start, part, problems)

    @staticmethod
    def _record(data: bytes, start: int, part: ByteRange, problems) -> Iterator[Record]:
        text = _decode(data, part.path, start, problems)
        if text is not None:
            yield Record(f"{part.rel}:{start}", text, True, True)


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


class JsonLines(Reader):
    """One JSON object per line, its text under ``--text-field``."""

    name = "jsonl"
    suffixes = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")

    def units(self, *, source, label, path, rel, size, opts):
        yield from _byte_ranges(self.name, source, label, path, rel, size, opts)

    @staticmethod
    def _lines(part: ByteRange) -> Iterator[tuple[int, bytes, int]]:
        """(offset, line, line number or 0 when not counted) of the unit's lines."""
        if part.compressed:
            with gzip.open(part.path, "rb") as f:
                for n, line in enumerate(f, start=1):
                    yield n, line, n
            return
        for pos, line in _aligned_lines(part.path, part.start, part.end):
            yield pos, line, 0

    def read(self, part: ByteRange, opts, problems):
        key = opts.text_field

        def where(pos: int, lineno: int) -> str:  # counted only for a message
            return f"{part.path}:{lineno or _line_number(part.path, pos)}"

        for pos, line, lineno in self._lines(part):
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
                yield Record(f"{part.rel}:{pos}", text, True, True)


def _column_records(texts: list, *, first_row: int, path: str, rel: str, opts, problems):
    """Records of one column's values; a value that is not a string is a bad record."""
    for row, text in enumerate(texts, start=first_row):
        if not isinstance(text, str):
            problems.bad(
                f"{path}: row {row}",
                f"{opts.text_field!r} is {type(text).__name__}, not a string",
                "Pass --text-field with the text column",
            )
        elif text:
            yield Record(f"{rel}#{row}", text, True, True)


def _missing_column(path, columns: list[str], opts) -> UserError:
    return UserError(
        f"{path}: no column {opts.text_field!r} (columns: {', '.join(columns)}). "
        f"Pass --text-field with the text column."
    )


class Parquet(Reader):
    """One document per row of the ``--text-field`` column; a unit is a row group."""

    name = "parquet"
    suffixes = (".parquet",)

    def units(self, *, source, label, path, rel, size, opts):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if opts.text_field not in pf.schema_arrow.names:
            raise _missing_column(path, pf.schema_arrow.names, opts)
        first_row = 0
        md = pf.metadata
        for g in range(md.num_row_groups):
            part = RowGroup(path=str(path), rel=rel, group=g, first_row=first_row)
            nbytes = md.row_group(g).total_byte_size
            yield Unit(source=source, label=label, reader=self.name, part=part, nbytes=nbytes)
            first_row += md.row_group(g).num_rows

    def read(self, part: RowGroup, opts, problems):
        import pyarrow.parquet as pq

        row = part.first_row
        pf = pq.ParquetFile(part.path)
        for batch in pf.iter_batches(
            batch_size=1024, row_groups=[part.group], columns=[opts.text_field]
        ):
            texts = batch.column(0).to_pylist()
            yield from _column_records(
                texts, first_row=row, path=part.path, rel=part.rel, opts=opts, problems=problems
            )
            row += len(texts)


class Arrow(Reader):
    """An Arrow stream file of a ``datasets`` directory: one document per row; a unit is a
    range of rows of about ``unit_bytes``."""

    name = "arrow"

    def units(self, *, source, label, path, rel, size, opts):
        import pyarrow as pa

        with pa.memory_map(str(path)) as mm:
            table = pa.ipc.open_stream(mm).read_all()
        if opts.text_field not in table.column_names:
            raise _missing_column(path, table.column_names, opts)
        rows = table.num_rows
        n = max(1, -(-size // opts.unit_bytes))
        for k in range(n):
            start, end = k * rows // n, (k + 1) * rows // n
            if end > start:
                part = RowRange(path=str(path), rel=rel, start=start, end=end)
                nbytes = (end - start) * size // max(rows, 1)
                yield Unit(source=source, label=label, reader=self.name, part=part, nbytes=nbytes)

    def read(self, part: RowRange, opts, problems):
        import pyarrow as pa

        with pa.memory_map(part.path) as mm:
            table = pa.ipc.open_stream(mm).read_all()
            column = table.column(opts.text_field).slice(part.start, part.end - part.start)
            row = part.start
            for chunk in column.chunks:
                texts = chunk.to_pylist()
                yield from _column_records(
                    texts, first_row=row, path=part.path, rel=part.rel, opts=opts, problems=problems
                )
                row += len(texts)


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
