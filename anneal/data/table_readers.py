"""Readers of tables, cut into units at rows: Parquet files (a unit is a row group) and the
Arrow files of a ``datasets`` directory (a unit is a range of rows of about ``unit_bytes``).

One document per row, its text in the ``--text-field`` column; a document is named
``file#row``. A value that is not a string is a bad record (:class:`Problems`); a missing
column is an error before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from anneal.data.readers import Reader, Record, Unit
from anneal.errors import UserError


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
