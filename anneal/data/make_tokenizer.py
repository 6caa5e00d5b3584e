"""The tokenizer step of ``anneal data prepare``: train a SentencePiece model on a bounded,
deterministic sample of the training documents (never validation ones), or install the
user's ``--tokenizer``; then write its Hugging Face files.

It runs in a fresh Python interpreter (:func:`_in_child`), so that the memory it takes
(SentencePiece's trainer holds the whole sample; transformers is large) goes back to the OS
before the packing workers are forked.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from anneal.data import pack, tokenizer, tokenizer_hf
from anneal.data.prepare_config import PrepareConfig
from anneal.data.readers import Problems
from anneal.data.sources import Source
from anneal.data.units import read_unit, units_of
from anneal.errors import UserError

log = logging.getLogger(__name__)

_SAMPLE_UNITS = 256  # units a bounded tokenizer sample is spread over, per source


def make_tokenizer(partial: Path, cfg: PrepareConfig, sources: list[Source], units: dict) -> dict:
    """Train (or install) the tokenizer into ``partial`` and write its Hugging Face files, in
    a fresh interpreter; returns its entry for meta.json. ``units`` maps each source's index
    to its :func:`anneal.data.units.unit_list`."""
    return _in_child(_make, partial, cfg, sources, units)


def _make(partial: Path, cfg: PrepareConfig, sources: list[Source], units) -> dict:
    """Train (or install) the tokenizer and write its Hugging Face files; returns its entry for
    meta.json (in the child of :func:`make_tokenizer`)."""
    if cfg.tokenizer is not None:
        return tokenizer_hf.install(cfg.tokenizer, partial)
    t0 = time.time()
    seen: dict[int, int] = {}  # records read per source, validation ones included
    problems = Problems(cfg.read.on_error, quiet=True)
    texts = _tokenizer_sample(sources, units, cfg, problems, seen=seen)
    model_path = partial / "tokenizer.model"
    sample = _Counted(texts)
    try:
        tokenizer.train_sentencepiece(
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
    tokenizer_hf.save_hf_files(model_path, partial)
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
        chosen, per_unit = units_of(units), budget
    taken = 0.0
    picked: list[tuple[str, str]] = []  # (document name, text)
    held_out, smallest, documents = False, None, 0
    for unit in chosen:
        in_unit = 0
        for rec in read_unit(unit, cfg.read, problems):
            seen[source.index] = seen.get(source.index, 0) + 1
            documents += rec.first
            h = pack.doc_hash(source.name, rec.name)
            if h < cfg.val_fraction:
                held_out = True
                continue
            smallest = min(smallest or (h, rec.name), (h, rec.name))
            text = rec.text[: int(min(per_unit - in_unit, budget - taken)) + 1]
            picked.append((rec.name, text))
            in_unit += len(text)
            taken += len(text)
            if in_unit >= per_unit or taken >= budget:
                break
        if taken >= budget:
            break
    # A source none of whose documents hashes below the fraction holds out its smallest-hash
    # one (anneal.data.pack.pack_all); if it was read here, it is the smallest read.
    drop = None
    if cfg.val_fraction > 0 and not held_out and documents >= 2:
        drop = smallest[1]
    yield from (text for name, text in picked if name != drop)


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
    source = f"from anneal.data.make_tokenizer import _child_main; _child_main({write_end})"
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
