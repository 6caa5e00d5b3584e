"""What ``anneal data prepare --input`` accepts, cut into work units of bounded size.

``--input SRC[:WEIGHT]``, where SRC is one of

- ``stdlib``: the running Python's standard library source (the embedded default);
- a plain-text file, or ``.gz`` of one: one document per file inside a directory or glob; a
  file given alone is cut into documents at paragraphs and every 16 KiB
  (:class:`anneal.data.readers.TextDocuments`);
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

Each source is listed as work units in a fixed order; :mod:`anneal.data.readers` holds the
reader of each file format (how a file is cut into units and read back). Workers read units
independently and the writer takes them in order, so the output does not depend on the number
of workers.
"""

from __future__ import annotations

import fnmatch
import glob
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
from urllib.parse import parse_qsl, urlparse

from anneal.data.readers import (
    READERS,
    Inline,
    Problems,
    ReadOptions,
    Record,
    Unit,
    file_reader,
)
from anneal.errors import UserError

log = logging.getLogger(__name__)

HUB_TIMEOUT_S = 5.0
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


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


def _saved_dataset_units(source: Source, opts: ReadOptions, problems: Problems):
    yield from _arrow_units(source, _arrow_files(Path(source.path), source), opts)


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
