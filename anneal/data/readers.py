"""What reading an input works with: read options, work units, records, the bad-record policy
(:class:`Problems`) and the :class:`Reader` interface each input format implements.

A unit is a bounded piece of one source that a worker reads on its own: a byte range of a text
or JSON Lines file (a record belongs to the unit holding its first byte), a Parquet row group, a
row range of an Arrow file, or a batch of documents read from a stream. Each reader cuts a file
into units (:meth:`Reader.units`) and turns one unit back into records (:meth:`Reader.read`);
its unit carries a ``part`` of the reader's own type, so no field changes meaning with the
format. Units depend only on the input and ``unit_bytes``, never on the number of workers.

The readers themselves live by format family: :mod:`anneal.data.text_readers` (text and JSON
Lines files, cut at byte offsets) and :mod:`anneal.data.table_readers` (Parquet and Arrow, cut
at rows). :mod:`anneal.data.units` finds them by name and cuts each source into units.

Document names (what the validation hash sees) are ``file`` for a text file read whole,
``file:byte-offset`` for a line-based record or a document cut from a single text file, and
``file#row`` for a table row.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from anneal.errors import UserError

log = logging.getLogger(__name__)

ON_ERROR = ("stop", "skip")


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
    """Key of its reader in :data:`anneal.data.units.READERS`."""
    part: object
    """What the reader needs to find the piece again (its own frozen dataclass)."""
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


class Reader:
    """One input format: how a file is cut into units and how a unit is read."""

    name: str = ""

    def units(self, *, source: int, label: str, path: Path, rel: str, size: int, opts):
        raise NotImplementedError

    def read(self, part, opts: ReadOptions, problems: Problems) -> Iterator[Record]:
        raise NotImplementedError
