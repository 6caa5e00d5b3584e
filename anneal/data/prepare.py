"""``anneal data prepare``: sources -> tokenizer -> packed train/val shards (docs/data.md).

Output layout::

    DIR/meta.json               vocab size, dtype, counts per split and source, tokenizer hash,
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
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing as mp
import os
import pickle
import resource
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anneal.data import pack
from anneal.data import tokenizer as toklib
from anneal.data.prepared import FORMAT_VERSION, has_validation, is_prepared_dir
from anneal.data.readers import Problems, ReadOptions, Unit, read_unit
from anneal.data.sources import Source, input_paths, list_units, parse_inputs
from anneal.errors import UserError
from anneal.files import claim_output, replace_dir

log = logging.getLogger(__name__)

SHARD_TOKENS = 16 * 1024 * 1024  # ids per shard file (32 MiB at uint16)
DTYPES = ("auto", "uint16", "uint32")
SEQ_LEN = 256  # the smallest preset's context (tiny, anneal/model.py)
MAX_VOCAB = 1 << 20  # ids of a trained tokenizer; SentencePiece takes seconds to refuse more
_SAMPLE_UNITS = 256  # units a bounded tokenizer sample is spread over, per source


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """Everything ``anneal data prepare`` takes; defaults are the CLI's."""

    inputs: tuple[str, ...]
    """--input values: SRC or SRC:WEIGHT (see anneal.data.sources)."""
    out: Path
    vocab_size: int = 8192
    """Ids of a trained tokenizer (256 byte pieces included)."""
    model_type: str = "bpe"
    """bpe | unigram (a trained tokenizer)."""
    tokenizer: Path | None = None
    """Reuse this SentencePiece model or HF tokenizer directory instead of training."""
    tokenizer_sample_mb: float = 64.0
    """Training documents the tokenizer learns from, in MB, spread over the inputs."""
    val_fraction: float = 0.02
    """Share of documents held out for validation (chosen by a hash of each name); 0: none."""
    seq_len: int = SEQ_LEN
    """Context the validation split must hold one window of (``seq_len + 1`` tokens)."""
    seed: int = 0
    workers: int = 0
    """Tokenizer processes; 0: every core this process may use."""
    dtype: str = "auto"
    """auto | uint16 | uint32: the id type of the shards."""
    shard_tokens: int = SHARD_TOKENS
    read: ReadOptions = ReadOptions()
    force: bool = False
    """Replace an existing --out."""
    progress: bool = True
    """Progress line with MB/s on stderr."""
    command: str = ""
    """Recorded in meta.json; default: this process's argv."""


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def prepare(*, inputs: list[str], out: Path, **options) -> dict:
    """Train or install a tokenizer, tokenize and pack ``inputs`` into ``out``. Returns the
    meta.json dict. Options are the fields of :class:`PrepareConfig`; ``text_field``,
    ``include``, ``exclude``, ``on_error``, ``streaming`` and ``unit_bytes`` go to
    :class:`ReadOptions`."""
    read_keys = {"text_field", "include", "exclude", "on_error", "streaming", "unit_bytes"}
    read = {k: options.pop(k) for k in list(options) if k in read_keys}
    for k in ("include", "exclude"):
        if k in read:
            read[k] = tuple(read[k] or ())
    cfg = PrepareConfig(inputs=tuple(inputs), out=Path(out), read=ReadOptions(**read), **options)
    return run(cfg)


def _check_config(cfg: PrepareConfig) -> None:
    if not 0 <= cfg.val_fraction < 1:
        raise UserError(f"--val-fraction {cfg.val_fraction}: give a share in [0, 1), e.g. 0.02.")
    if cfg.dtype not in DTYPES:
        raise UserError(f"--dtype {cfg.dtype}: choose one of {', '.join(DTYPES)}.")
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
    if cfg.tokenizer_sample_mb <= 0:
        raise UserError(f"--tokenizer-sample-mb {cfg.tokenizer_sample_mb}: give a size above 0.")
    if not cfg.inputs:
        raise UserError("give at least one --input (e.g. --input stdlib).")


def run(cfg: PrepareConfig) -> dict:
    """:func:`prepare` for a ready :class:`PrepareConfig`. Everything is checked before
    anything is written; ``--out`` is replaced only when it is empty or an earlier prepare's
    output (:func:`anneal.files.claim_output`)."""
    _check_config(cfg)
    out = cfg.out
    sources = parse_inputs(list(cfg.inputs))
    inputs = [p for s in sources for p in input_paths(s)]
    claim_output(
        out,
        force=cfg.force,
        made_by_us=is_prepared_dir,
        what="prepared data directory",
        inputs=inputs + ([cfg.tokenizer] if cfg.tokenizer is not None else []),
    )
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
    partial.mkdir(parents=True)
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
    units = {s.index: _unit_list(s, cfg.read, problems) for s in sources}
    tok_info = _in_child(_make_tokenizer, partial, cfg, sources, units)
    tok = toklib.load(partial)
    dtype = _choose_dtype(cfg.dtype, tok.vocab_size)
    np.save(partial / "token_bytes.npy", tok.token_bytes())
    t_pack, cpu_pack = time.time(), _cpu_seconds()
    splits, per_source, nbytes = _pack_all(partial, cfg, sources, units, tok, dtype, problems)
    pack_s, pack_cpu_s = time.time() - t_pack, _cpu_seconds() - cpu_pack
    for s in sources:
        docs = sum(per_source[split][s.name]["documents"] for split in pack.SPLITS)
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
    seconds = time.time() - start
    meta = {
        "format_version": FORMAT_VERSION,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": dtype.name,
        "tokenizer_sha256": toklib.tokenizer_sha256(partial),
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
        "command": cfg.command or " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "python": sys.version.split()[0],
        "input_bytes": nbytes,
        "seconds": round(seconds, 1),
        "pack_seconds": round(pack_s, 2),
        "pack_mb_per_s": round(nbytes / 1e6 / max(pack_s, 1e-9), 2),
        "pack_cpu_seconds": round(pack_cpu_s, 2),
        "workers": cfg.workers or default_workers(),
    }
    (partial / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _cpu_seconds() -> float:
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


def _make_tokenizer(partial: Path, cfg: PrepareConfig, sources: list[Source], units) -> dict:
    """Train (or install) the tokenizer and write its Hugging Face files; returns its entry for
    meta.json. Runs in a child process (:func:`_in_child`)."""
    if cfg.tokenizer is not None:
        return toklib.install(cfg.tokenizer, partial)
    t0 = time.time()
    seen: dict[int, int] = {}  # records read per source, validation ones included
    problems = Problems(cfg.read.on_error, quiet=True)
    texts = _tokenizer_sample(sources, units, cfg, problems, seen=seen)
    model_path = partial / "tokenizer.model"
    sample = _Counted(texts)
    try:
        toklib.train_sentencepiece(
            sample,
            vocab_size=cfg.vocab_size,
            out_path=model_path,
            model_type=cfg.model_type,
            seed=cfg.seed,
        )
    except UserError:
        # SentencePiece reports an error of the sample's reader (a bad record) or an empty
        # sample as its own failure; the reader's error or the empty input is the real one.
        if sample.error is not None:
            raise sample.error from None
        if sample.bytes == 0:
            raise _no_training_text(cfg, sources, seen) from None
        raise
    if sample.error is not None:
        raise sample.error
    toklib.save_hf_files(model_path, partial)
    log.info(
        "trained a %s tokenizer of %d pieces on %.1f MB in %.1f s",
        cfg.model_type,
        cfg.vocab_size,
        sample.bytes / 1e6,
        time.time() - t0,
    )
    return {
        "kind": "sentencepiece",
        "trained": True,
        "model_type": cfg.model_type,
        "sample_bytes": sample.bytes,
    }


def _in_child(fn, *args):
    """``fn(*args)`` in a fresh Python interpreter, so that the memory it takes
    (SentencePiece's trainer holds the whole sample; transformers is large) goes back to the
    OS before the workers are forked for packing. Not a forked child: after torch has run an
    op in this process, its OpenMP pool is initialised, and SentencePiece's unigram trainer,
    which calls into the same libgomp, hung for ever in a forked child. Not ``spawn`` either,
    which runs the caller's main script again. ``fn`` and ``args`` must pickle; exceptions
    come back as they were raised."""
    root = logging.getLogger()
    formatter = root.handlers[0].formatter if root.handlers else None
    logging_setup = (
        root.getEffectiveLevel(),
        formatter._fmt if formatter else None,  # noqa: SLF001 - copied, not changed
        formatter.datefmt if formatter else None,
    )
    # Pickled before the child exists, so that an argument that does not pickle raises here.
    # sys.path first, so that the child imports what we do before it unpickles the call.
    call = pickle.dumps(list(sys.path)) + pickle.dumps((logging_setup, fn, args))
    read_end, write_end = os.pipe()
    source = f"from anneal.data.prepare import _child_main; _child_main({write_end})"
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", source], stdin=subprocess.PIPE, pass_fds=(write_end,)
        )
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as results:
        try:
            child.stdin.write(call)
            child.stdin.close()
        except BrokenPipeError:
            pass  # the child died at start; its exit code says so below
        reply = results.read()
    exit_code = child.wait()
    if not reply:
        raise RuntimeError(f"the tokenizer process died (exit code {exit_code})")
    ok, value = pickle.loads(reply)
    if not ok:
        raise value
    return value


def _child_main(fd: int) -> None:
    """The child of :func:`_in_child`: reads the call from stdin, writes the outcome to
    ``fd``."""
    sys.path[:] = pickle.load(sys.stdin.buffer)
    (level, fmt, datefmt), fn, args = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=level, format=fmt, datefmt=datefmt)
    try:
        outcome = (True, fn(*args))
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
        outcome = (False, e)
    try:
        data = pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - an exception that does not pickle
        e = outcome[1]
        data = pickle.dumps((False, RuntimeError(f"{type(e).__name__}: {e}")))
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _choose_dtype(dtype: str, vocab_size: int) -> np.dtype:
    if dtype == "auto":
        return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    if dtype == "uint16" and vocab_size > 2**16:
        raise UserError(
            f"--dtype uint16 holds ids below 65536, but the tokenizer has {vocab_size:,} ids. "
            f"Use --dtype uint32 (or auto), or a smaller vocabulary."
        )
    return np.dtype(dtype)


def _no_training_text(cfg: PrepareConfig, sources: list[Source], seen: dict) -> UserError:
    """The tokenizer's sample is empty: an input without documents (the message packing gives
    with --tokenizer), or every document held out for validation."""
    for s in sources:
        if not seen.get(s.index):
            return UserError(
                f"--input {s.spec}: no documents (every file empty or every record skipped). "
                f"Check the input and --text-field."
            )
    return UserError(
        f"--val-fraction {cfg.val_fraction}: every document of the input went to validation, "
        f"so the tokenizer has no training text. Give more input (more, smaller documents), a "
        f"smaller --val-fraction, or reuse a tokenizer with --tokenizer."
    )


class _Counted:
    """Iterates texts, counting their UTF-8 bytes, and keeps an exception raised while reading
    them (SentencePiece, which consumes the iterator, reports it as its own failure)."""

    def __init__(self, texts: Iterable[str]):
        self._texts = texts
        self.bytes = 0
        self.error: BaseException | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            for t in self._texts:
                self.bytes += len(t.encode("utf-8"))
                yield t
        except Exception as e:
            self.error = e
            raise


def _unit_list(source: Source, opts: ReadOptions, problems: Problems):
    """A source's units: a list when they can be listed up front (files, Arrow), else a
    function that streams them afresh (hub datasets read by streaming)."""
    if source.kind == "hub" and (opts.streaming or source.query.get("streaming")):
        return functools.partial(list_units, source, opts, problems)  # pickles, unlike a lambda
    return list(list_units(source, opts, problems))


def _units_of(units) -> Iterator[Unit]:
    return iter(units()) if callable(units) else iter(units)


def _tokenizer_sample(
    sources, units, cfg: PrepareConfig, problems: Problems, *, seen: dict | None = None
) -> Iterator[str]:
    """Training documents (never validation ones) for the tokenizer, at most
    ``tokenizer_sample_mb`` in all: each source's share by its weight (or its size), spread
    evenly over its units. Deterministic. ``seen`` counts the records read per source index,
    validation ones included."""
    seen = {} if seen is None else seen
    budget = cfg.tokenizer_sample_mb * 1e6
    sizes = {
        s.index: (
            sum(u.nbytes for u in units[s.index]) if isinstance(units[s.index], list) else None
        )
        for s in sources
    }
    known = [v for v in sizes.values() if v]
    for s in sources:
        if s.weight is not None:
            share = s.weight / sum(x.weight for x in sources)
        elif sizes[s.index] is not None and known:
            share = sizes[s.index] / sum(known)
        else:
            share = 1 / len(sources)
        yield from _sample_source(s, units[s.index], budget * share, cfg, problems, seen)


def _sample_source(source: Source, units, budget: float, cfg, problems, seen) -> Iterator[str]:
    if isinstance(units, list) and sum(u.nbytes for u in units) > budget:
        picks = sorted({int(j * len(units) / _SAMPLE_UNITS) for j in range(_SAMPLE_UNITS)})
        chosen = [units[j] for j in picks]
        per_unit = budget / len(chosen)
    else:
        chosen, per_unit = _units_of(units), budget
    taken = 0.0
    for unit in chosen:
        in_unit = 0
        for rec in read_unit(unit, cfg.read, problems):
            seen[source.index] = seen.get(source.index, 0) + 1
            if pack.is_validation(source.name, rec.name, val_fraction=cfg.val_fraction):
                continue
            text = rec.text[: int(min(per_unit - in_unit, budget - taken)) + 1]
            yield text
            in_unit += len(text)
            taken += len(text)
            if in_unit >= per_unit or taken >= budget:
                break
        if taken >= budget:
            return


class Progress:
    """MB read, MB/s and tokens on stderr: a tqdm bar on a terminal, else a plain line every
    10 s and one at the end, so logs stay readable."""

    def __init__(self, total_bytes: int | None, *, enabled: bool, workers: int):
        self.total = total_bytes
        self.enabled = enabled
        self.workers = workers
        self.start = time.time()
        self.done = 0
        self.tokens = 0
        self._last = self.start
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_bytes,
                desc="tokenize+pack",
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                file=sys.stderr,
                dynamic_ncols=True,
                postfix=f"0 tokens, {workers} workers",
            )

    def update(self, nbytes: int, tokens: int) -> None:
        self.done += nbytes
        self.tokens += tokens
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.tokens:,} tokens, {self.workers} workers", False)
            self._bar.update(nbytes)
            return
        now = time.time()
        if self.enabled and now - self._last >= 10.0:
            self._last = now
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        dt = max(time.time() - self.start, 1e-9)
        total = f"/{self.total / 1e6:,.1f}" if self.total else ""
        pct = f" {100 * self.done / self.total:3.0f}%" if self.total else ""
        return (
            f"tokenize+pack{pct} {self.done / 1e6:,.1f}{total} MB | "
            f"{self.done / 1e6 / dt:,.1f} MB/s ({self.workers} workers) | "
            f"{self.tokens:,} tokens | {dt:,.1f} s"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(self.line(), file=sys.stderr, flush=True)


def _ordered(fn, units: Iterator[Unit], *, workers: int, initargs: tuple) -> Iterator:
    """``fn`` over ``units`` in order, in ``workers`` processes with at most two units per
    worker in flight (bounded memory), or in this process for one worker."""
    if workers <= 1:
        pack.init_worker(*initargs)
        for unit in units:
            yield fn(unit)
        return
    # fork is cheap and shares the unit lists. Forking a process that has threads can hang the
    # child (it gets their locks and pools, not the threads); the workers only encode, with no
    # thread pool, and the tokenizer, which has one, trains in a fresh interpreter (_in_child).
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("fork" if "fork" in methods else "spawn")
    with ctx.Pool(workers, initializer=pack.init_worker, initargs=initargs) as pool:
        pending: deque = deque()
        for unit in units:
            pending.append(pool.apply_async(fn, (unit,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
        pool.join()  # workers end here, so their CPU time is counted (pack_cpu_seconds)


def _pack_all(partial, cfg, sources, units, tok, dtype, problems):
    workers = cfg.workers or default_workers()
    writers = {
        (split, s.index): pack.ShardWriter(
            partial / split, source=s.index, dtype=dtype, shard_tokens=cfg.shard_tokens
        )
        for split in pack.SPLITS
        for s in sources
    }
    listed = [units[s.index] for s in sources]
    total = (
        sum(u.nbytes for us in listed for u in us)
        if all(isinstance(us, list) for us in listed)
        else None
    )
    progress = Progress(total, enabled=cfg.progress, workers=workers)
    all_units = (u for s in sources for u in _units_of(units[s.index]))
    initargs = (str(partial), cfg.read, cfg.val_fraction, dtype.name)
    for result in _ordered(pack.tokenize_unit, all_units, workers=workers, initargs=initargs):
        for split, part in result.parts.items():
            writers[split, result.source].add(part)
        problems.skipped += result.skipped
        problems.examples += result.examples[: max(0, 20 - len(problems.examples))]
        progress.update(result.nbytes, sum(len(p.ids) for p in result.parts.values()))
    progress.close()
    splits, per_source = {}, {}
    for split in pack.SPLITS:
        groups = [(s, writers[split, s.index].close()) for s in sources]
        splits[split] = {
            "tokens": sum(g["tokens"] for _, g in groups),
            "bytes": sum(g["bytes"] for _, g in groups),
            "documents": sum(g["documents"] for _, g in groups),
            "shards": [sh for _, g in groups for sh in g["shards"]],
        }
        per_source[split] = {
            s.name: {k: g[k] for k in ("tokens", "bytes", "documents", "doc_index")}
            for s, g in groups
        }
    return splits, per_source, progress.done
