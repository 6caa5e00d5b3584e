"""What ``anneal data prepare`` takes (``PrepareConfig``, the CLI's defaults) and its bounds:
the orchestrator (``anneal.data.prepare``) and its steps (``make_tokenizer``, ``pack``) all read
it from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from anneal.data import prepared_dir
from anneal.data.readers import ReadOptions

SHARD_TOKENS = 16 * 1024 * 1024  # ids per shard file (32 MiB at uint16)
DTYPE_CHOICES = ("auto", *prepared_dir.ID_DTYPES)
"""--dtype: the shards' id type (a prepared directory's, ``prepared_dir.ID_DTYPES``), or by size."""
SEQ_LEN = 256  # the smallest preset's context (tiny, anneal/model.py)
MAX_VOCAB = 1 << 20  # ids of a trained tokenizer; SentencePiece takes seconds to refuse more


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
