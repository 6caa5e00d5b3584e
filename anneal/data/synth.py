"""Synthetic corpora with a known entropy rate: the yardstick that proves the pipeline learns.

``anneal data synth --order K --alphabet N`` draws a random order-K Markov source
over N letters: every context (the previous K letters) gets a next-letter distribution from a
symmetric Dirichlet(``concentration``). Its entropy rate

    H = - sum_c pi(c) sum_x P(x | c) log2 P(x | c)      (pi: stationary distribution of contexts)

is the lowest cross-entropy any model can reach on its text, in bits per character. Every
letter is one ASCII byte, so it is also bits per UTF-8 byte: a model's ``val_bpb`` on a prepared
copy can approach H but not go below it (EOS tokens and window starts without context only add
to the loss). A value below H means a leak between splits or a wrong loss.

Documents start in the stationary distribution, so every position of every document is a draw
from the same stationary process.
"""

from __future__ import annotations

import os
import shutil
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anneal.data.prepared_dir import PreparedDir
from anneal.errors import UserError
from anneal.files import claim_output, replace_dir

SYMBOLS = string.ascii_lowercase + string.ascii_uppercase
MAX_CONTEXTS = 1 << 20


@dataclass(frozen=True, kw_only=True)
class MarkovSource:
    """An order-``order`` Markov chain over ``alphabet`` symbols. Context c is the base-N
    number of the previous ``order`` symbols (oldest first)."""

    order: int
    alphabet: int
    transitions: np.ndarray
    """(N**K, N): P(next symbol | context); rows sum to 1."""

    @classmethod
    def random(cls, *, order: int, alphabet: int, seed: int, concentration: float):
        if not 1 <= alphabet <= len(SYMBOLS):
            raise UserError(f"--alphabet {alphabet}: give 2 to {len(SYMBOLS)} symbols.")
        if alphabet < 2:
            raise UserError("--alphabet 1: a source of one symbol has no entropy; give 2+.")
        if order < 0 or alphabet**order > MAX_CONTEXTS:
            raise UserError(
                f"--order {order} with --alphabet {alphabet}: {alphabet}**{order} contexts; "
                f"keep it at most {MAX_CONTEXTS:,} (and the order at least 0)."
            )
        if not concentration > 0:
            raise UserError(f"--concentration {concentration}: give a value above 0.")
        rng = np.random.default_rng([seed, order, alphabet])
        p = rng.dirichlet(np.full(alphabet, concentration), size=alphabet**order)
        p = np.maximum(p, 1e-12)  # every transition possible: irreducible and aperiodic
        return cls(order=order, alphabet=alphabet, transitions=p / p.sum(1, keepdims=True))

    @property
    def contexts(self) -> int:
        return self.alphabet**self.order

    def _next_context(self) -> np.ndarray:
        """(N**K, N): the context after emitting symbol x in context c."""
        c = np.arange(self.contexts)[:, None]
        x = np.arange(self.alphabet)[None, :]
        return (c * self.alphabet + x) % self.contexts

    def stationary(self, *, tol: float = 1e-15, max_iter: int = 1_000_000) -> np.ndarray:
        """Stationary distribution over contexts, by power iteration (the chain is irreducible
        and aperiodic, so it converges)."""
        nxt = self._next_context().ravel()
        pi = np.full(self.contexts, 1.0 / self.contexts)
        for _ in range(max_iter):
            new = np.bincount(
                nxt, weights=(pi[:, None] * self.transitions).ravel(), minlength=self.contexts
            )
            new /= new.sum()
            if np.abs(new - pi).sum() < tol:
                return new
            pi = new
        raise AssertionError("the stationary distribution did not converge")

    def entropy_rate_bits(self) -> float:
        """H = sum_c pi(c) H(P(. | c)), bits per symbol."""
        p = self.transitions
        row_entropy = -(p * np.log2(p)).sum(1)
        return float(self.stationary() @ row_entropy)

    def unigram_entropy_bits(self) -> float:
        """Entropy of a symbol without context (what a model that ignores context reaches)."""
        marginal = self.stationary() @ self.transitions
        return float(-(marginal * np.log2(marginal)).sum())

    def sample(self, *, documents: int, chars: int, seed: int) -> np.ndarray:
        """(documents, chars) symbol indices (uint8), each row a stationary run."""
        rng = np.random.default_rng([seed, 1])
        cum = np.cumsum(self.transitions, axis=1)
        cum[:, -1] = 1.0
        out = np.empty((documents, chars), dtype=np.uint8)
        ctx = rng.choice(self.contexts, size=documents, p=self.stationary())
        first = min(self.order, chars)
        for i in range(first):  # the context's own symbols, oldest first
            out[:, i] = (ctx // self.alphabet ** (self.order - 1 - i)) % self.alphabet
        for t in range(first, chars):
            u = rng.random(documents)
            x = (u[:, None] > cum[ctx]).sum(1)
            out[:, t] = x
            ctx = (ctx * self.alphabet + x) % self.contexts
        return out


def is_synth_dir(path: Path) -> bool:
    """Whether ``path`` carries the marker of ``anneal data synth``: a meta.json object with a
    ``"synth"`` key (what ``--force`` may replace)."""
    return isinstance((PreparedDir(path).meta_object() or {}).get("synth"), dict)


def write_markov(
    *,
    out: Path,
    order: int = 2,
    alphabet: int = 8,
    seed: int = 0,
    documents: int = 64,
    doc_chars: int = 32768,
    concentration: float = 0.5,
    force: bool = False,
) -> dict:
    """Write ``out/text/doc_NNNNN.txt`` (one document each, no newline) and ``out/meta.json``
    with the source's exact entropy rate. Returns meta.json."""
    out = Path(out)
    if documents < 1 or doc_chars < 1:
        raise UserError(f"--documents {documents} --doc-chars {doc_chars}: give 1 or more.")
    src = MarkovSource.random(
        order=order, alphabet=alphabet, seed=seed, concentration=concentration
    )
    claim_output(out, force=force, made_by_us=is_synth_dir, what="synthetic corpus")
    symbols = np.frombuffer(SYMBOLS[:alphabet].encode("ascii"), dtype=np.uint8)
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    if partial.exists() or partial.is_symlink():
        raise UserError(
            f"--out {out}: {partial} is in the way (a name this command writes to first). "
            f"Move it away, or choose another --out."
        )
    (partial / "text").mkdir(parents=True)
    try:
        block = max(1, (1 << 24) // doc_chars)  # documents drawn at once (bounded memory)
        for first in range(0, documents, block):
            n = min(block, documents - first)
            draws = src.sample(documents=n, chars=doc_chars, seed=seed * 1_000_003 + first)
            for i, row in enumerate(symbols[draws]):
                (partial / "text" / f"doc_{first + i:05d}.txt").write_bytes(row.tobytes())
        h = src.entropy_rate_bits()
        meta = {
            "synth": {
                "kind": "markov",
                "order": order,
                "alphabet": alphabet,
                "symbols": SYMBOLS[:alphabet],
                "seed": seed,
                "concentration": concentration,
                "documents": documents,
                "doc_chars": doc_chars,
                "entropy_bits_per_char": h,
                "entropy_bits_per_byte": h,
                "unigram_entropy_bits_per_char": src.unigram_entropy_bits(),
            }
        }
        PreparedDir(partial).write_meta(meta)
        replace_dir(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta
