"""SentencePiece tokenizer: training on a bounded sample, loading, and byte accounting.

The tokenizer is trained lossless: identity normalisation, no dummy prefix, whitespace runs
allowed as pieces, and byte fallback, so ``decode(encode(text)) == text`` for any UTF-8 text and
every token maps to an exact number of UTF-8 bytes (used for bits per byte).
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

EOS_ID = 1  # id 0 is <unk>, 1 is </s>; no BOS and no PAD.
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def _chunks(texts: Iterable[str], *, max_chars: int = 1000) -> Iterator[str]:
    """Split documents at line ends into sentences of about ``max_chars`` characters, keeping
    the newlines so that the tokenizer learns code layout."""
    for text in texts:
        buf: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            buf.append(line)
            size += len(line)
            if size >= max_chars:
                yield "".join(buf)
                buf, size = [], 0
        if buf:
            yield "".join(buf)


def train_sentencepiece(texts: Iterable[str], *, vocab_size: int, out_path: Path,
                        model_type: str = "bpe", sample_sentences: int = 200_000,
                        seed: int = 0, num_threads: int = 2) -> None:
    """Train on at most ``sample_sentences`` sentences drawn from ``texts`` and write
    ``out_path`` (a ``tokenizer.model``)."""
    import sentencepiece as spm

    proto = io.BytesIO()
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(
        sentence_iterator=_chunks(texts),
        model_writer=proto,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=["\n"],
        input_sentence_size=sample_sentences,
        shuffle_input_sentence=True,
        max_sentence_length=16384,
        unk_id=0,
        eos_id=EOS_ID,
        bos_id=-1,
        pad_id=-1,
        num_threads=num_threads,
        minloglevel=2,
    )
    out_path.write_bytes(proto.getvalue())


def load(path: Path):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(path))


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def token_byte_lengths(sp) -> np.ndarray:
    """UTF-8 bytes each token id stands for: 1 for a byte-fallback piece, 0 for control
    tokens (EOS, UNK), else the piece's text with '▁' read as a space."""
    lengths = np.zeros(sp.get_piece_size(), dtype=np.int32)
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i):
            continue
        piece = sp.id_to_piece(i)
        if sp.is_byte(i) or _BYTE_PIECE.match(piece):
            lengths[i] = 1
        else:
            lengths[i] = len(piece.replace("\u2581", " ").encode("utf-8"))
    return lengths


def save_hf_tokenizer(model_path: Path, out_dir: Path) -> None:
    """Write Hugging Face tokenizer files beside ``tokenizer.model`` so that
    ``AutoTokenizer.from_pretrained(out_dir)`` loads the same vocabulary."""
    from transformers import LlamaTokenizer

    tok = LlamaTokenizer(vocab_file=str(model_path), add_bos_token=False, add_eos_token=False,
                         legacy=False, add_prefix_space=False, unk_token="<unk>",
                         eos_token="</s>", bos_token=None, pad_token=None)
    tok.save_pretrained(str(out_dir))
