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

import dataclasses
import fnmatch
import glob
import json
import logging
import math
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


_WEIGHT = re.compile(r"^(?P<src>.+):(?P<w>[-+]?(?:[0-9.][0-9.eE+-]*|inf|infinity|nan))$", re.I)
"""SRC:WEIGHT. Anything number-like after the last colon is taken for a weight, so that a bad
one (``a.txt:-1``, ``a.txt:1e``) is reported as a bad weight, not as a missing file."""


def parse_inputs(specs: list[str]) -> list[Source]:
    """``--input`` values -> sources. Weights go on every input or on none. An input given
    twice, or lying inside another one, is refused (it would be read twice); two different
    inputs that share a name are told apart by their parent directories."""
    sources = [_parse(spec, i) for i, spec in enumerate(specs)]
    weighted = [s for s in sources if s.weight is not None]
    if weighted and len(weighted) != len(sources):
        raise UserError(
            f"--input: {len(weighted)} of {len(sources)} inputs have a weight "
            f"({', '.join(s.spec for s in weighted)}). Give every input a weight "
            f"(--input a.jsonl:0.7 --input b/:0.3) or none (blend by size)."
        )
    if weighted and not math.isfinite(sum(s.weight for s in weighted)):
        raise UserError(
            f"--input: the weights ({', '.join(f'{s.weight:g}' for s in weighted)}) add up to "
            f"more than a float holds. Give weights as shares, e.g. 0.7 and 0.3."
        )
    _refuse_overlaps(sources)
    return _unique_names(sources)


def _parse(spec: str, index: int) -> Source:
    weight = None
    m = _WEIGHT.match(spec)
    if m and not Path(spec).exists():
        spec, text = m["src"], m["w"]
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise UserError(
                f"--input {spec}:{text}: the weight {text!r} is not a finite number above 0. "
                f"Give a positive share after the last colon (--input {spec}:0.5), or no "
                f"weight on any input to blend by size."
            )
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
            raise UserError(
                f"--input {spec}: the glob matches no file (relative to {Path.cwd()}). Check the "
                f"pattern and the directory, and quote it so that the shell passes it as is."
            )
        return Source(index=index, spec=spec, name=spec, kind="files", weight=weight, path=spec)
    raise UserError(
        f"--input {spec}: no such file or directory. Give a file, a directory, a glob, "
        f"'stdlib', or hf:NAME for a Hugging Face dataset."
    )


def input_paths(source: Source) -> list[Path]:
    """The local files and directories a source reads: what ``--out`` must stay apart from
    and what two inputs must not share. A glob gives the files it matches; ``stdlib`` the
    standard library's directory; ``hf:NAME`` a local path only if one exists by that name;
    a DatasetDict the directory of its split."""
    if source.kind == "stdlib":
        return [Path(sysconfig.get_paths()["stdlib"])]
    if source.kind == "hub":
        return [Path(source.path)] if Path(source.path).exists() else []
    path = Path(source.path)
    if source.kind == "arrow" and (path / "dataset_dict.json").is_file():
        return [path / source.query.get("split", "train")]  # one split of a DatasetDict
    if source.kind == "files" and not path.exists() and glob.has_magic(source.path):
        return [
            Path(p) for p in sorted(glob.glob(source.path, recursive=True)) if Path(p).is_file()
        ]
    return [path]


def _refuse_overlaps(sources: list[Source]) -> None:
    """Two inputs that name the same file or directory, or one inside the other, would read
    the same documents twice (and put copies on both sides of the validation split)."""
    seen: dict[Path, tuple[Source, Path]] = {}
    for s in sources:
        for path in input_paths(s):
            real = Path(os.path.realpath(path))
            owner = seen.get(real)
            if owner is not None and owner[0].index != s.index:
                raise UserError(
                    f"--input {owner[0].spec} and --input {s.spec}: both read {owner[1]}, so "
                    f"its documents would be read twice. Give each file or directory once."
                )
            seen.setdefault(real, (s, path))
    for real, (s, path) in seen.items():
        for parent in real.parents:
            owner = seen.get(parent)
            if owner is not None and owner[0].index != s.index:
                raise UserError(
                    f"--input {owner[0].spec} and --input {s.spec}: {path} lies inside "
                    f"{owner[1]}, so its documents would be read twice. Give the directory "
                    f"alone (leave files out with --exclude GLOB), or the files one by one."
                )


def _unique_names(sources: list[Source]) -> list[Source]:
    """Names are the sources' labels (meta.json, the validation hash): two different inputs
    with the same name (``a/x.txt``, ``b/x.txt``) get their parent directories added, as few
    as tell them apart. Names that are unique stay as they were."""
    out = list(sources)
    names = [s.name for s in sources]
    for name in set(names):
        group = [s for s in sources if s.name == name]
        if len(group) == 1:
            continue
        for depth in range(2, 64):
            candidates = [_longer_name(s, depth) for s in group]
            if len(set(candidates)) == len(candidates):
                break
        else:
            raise UserError(
                f"--input: {', '.join(s.spec for s in group)} are all named {name!r} and "
                f"cannot be told apart. Give each source once."
            )
        for s, new_name in zip(group, candidates, strict=True):
            out[s.index] = dataclasses.replace(s, name=new_name)
    return out


def _longer_name(source: Source, depth: int) -> str:
    """``source``'s name with up to ``depth`` components of its resolved path (a path
    input), or its spec (a hub name or a glob, which differ by their text)."""
    paths = input_paths(source)
    if source.kind in ("files", "arrow") and len(paths) == 1 and paths[0] == Path(source.path):
        real = Path(os.path.realpath(paths[0]))
        suffix = source.name[len(real.name) :] if source.name.startswith(real.name) else ""
        return "/".join(real.parts[-depth:]).lstrip("/") + suffix
    return source.spec.removeprefix("hf:")


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
    synth = data.get("synth") if isinstance(data, dict) else None
    return synth if isinstance(synth, dict) else None


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
