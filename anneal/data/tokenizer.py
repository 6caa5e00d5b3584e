"""Tokenizers: train a SentencePiece model, reuse one, or reuse a Hugging Face tokenizer.

A trained tokenizer is lossless: identity normalisation, no dummy prefix, whitespace runs
allowed as pieces and byte fallback, so ``decode(encode(text)) == text`` for any text without
U+2581 (``▁``, which SentencePiece uses to escape spaces and so decodes as a space). ``"\\n"`` is
a user-defined piece that no other piece crosses, so a text can be encoded line by line with the
same ids as a whole (BPE: several times faster for SentencePiece on long documents).

Every prepared directory gets Hugging Face files beside ``tokenizer.model``
(:mod:`anneal.data.tokenizer_hf`, which also installs a user's tokenizer), and
``token_bytes.npy``: the UTF-8 bytes each id stands for (:meth:`Tokenizer.token_bytes`), used
for bits per byte.
"""

from __future__ import annotations

import io
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from anneal.errors import UserError
from anneal.files import sha256_file

EOS_ID = 1  # trained models: id 0 is <unk>, 1 is </s>; no BOS and no PAD.
MODEL_TYPES = ("bpe", "unigram")
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
# sentencepiece_model.proto: ModelProto.SentencePiece.Type
PIECE_NORMAL, PIECE_UNKNOWN, PIECE_CONTROL, PIECE_USER_DEFINED, PIECE_BYTE = 1, 2, 3, 4, 6


def _sentences(texts: Iterable[str], *, max_chars: int = 1000) -> Iterator[str]:
    """Split documents at line ends into sentences of about ``max_chars`` characters, keeping
    the newlines so that the tokenizer learns code layout. A line longer than ``max_chars`` is
    cut into pieces of that size (SentencePiece drops sentences over its length limit)."""
    for text in texts:
        buf: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            while len(line) > max_chars:
                if buf:
                    yield "".join(buf)
                    buf, size = [], 0
                yield line[:max_chars]
                line = line[max_chars:]
            buf.append(line)
            size += len(line)
            if size >= max_chars:
                yield "".join(buf)
                buf, size = [], 0
        if buf:
            yield "".join(buf)


def _lines(texts: list[str]) -> tuple[list[str], list[int]]:
    """Every text cut after each ``"\\n"`` (only there: not at ``"\\r"`` nor U+2028, which
    ``str.splitlines`` would cut at), and how many lines each text gave (0 for an empty one)."""
    lines: list[str] = []
    counts: list[int] = []
    for text in texts:
        parts = io.StringIO(text, newline="\n").readlines()
        lines += parts
        counts.append(len(parts))
    return lines, counts


def train_sentencepiece(
    texts: Iterable[str],
    *,
    vocab_size: int,
    out_path: Path,
    model_type: str = "bpe",
    seed: int = 0,
    num_threads: int = 2,
) -> None:
    """Train on every sentence of ``texts`` (the caller bounds the sample) and write
    ``out_path`` (a ``tokenizer.model``). Deterministic for the same texts and seed."""
    import sentencepiece as spm

    if model_type not in MODEL_TYPES:
        raise UserError(f"--model-type {model_type}: choose one of {', '.join(MODEL_TYPES)}.")
    proto = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(texts),
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
            input_sentence_size=0,  # use every sentence given: the sample is bounded upstream
            max_sentence_length=16384,
            unk_id=0,
            eos_id=EOS_ID,
            bos_id=-1,
            pad_id=-1,
            num_threads=num_threads,
            minloglevel=2,
            # unigram only: a vocabulary larger than the text supports is an error otherwise
            hard_vocab_limit=model_type != "unigram",
        )
    except RuntimeError as e:
        # SentencePiece's own advice names its flags (--character_coverage), not Anneal's
        reason = re.sub(r"\s*Increase vocab_size.*", "", _spm_reason(e))
        raise UserError(
            f"sentencepiece could not train a {model_type} vocabulary of {vocab_size} on the "
            f"sample ({reason}). {_vocab_fix(reason)}"
        ) from None
    out_path.write_bytes(proto.getvalue())


def _vocab_fix(reason: str) -> str:
    """What to change, from SentencePiece's reason: a vocabulary too small for the sample's
    characters ("smaller than required_chars. 300 vs 459") needs a larger --vocab-size; one
    too large for the text ("too high (5000). Please set it to a value <= 301") a smaller one,
    or more text."""
    small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", reason)
    if small:
        return (
            f"The sample holds more distinct characters than this vocabulary has room for "
            f"(each is a piece of its own): choose a larger --vocab-size, at least "
            f"{int(small[1]):,}."
        )
    high = re.search(r"<= (\d+)", reason)
    most = f" ({int(high[1]):,} or less here)" if high else ""
    return (
        f"A vocabulary needs at least 256 byte pieces plus the sample's characters and merges, "
        f"and the text supports only so many merges: choose a smaller --vocab-size{most}, or "
        f"give more text."
    )


def _spm_reason(error: Exception) -> str:
    """SentencePiece's own words for a failure, without its C++ source location or the Python
    stack lines it appends ("INTERNAL: src/trainer.cc(744) [cond] Vocabulary size too
    high ...\n\nAt:\n  file.py(12): f")."""
    first = str(error).strip().split("\n", 1)[0]
    reason = re.sub(r"^[A-Z_]+: \S+\(\d+\) \[.*?\]\s*", "", first).strip()
    return reason or first or type(error).__name__


def file_sha256(path: Path) -> str:
    return sha256_file(Path(path))


class Tokenizer:
    """What prepare needs from any tokenizer: batch encoding, EOS, the vocabulary size and the
    bytes per id. Built by :func:`load` from a prepared (or partial) directory, so that worker
    processes load the very files that are shipped."""

    def __init__(self, *, kind: str, vocab_size: int, eos_id: int, impl, split_lines: bool):
        self.kind = kind
        """``sentencepiece`` or ``huggingface``."""
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.split_lines = split_lines
        """True when no piece crosses a newline, so lines can be encoded separately."""
        self._impl = impl
        self.buffers = hasattr(getattr(impl, "_processor", None), "_EncodeAsBufferBatch")
        """Whether SentencePiece's batch encoder to int32 buffers (sentencepiece 0.2.3's pybind
        entry point) is there; if not, :meth:`encode_packed` packs lists of ints, same ids."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, without BOS/EOS."""
        if not self.split_lines:
            return self._encode(texts)
        lines, counts = _lines(texts)
        encoded = self._encode(lines)
        out, k = [], 0
        for n in counts:
            out.append(list(itertools.chain.from_iterable(encoded[k : k + n])))
            k += n
        return out

    def encode_packed(
        self, texts: list[str], eos_after: list[bool], *, dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ids of ``texts`` one after another as one ``dtype`` array, with EOS after each
        text whose ``eos_after`` is true, and the offsets just after those EOS (int64): the
        layout of a shard, built with no Python list or int per id where SentencePiece can
        return each string's ids as a buffer."""
        strings, counts = _lines(texts) if self.split_lines else (texts, [1] * len(texts))
        buffers = self._buffers(strings)
        if buffers is None:
            return self._pack_lists(self._encode(strings), counts, eos_after, dtype)
        eos = np.array([self.eos_id], np.int32).tobytes()
        pieces: list[bytes] = []  # int32 ids of each text, then EOS where a document ends
        eos_pieces: list[int] = []
        k = 0
        for n, last in zip(counts, eos_after, strict=True):
            pieces.append(b"".join(buffers[k : k + n]))
            k += n
            if last:
                eos_pieces.append(len(pieces))
                pieces.append(eos)
        sizes = np.fromiter(map(len, pieces), np.int64, count=len(pieces)) // 4
        ids = np.frombuffer(b"".join(pieces), np.int32).astype(dtype)
        return ids, np.cumsum(sizes)[eos_pieces]

    def _pack_lists(self, encoded: list[list[int]], counts, eos_after, dtype):
        """:meth:`encode_packed` from lists of ids (a Hugging Face tokenizer)."""
        sizes = np.fromiter(map(len, encoded), np.int64, count=len(encoded))
        offsets = np.zeros(len(encoded) + 1, np.int64)  # where each encoded string starts
        np.cumsum(sizes, out=offsets[1:])
        flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype, count=int(offsets[-1]))
        at = offsets[np.cumsum(counts, dtype=np.int64)][np.asarray(eos_after, dtype=bool)]
        ids = np.insert(flat, at, self.eos_id)
        return ids, at + np.arange(1, len(at) + 1)

    def _buffers(self, strings: list[str]) -> list | None:
        """Each string's ids as a buffer of int32, from SentencePiece's batch encoder without
        the Python list of ints (``encode(out_type="numpy")`` wraps each in an array, which
        costs more than the encoding saves). None where that entry point is missing (a
        Hugging Face tokenizer, another sentencepiece version): the caller uses lists then."""
        if not self.buffers:
            return None
        return self._impl._processor._EncodeAsBufferBatch(
            strings, 1, None, False, -1, 0.0, False, False, False
        )

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "sentencepiece":
            return self._impl.encode(texts, num_threads=1)
        return [e.ids for e in self._impl.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        if self.kind == "sentencepiece":
            return self._impl.decode(ids)
        return self._impl.decode(ids, skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each id stands for (int32, one per id)."""
        if self.kind == "sentencepiece":
            return sentencepiece_token_bytes(self._impl)
        return _hf_token_bytes(self._impl, self.vocab_size)


def load(directory: Path) -> Tokenizer:
    """The tokenizer saved in a prepared directory (``tokenizer.model`` if there is one, else
    the Hugging Face ``tokenizer.json``)."""
    directory = Path(directory)
    model = directory / "tokenizer.model"
    if model.is_file():
        return load_sentencepiece(model)
    return _load_hf_json(directory)


def load_sentencepiece(path: Path) -> Tokenizer:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    proto = read_proto(path)
    if sp.eos_id() < 0:
        raise UserError(
            f"--tokenizer {path}: this SentencePiece model has no EOS piece; Anneal separates "
            f"documents with EOS. Retrain it with eos_id set, or let prepare train one."
        )
    user_defined = {p.piece for p in proto.pieces if p.type == PIECE_USER_DEFINED}
    norm = proto.normalizer_spec
    # Unigram breaks ties between equal-score segmentations differently for a line alone and
    # within a document (runs of spaces), so only BPE is encoded line by line.
    split_lines = (
        proto.trainer_spec.model_type == 2  # BPE
        and "\n" in user_defined
        and not norm.add_dummy_prefix
        and not norm.remove_extra_whitespaces
        and norm.name == "identity"
    )
    return Tokenizer(
        kind="sentencepiece",
        vocab_size=sp.get_piece_size(),
        eos_id=sp.eos_id(),
        impl=sp,
        split_lines=split_lines,
    )


def _load_hf_json(directory: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"{directory}: no tokenizer.model or tokenizer.json. Pass --tokenizer a "
            f"SentencePiece .model file or a Hugging Face tokenizer directory with "
            f"tokenizer.json (a fast tokenizer)."
        )
    tk = HFTokenizer.from_file(str(path))
    tk.encode_special_tokens = True  # text that spells "</s>" is text, not EOS
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = tk.token_to_id(eos) if eos else None
    if eos_id is None:
        raise UserError(
            f"{directory}: the tokenizer has no eos_token in tokenizer_config.json; Anneal "
            f"separates documents with EOS. Set eos_token there."
        )
    vocab_size = max(
        tk.get_vocab_size(with_added_tokens=True),
        max(tk.get_vocab(with_added_tokens=True).values()) + 1,
    )
    return Tokenizer(
        kind="huggingface", vocab_size=vocab_size, eos_id=eos_id, impl=tk, split_lines=False
    )


def read_proto(path: Path):
    """The ModelProto of a SentencePiece ``.model`` file (its pieces, trainer and normaliser
    specs)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def sentencepiece_token_bytes(sp) -> np.ndarray:
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


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _hf_token_bytes(tk, vocab_size: int) -> np.ndarray:
    """Bytes per id of a Hugging Face tokenizer: exact for byte-level BPE (GPT-2 style) and
    SentencePiece-style vocabularies ('▁', '<0xNN>'); otherwise the UTF-8 length of the
    decoded token. Special tokens count 0."""
    decoder = json.loads(tk.to_str()).get("decoder") or {}
    kinds = json.dumps(decoder)
    byte_level = '"ByteLevel"' in kinds
    specials = {t.content for t in tk.get_added_tokens_decoder().values() if t.special}
    byte_map = _bytes_to_unicode()
    lengths = np.zeros(vocab_size, dtype=np.int32)
    for i in range(vocab_size):
        piece = tk.id_to_token(i)
        if piece is None or piece in specials:
            continue
        if byte_level and all(c in byte_map for c in piece):
            lengths[i] = len(piece)
        elif _BYTE_PIECE.match(piece):
            lengths[i] = 1
        elif "\u2581" in piece or '"Metaspace"' in kinds or '"\\u2581"' in kinds:
            lengths[i] = len(piece.replace("\u2581", " ").encode("utf-8"))
        else:
            lengths[i] = len(tk.decode([i], skip_special_tokens=False).encode("utf-8"))
    return lengths


def ids_file(directory: Path) -> Path:
    """The file that defines the ids of the tokenizer in a directory (what ``load`` reads):
    ``tokenizer.model``, else ``tokenizer.json``."""
    model = Path(directory) / "tokenizer.model"
    return model if model.is_file() else Path(directory) / "tokenizer.json"


def tokenizer_sha256(directory: Path) -> str:
    """Identity of the tokenizer in a prepared directory: the hash of ``ids_file``."""
    return file_sha256(ids_file(directory))
