"""``anneal data prepare``: sources -> tokenizer -> packed train/val shards (docs/data.md).

Output layout::

    DIR/meta.json               vocab size, dtype, counts per split and source, tokenizer hashes,
                                sources and weights, the command
    DIR/tokenizer.model         SentencePiece model (absent for a reused HF tokenizer)
    DIR/tokenizer.json ...      Hugging Face files: AutoTokenizer.from_pretrained(DIR)
    DIR/token_bytes.npy         UTF-8 bytes per token id (for bits per byte)
    DIR/train/00_00000.bin ...  packed ids of source 00 (uint16, or uint32 for vocabularies
                                over 65536), documents separated by EOS, little-endian
    DIR/train/00_docs.bin       uint64 end offset of each document of source 00
    DIR/val/...                 the same for the validation documents

Everything is written into ``DIR.partial-<pid>`` and renamed at the end, so an interrupted
prepare never leaves a directory that looks complete. Memory is bounded by the work-unit size
times the units in flight (two per worker), however large the input.

The steps live beside this module: :mod:`anneal.data.sources` parses the inputs,
:mod:`anneal.data.units` cuts them into work units, :mod:`anneal.data.make_tokenizer` trains
or installs the tokenizer, :mod:`anneal.data.pack` tokenizes the units in worker processes and
writes the shards. This module checks the options, runs the steps into the partial directory
and writes ``meta.json``.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from anneal.data import tokenizer
from anneal.data.checks import has_validation, is_prepared_dir
from anneal.data.make_tokenizer import make_tokenizer
from anneal.data.pack import pack_all
from anneal.data.prepare_config import DTYPE_CHOICES, MAX_VOCAB, PrepareConfig
from anneal.data.prepared_dir import FORMAT_VERSION, SPLITS, PreparedDir
from anneal.data.readers import Problems, ReadOptions
from anneal.data.sources import Source, input_paths, parse_inputs
from anneal.data.units import unit_list
from anneal.errors import UserError
from anneal.files import claim_output, replace_dir

log = logging.getLogger(__name__)


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def prepare(*, inputs: list[str], out: Path, **options) -> dict:
    """Train or install a tokenizer, tokenize and pack ``inputs`` into ``out``. Returns the
    meta.json dict (with provenance.json's keys). Options: see :func:`config`."""
    return run(config(inputs=inputs, out=out, **options))


def config(*, inputs: list[str], out: Path, **options) -> PrepareConfig:
    """A :class:`PrepareConfig` from keywords: its fields; ``text_field``, ``include``,
    ``exclude``, ``on_error``, ``streaming`` and ``unit_bytes`` go to :class:`ReadOptions`."""
    read_keys = {"text_field", "include", "exclude", "on_error", "streaming", "unit_bytes"}
    read = {k: options.pop(k) for k in list(options) if k in read_keys}
    for k in ("include", "exclude"):
        if k in read:
            read[k] = tuple(read[k] or ())
    return PrepareConfig(inputs=tuple(inputs), out=Path(out), read=ReadOptions(**read), **options)


def check_config(cfg: PrepareConfig) -> None:
    if not 0 <= cfg.val_fraction < 1:
        raise UserError(f"--val-fraction {cfg.val_fraction}: give a share in [0, 1), e.g. 0.02.")
    if cfg.dtype not in DTYPE_CHOICES:
        raise UserError(f"--dtype {cfg.dtype}: choose one of {', '.join(DTYPE_CHOICES)}.")
    if cfg.workers < 0:
        raise UserError(f"--workers {cfg.workers}: give 1 or more (0: every core).")
    if cfg.tokenizer is None and not 260 <= cfg.vocab_size <= MAX_VOCAB:
        raise UserError(
            f"--vocab-size {cfg.vocab_size}: a trained vocabulary holds 256 byte pieces plus "
            f"control and merged pieces, so give at least 260, and at most {MAX_VOCAB:,} "
            f"(the largest vocabularies in use hold about 256k ids; 8192 suits small models)."
        )
    if cfg.seq_len < 1:
        raise UserError(f"--seq-len {cfg.seq_len}: give 1 or more (the model's context).")
    if cfg.shard_tokens < 1024:
        raise UserError(f"--shard-tokens {cfg.shard_tokens}: give at least 1024.")
    if not cfg.read.unit_bytes >= 1024:
        raise UserError(
            f"--unit-mb {cfg.read.unit_bytes / 2**20:g}: give at least 0.001 (1 KiB); the "
            f"default 4 suits any input."
        )
    if cfg.tokenizer_sample_mb <= 0:
        raise UserError(f"--tokenizer-sample-mb {cfg.tokenizer_sample_mb}: give a size above 0.")
    if not cfg.inputs:
        raise UserError("give at least one --input (e.g. --input stdlib).")


def run(cfg: PrepareConfig) -> dict:
    """:func:`prepare` for a ready :class:`PrepareConfig`; returns meta.json's dict with
    provenance.json's (how it was made) added. Everything is checked before
    anything is written; ``--out`` is replaced only when it is empty or an earlier prepare's
    output (:func:`anneal.files.claim_output`)."""
    check_config(cfg)
    out = cfg.out
    sources = parse_inputs(list(cfg.inputs))
    claim_out(cfg, sources)
    _remove_stale_partials(out)
    start = time.time()
    partial = _make_partial(out)
    try:
        meta = _prepare_into(partial, cfg, sources, start)
        (partial / PARTIAL_MARKER).unlink()
        replace_dir(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def claim_out(cfg: PrepareConfig, sources: list[Source]) -> None:
    """``--out`` may be written (:func:`anneal.files.claim_output`): apart from the inputs,
    empty, or with ``--force`` an earlier prepare's output."""
    inputs = [p for s in sources for p in input_paths(s)]
    claim_output(
        cfg.out,
        force=cfg.force,
        made_by_us=is_prepared_dir,
        what="prepared data directory",
        inputs=inputs + ([cfg.tokenizer] if cfg.tokenizer is not None else []),
    )


PARTIAL_MARKER = ".anneal-prepare-partial"
"""Written first into ``OUT.partial-PID`` and removed just before the rename: a directory is
removed as a dead prepare's leftover only when it carries it."""


def _partial_pid(out: Path, path: Path) -> int | None:
    """The PID in ``path``'s name if it is ``OUT.partial-PID`` (digits only), else None."""
    prefix = f"{out.name}.partial-"
    digits = path.name[len(prefix) :]
    if not path.name.startswith(prefix) or not digits.isdigit() or not digits.isascii():
        return None
    pid = int(digits)
    return pid if 0 < pid < 2**31 else None


def _ours(path: Path) -> bool:
    """A partial directory of some prepare: a real directory (not a link) holding the marker
    as a plain file."""
    marker = path / PARTIAL_MARKER
    return path.is_dir() and not path.is_symlink() and marker.is_file() and not marker.is_symlink()


def _make_partial(out: Path) -> Path:
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    if partial.exists() or partial.is_symlink():
        if not _ours(partial):  # a PID reused, and something else took the name
            raise UserError(
                f"--out {out}: {partial} exists and is not a prepare's partial directory, so "
                f"prepare will not use or delete it. Move it away, or choose another --out."
            )
        shutil.rmtree(partial)
    try:
        partial.mkdir(parents=True)
    except OSError as e:  # /proc, /sys, a read-only mount: check_creatable cannot tell them all
        raise UserError(
            f"--out {out}: cannot create a directory there ({e.strerror or e}). Choose a place "
            f"you can write to."
        ) from None
    (partial / PARTIAL_MARKER).write_text(f"anneal data prepare, pid {os.getpid()}\n")
    return partial


def _remove_stale_partials(out: Path) -> None:
    """Delete ``OUT.partial-PID`` directories of prepares that died: only a directory named
    exactly so (PID all digits), whose process is gone, and that carries
    :data:`PARTIAL_MARKER` (so, made by a prepare). Anything else is left alone."""
    parent = out.parent
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        pid = _partial_pid(out, p)
        if pid is None or pid == os.getpid() or not _ours(p):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("removing %s, left by an interrupted prepare", p)
            shutil.rmtree(p, ignore_errors=True)
        except OSError:  # alive (another user's) or unknowable: leave it
            continue


def _prepare_into(partial: Path, cfg: PrepareConfig, sources: list[Source], start: float):
    problems = Problems(cfg.read.on_error)
    units = {s.index: unit_list(s, cfg.read, problems) for s in sources}
    tok_info = make_tokenizer(partial, cfg, sources, units)
    tok_files = PreparedDir(partial).tokenizer_files()  # all there yet: the tokenizer's files
    tok = tokenizer.load(partial)
    dtype = choose_dtype(cfg.dtype, tok.vocab_size)
    PreparedDir(partial).write_token_bytes(tok.token_bytes())
    workers = cfg.workers or default_workers()
    t_pack, cpu_pack = time.time(), cpu_seconds()
    splits, per_source, nbytes = pack_all(
        partial, cfg, sources, units, dtype, problems, workers=workers
    )
    pack_s, pack_cpu_s = time.time() - t_pack, cpu_seconds() - cpu_pack
    check_counts(cfg, sources, splits, per_source, problems)
    meta = build_meta(
        cfg,
        sources,
        tok=tok,
        dtype=dtype,
        tok_info=tok_info,
        tok_files=tok_files,
        tok_sha256=tokenizer.tokenizer_sha256(partial),
        splits=splits,
        per_source=per_source,
        problems=problems,
        nbytes=nbytes,
    )
    PreparedDir(partial).write_meta(meta)
    record = {
        "command": command_line(cfg),
        "python": sys.version.split()[0],
        "seconds": round(time.time() - start, 1),
        "pack_seconds": round(pack_s, 2),
        "pack_mb_per_s": round(nbytes / 1e6 / max(pack_s, 1e-9), 2),
        "pack_cpu_seconds": round(pack_cpu_s, 2),
        "workers": workers,
    }
    PreparedDir(partial).write_provenance(record)
    return {**meta, **record}


def command_line(cfg: PrepareConfig) -> str:
    """The command recorded in provenance.json: the CLI's, else this process's argv."""
    return cfg.command or " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])


def check_counts(
    cfg: PrepareConfig, sources: list[Source], splits: dict, per_source: dict, problems: Problems
) -> None:
    """After packing: every source has documents, and the validation split holds a window."""
    for s in sources:
        docs = sum(per_source[split][s.name]["documents"] for split in SPLITS)
        if docs == 0:
            raise UserError(
                f"--input {s.spec}: no documents (every file empty or every record skipped). "
                f"Check the input and --text-field."
            )
    if problems.empty_files:
        log.warning(
            "skipped %d empty file(s), e.g. %s",
            problems.empty_files,
            ", ".join(problems.empty_examples),
        )
    if cfg.val_fraction > 0:
        _check_validation(cfg, splits)


def build_meta(
    cfg: PrepareConfig,
    sources: list[Source],
    *,
    tok,
    dtype: np.dtype,
    tok_info: dict,
    tok_files: dict,
    tok_sha256: str,
    splits: dict,
    per_source: dict,
    problems: Problems,
    nbytes: int,
) -> dict:
    """meta.json: a function of the inputs and the settings only (how long it took, on how
    many workers, by which command, goes to provenance.json), so that one node and a merge of
    many tasks (:mod:`anneal.data.merge`) write the same bytes."""
    return {
        "format_version": FORMAT_VERSION,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": dtype.name,
        "tokenizer_sha256": tok_sha256,
        "tokenizer_files": tok_files,
        "tokenizer": tok_info,
        "sources": [_source_meta(s, per_source) for s in sources],
        "blend": "weighted" if sources[0].weight is not None else "natural",
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
        "shard_tokens": cfg.shard_tokens,
        "splits": {split: {**splits[split], "sources": per_source[split]} for split in splits},
        "skipped": {
            "records": problems.skipped,
            "empty_files": problems.empty_files,
            "examples": problems.examples,
        },
        "input_bytes": nbytes,
    }


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its children that have ended: the
    workers of a finished pack are joined, so a difference around it counts them all."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _check_validation(cfg: PrepareConfig, splits: dict) -> None:
    """A validation split too small for one window would only fail training later."""
    if has_validation({"splits": splits}, seq_len=cfg.seq_len):
        return
    val = splits["val"]
    documents = val["documents"] + splits["train"]["documents"]
    raise UserError(
        f"--val-fraction {cfg.val_fraction}: the validation split holds {val['tokens']:,} "
        f"tokens ({val['documents']} of {documents:,} documents), fewer than one window of "
        f"{cfg.seq_len + 1} tokens (--seq-len {cfg.seq_len}), so training could not evaluate "
        f"on it. Documents are held out by a hash of their name, so a small input may get "
        f"none. Give more input (or more, smaller documents: a text file given alone is cut "
        f"at blank lines), a larger --val-fraction (e.g. 0.1), or --val-fraction 0 for data "
        f"without validation (training must then run with evaluation off). Nothing was written."
    )


def _source_meta(s: Source, per_source: dict) -> dict:
    entry = {"name": s.name, "input": s.spec, "kind": s.kind, "weight": s.weight}
    if s.synth is not None:
        entry["synth"] = s.synth
    train = per_source["train"][s.name]
    entry["train_tokens"] = train["tokens"]
    return entry


def choose_dtype(dtype: str, vocab_size: int) -> np.dtype:
    if dtype == "auto":
        return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    if dtype == "uint16" and vocab_size > 2**16:
        raise UserError(
            f"--dtype uint16 holds ids below 65536, but the tokenizer has {vocab_size:,} ids. "
            f"Use --dtype uint32 (or auto), or a smaller vocabulary."
        )
    return np.dtype(dtype)
