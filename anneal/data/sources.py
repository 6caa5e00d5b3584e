"""What ``anneal data prepare --input`` accepts: each value parsed into a :class:`Source`.

``--input SRC[:WEIGHT]``, where SRC is one of

- ``stdlib``: the running Python's standard library source (the embedded default);
- a plain-text file, or ``.gz`` of one: one document per file inside a directory or glob; a
  file given alone is cut into documents at paragraphs and every 16 KiB
  (:class:`anneal.data.text_readers.TextDocuments`);
- a JSON Lines file (``.jsonl``, ``.ndjson``, optionally ``.gz``): one document per line, its
  text in ``--text-field``;
- a Parquet file (``.parquet``): one document per row, its text in the ``--text-field`` column;
- a directory: every file below it (recursive, sorted, hidden files skipped) whose path
  relative to it matches ``--include`` and not ``--exclude`` globs, each read by its suffix;
  a directory written by ``datasets``' ``save_to_disk`` is read as that dataset, and one written
  by ``anneal data synth`` as its text;
- a glob (``'shards/*.jsonl'``): the matching files, sorted;
- ``hf:NAME[?config=C&split=S&revision=R&streaming=1]``: a Hugging Face dataset by hub name or
  local path, through ``datasets.load_dataset`` (:mod:`anneal.data.hub`).

Parsing checks everything that can be checked before reading: weights, overlapping inputs,
names that must tell sources apart. :mod:`anneal.data.units` cuts each source into work units
in a fixed order; workers read units independently and the writer takes them in order, so the
output does not depend on the number of workers.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlparse

from anneal.data.prepared_dir import PreparedDir
from anneal.errors import UserError


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
    spec, weight = _split_weight(spec)
    if spec == "stdlib":
        return Source(index=index, spec=spec, name="stdlib", kind="stdlib", weight=weight)
    if spec.startswith("hf:"):
        return _hub_source(spec, index, weight)
    return _path_source(spec, index, weight)


def _split_weight(spec: str) -> tuple[str, float | None]:
    """``SRC:WEIGHT`` -> (SRC, WEIGHT); (spec, None) without a weight, or when the whole spec
    names an existing path (a file name may hold a colon). Text after the last colon of an
    input that exists without it (``a.txt:abc``) is a weight that is not a number."""
    m = _WEIGHT.match(spec)
    if Path(spec).exists():
        return spec, None
    if m:
        spec, text = m["src"], m["w"]
    else:
        src, colon, text = spec.rpartition(":")
        if not (colon and "/" not in text and _input_exists(src)):
            return spec, None
        spec = src
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
        what = "a number" if _WEIGHT.match(f"x:{text}") is None else "a finite number above 0"
        raise UserError(
            f"--input {spec}:{text}: the weight {text!r} after the last colon is not {what}. "
            f"Give a share above 0 there (--input {spec}:0.5), or no weight on any input to "
            f"blend by size."
        )
    return spec, weight


def _input_exists(src: str) -> bool:
    """Whether ``src`` names an input without a weight: stdlib, a path or a matching glob."""
    if src == "stdlib" or Path(src).exists():
        return True
    return glob.has_magic(src) and bool(glob.glob(src, recursive=True))


def _hub_source(spec: str, index: int, weight: float | None) -> Source:
    """``hf:NAME?...``: a dataset on the Hub, or a local ``save_to_disk`` directory."""
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


def _path_source(spec: str, index: int, weight: float | None) -> Source:
    """A directory (a saved dataset, a synth corpus or files), a file, or a glob."""
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
    synth = (PreparedDir(path).meta_object() or {}).get("synth")
    return synth if isinstance(synth, dict) else None
