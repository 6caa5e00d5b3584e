"""Tokenize documents and pack them into train/val shards (the data contract in DESIGN.md).

Output layout::

    DIR/meta.json           vocab size, dtype, counts per split, tokenizer hash, sources
    DIR/tokenizer.model     SentencePiece model (+ Hugging Face tokenizer files)
    DIR/token_bytes.npy     UTF-8 bytes per token id (for bits per byte)
    DIR/train/shard_00000.bin ...   packed uint16/uint32 ids, documents separated by EOS
    DIR/val/shard_00000.bin ...

Everything is written into ``DIR.partial-<pid>`` and renamed at the end, so an interrupted
prepare never leaves a directory that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anneal.data import tokenizer as tok

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SHARD_TOKENS = 16 * 1024 * 1024  # tokens per shard file (32 MiB at uint16)


@dataclass(frozen=True, kw_only=True)
class Document:
    source: str
    name: str
    text: str


def stdlib_documents() -> Iterator[Document]:
    """The running Python's standard-library source, without its test suites: real text
    nobody here wrote, present on every machine. Sorted, so the order is reproducible."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py")
                   if not skip.intersection(p.relative_to(root).parts[:-1]))
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield Document(source="stdlib", name=str(path.relative_to(root)), text=text)


def is_validation(doc: Document, *, val_fraction: float) -> bool:
    """Deterministic split by document: a hash of its name, not its position."""
    digest = hashlib.sha256(f"{doc.source}/{doc.name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


class ShardWriter:
    """Appends token ids to fixed-size shard files of one split."""

    def __init__(self, directory: Path, dtype: np.dtype):
        self.dir = directory
        self.dir.mkdir(parents=True)
        self.dtype = dtype
        self.shards: list[dict] = []
        self.tokens = 0
        self.bytes = 0
        self.documents = 0
        self._buf: list[np.ndarray] = []
        self._buf_len = 0

    def add(self, ids: list[int], n_bytes: int) -> None:
        self._buf.append(np.asarray(ids, dtype=self.dtype))
        self._buf_len += len(ids)
        self.tokens += len(ids)
        self.bytes += n_bytes
        self.documents += 1
        while self._buf_len >= SHARD_TOKENS:
            self._flush(SHARD_TOKENS)

    def _flush(self, n: int) -> None:
        data = np.concatenate(self._buf) if self._buf else np.zeros(0, self.dtype)
        head, tail = data[:n], data[n:]
        name = f"shard_{len(self.shards):05d}.bin"
        head.tofile(self.dir / name)
        self.shards.append({"file": name, "tokens": int(len(head))})
        self._buf = [tail] if len(tail) else []
        self._buf_len = len(tail)

    def close(self) -> dict:
        if self._buf_len or not self.shards:
            self._flush(self._buf_len)
        return {"tokens": self.tokens, "bytes": self.bytes, "documents": self.documents,
                "shards": self.shards}


def prepare(*, inputs: list[str], out: Path, vocab_size: int = 8192, val_fraction: float = 0.02,
            seed: int = 0, force: bool = False) -> dict:
    """Train a tokenizer, tokenize and pack ``inputs`` into ``out``. Returns meta.json."""
    out = Path(out)
    if out.exists():
        if not force:
            raise FileExistsError(f"{out} already exists. Pass --force to replace it, or choose "
                                  f"another --out.")
    for src in inputs:
        if src != "stdlib":
            raise ValueError(f"--input {src}: only the embedded 'stdlib' corpus is supported "
                             f"by this version.")
    start = time.time()
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        docs = list(stdlib_documents())
        train_docs = [d for d in docs if not is_validation(d, val_fraction=val_fraction)]
        model_path = partial / "tokenizer.model"
        tok.train_sentencepiece((d.text for d in train_docs), vocab_size=vocab_size,
                                out_path=model_path, seed=seed)
        sp = tok.load(model_path)
        tok.save_hf_tokenizer(model_path, partial)
        byte_lengths = tok.token_byte_lengths(sp)
        np.save(partial / "token_bytes.npy", byte_lengths)
        dtype = np.dtype(np.uint16 if sp.get_piece_size() <= 2**16 else np.uint32)
        writers = {split: ShardWriter(partial / split, dtype) for split in ("train", "val")}
        for doc in docs:
            ids = sp.encode(doc.text) + [tok.EOS_ID]
            split = "val" if is_validation(doc, val_fraction=val_fraction) else "train"
            writers[split].add(ids, len(doc.text.encode("utf-8")))
        meta = {
            "format_version": FORMAT_VERSION,
            "vocab_size": sp.get_piece_size(),
            "eos_id": tok.EOS_ID,
            "dtype": dtype.name,
            "tokenizer_sha256": tok.file_sha256(model_path),
            "sources": [{"name": s, "weight": 1.0} for s in inputs],
            "val_fraction": val_fraction,
            "splits": {split: w.close() for split, w in writers.items()},
            "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
            "python": sys.version.split()[0],
            "seconds": round(time.time() - start, 1),
        }
        (partial / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def unigram_entropy_bits_per_byte(data_dir: Path, split: str = "train") -> float:
    """Baseline a model must beat: entropy of the unigram token distribution of ``split``,
    in bits per UTF-8 byte."""
    data_dir = Path(data_dir)
    meta = json.loads((data_dir / "meta.json").read_text())
    counts = np.zeros(meta["vocab_size"], dtype=np.int64)
    for shard in meta["splits"][split]["shards"]:
        ids = np.fromfile(data_dir / split / shard["file"], dtype=meta["dtype"])
        counts += np.bincount(ids, minlength=meta["vocab_size"])
    p = counts[counts > 0] / counts.sum()
    bits_per_token = float(-(p * np.log2(p)).sum())
    split_meta = meta["splits"][split]
    return bits_per_token * split_meta["tokens"] / split_meta["bytes"]
