"""Readers of line-based files, cut into units at byte offsets: plain text (one document per
file, or a single file cut into documents) and JSON Lines (one document per line).

A unit is a byte range of a file, and a line belongs to the unit that holds its first byte, so
units can be read independently and in any order; a gzip file, which cannot be seeked, is one
unit. Document names are ``file`` for a text file read whole and ``file:byte-offset`` for a
JSON Lines record or a document cut from a single text file.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from anneal.data.readers import Problems, Reader, Record, Unit

DOC_BYTES = 16 << 10
"""A single text file is cut into documents of at most about this many bytes (see
:class:`TextDocuments`)."""


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
