"""Tokenizers lose no text and agree with Hugging Face.

Proves: text -> ids -> text is the identity for a trained tokenizer (BPE and unigram) on text
it never saw, byte fallback included; encoding line by line gives the ids of encoding whole
(BPE); ``AutoTokenizer.from_pretrained(DIR)`` encodes the ids SentencePiece does and decodes
them back (on real source code and on adversarial strings); ``token_bytes.npy`` counts exactly
the UTF-8 bytes of every text; a reused SentencePiece model or Hugging Face tokenizer
directory prepares shards whose ids are the ones that tokenizer gives; and the shards of both
splits are SentencePiece's own ``encode`` of each whole document plus EOS, for any workers and
unit size, whichever way the pipeline packs the ids.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from anneal.data import tokenizer as toklib
from anneal.data import tokenizer_hf
from anneal.data.pack import is_validation
from anneal.data.prepare import prepare
from anneal.data.readers import Problems, ReadOptions
from anneal.data.sources import parse_inputs
from anneal.data.units import list_units, read_unit
from anneal.errors import UserError

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Text the tokenizer never saw in training: other scripts, emoji, controls, odd whitespace,
# strings that spell control pieces, CRLF, a lone combining mark, a long line of one letter.
UNSEEN = [
    "naïve café — 日本語のテキスト 🤖🚀 \u0301x",
    "tabs\tand\u00a0nbsp\u2003em-space\r\nwindows line\r\n",
    "</s> <unk> <s> <0x41> \x00\x01\x7f",
    "   leading spaces and trailing   ",
    "\n\n\nblank lines\n\n",
    "x" * 5000,
    "",
    "1234567890 3.14159 -0x1F",
]


def _corpus_texts() -> list[str]:
    files = sorted((STDLIB / "json").glob("*.py")) + sorted((STDLIB / "email").glob("*.py"))
    return [p.read_text(encoding="utf-8") for p in files]


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def trained(request, tmp_path_factory) -> Path:
    """A directory with a small trained tokenizer and its Hugging Face files."""
    out = tmp_path_factory.mktemp(f"tok_{request.param}")
    toklib.train_sentencepiece(
        _corpus_texts()[1:],  # the first file stays unseen
        vocab_size=600,
        out_path=out / "tokenizer.model",
        model_type=request.param,
    )
    tokenizer_hf.save_hf_files(out / "tokenizer.model", out)
    return out


def _fuzz(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = "ab \n\t\r</>s0x9é日🤖\u2028\u00a0_"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(n)]


def test_round_trip_is_lossless(trained):
    tok = toklib.load(trained)
    texts = [*UNSEEN, _corpus_texts()[0], *_fuzz(200)]
    for text, ids in zip(texts, tok.encode_batch(texts), strict=True):
        assert tok.decode(ids) == text
    # Characters outside the vocabulary became byte pieces, not <unk>.
    assert 0 not in tok.encode_batch(UNSEEN)[0]


def test_lower_one_eighth_block_is_the_known_exception(trained):
    """SentencePiece escapes spaces as U+2581, so that character decodes as a space."""
    tok = toklib.load(trained)
    assert tok.decode(tok.encode_batch(["a\u2581b"])[0]) == "a b"


def test_line_by_line_encoding_equals_whole(trained):
    tok = toklib.load(trained)
    assert tok.split_lines == (trained.name.startswith("tok_bpe"))
    texts = [*UNSEEN, *_corpus_texts(), *_fuzz(100, seed=1)]
    whole = [tok._impl.encode(t) for t in texts]
    assert tok.encode_batch(texts) == whole


def test_autotokenizer_encodes_the_same_ids(trained):
    from transformers import AutoTokenizer

    tok = toklib.load(trained)
    hf = AutoTokenizer.from_pretrained(str(trained))
    texts = [*UNSEEN, *_corpus_texts(), *_fuzz(300, seed=2)]
    for text, ids in zip(texts, tok.encode_batch(texts), strict=True):
        assert hf.encode(text, add_special_tokens=False) == ids, repr(text[:60])
        assert hf.decode(ids) == text
    assert hf.eos_token_id == toklib.EOS_ID and hf.convert_ids_to_tokens(1) == "</s>"


def test_token_bytes_count_every_utf8_byte(trained):
    tok = toklib.load(trained)
    lengths = tok.token_bytes()
    assert lengths.shape == (tok.vocab_size,)
    assert lengths[toklib.EOS_ID] == 0
    for text, ids in zip(UNSEEN, tok.encode_batch(UNSEEN), strict=True):
        assert int(lengths[ids].sum()) == len(text.encode("utf-8")), repr(text[:40])


def _corpus_dir(tmp_path: Path) -> Path:
    src = tmp_path / "corpus"
    src.mkdir()
    for i, text in enumerate(_corpus_texts()):
        (src / f"{i:03d}.py").write_text(text, encoding="utf-8")
    return src


def _shard_ids(out: Path, split: str = "train") -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate(
        [
            np.fromfile(out / split / s["file"], dtype=meta["dtype"])
            for s in meta["splits"][split]["shards"]
        ]
    )


def test_reused_sentencepiece_model_gives_its_ids(trained, tmp_path):
    src = _corpus_dir(tmp_path)
    out = tmp_path / "prepared"
    meta = prepare(
        inputs=[str(src)],
        out=out,
        tokenizer=trained / "tokenizer.model",
        workers=1,
        val_fraction=0.0,
        progress=False,
    )
    assert meta["tokenizer"]["trained"] is False
    assert meta["tokenizer_sha256"] == toklib.file_sha256(trained / "tokenizer.model")
    tok = toklib.load(trained)
    texts = _corpus_texts()
    expected = [i for ids in tok.encode_batch(texts) for i in [*ids, toklib.EOS_ID]]
    assert _shard_ids(out).tolist() == expected


def _plain_sentencepiece(trained: Path):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(trained / "tokenizer.model"))


def test_encode_packed_gives_sentencepieces_ids_by_buffers_and_by_lists(trained):
    """Both ways of packing (SentencePiece's int32 buffers, and lists of ints, which a Hugging
    Face tokenizer or another sentencepiece version takes) give SentencePiece's own ids of each
    whole text, EOS after the texts that end a document, and the offsets after each EOS."""
    tok, sp = toklib.load(trained), _plain_sentencepiece(trained)
    texts = [*UNSEEN, *_fuzz(200, seed=4), *_corpus_texts()[:3]]
    eos_after = [i % 3 != 1 for i in range(len(texts))]  # some texts are pieces of one document
    want_ids, want_ends = [], []
    for text, last in zip(texts, eos_after, strict=True):
        want_ids += sp.encode(text)
        if last:
            want_ids.append(sp.eos_id())
            want_ends.append(len(want_ids))
    assert tok.buffers, "sentencepiece lost _EncodeAsBufferBatch: prepare is slower"
    for buffers in (True, False):
        tok.buffers = buffers
        ids, ends = tok.encode_packed(texts, eos_after, dtype=np.dtype(np.uint16))
        assert ids.dtype == np.uint16 and ids.tolist() == want_ids
        assert ends.tolist() == want_ends
        empty_ids, empty_ends = tok.encode_packed([], [], dtype=np.dtype(np.uint16))
        assert len(empty_ids) == len(empty_ends) == 0


@pytest.mark.parametrize("workers, unit_bytes", [(1, 4 << 20), (2, 16 << 10)])
def test_shards_hold_sentencepieces_own_ids_of_every_document(
    trained, tmp_path, workers, unit_bytes
):
    """Shards against SentencePiece alone: each split is, id for id, ``encode(document)`` of
    every whole document in input order followed by EOS, whatever the workers, the unit size
    (small units cut a text file into pieces, encoded apart: BPE only, whose ids do not cross
    a newline) and the batches the pipeline encodes in."""
    sp = _plain_sentencepiece(trained)
    docs = [*_corpus_texts(), *UNSEEN, *_fuzz(300, seed=3)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    inputs = [str(jsonl)]
    if tok_is_bpe := trained.name.startswith("tok_bpe"):
        big = tmp_path / "big"
        big.mkdir()
        (big / "all.py").write_text("\n".join(_corpus_texts()), encoding="utf-8")
        assert (big / "all.py").stat().st_size > 4 * unit_bytes or unit_bytes > 1 << 20
        inputs.append(str(big))
    out = tmp_path / "prepared"
    meta = prepare(
        inputs=inputs,
        out=out,
        tokenizer=trained / "tokenizer.model",
        workers=workers,
        unit_bytes=unit_bytes,
        val_fraction=0.3,
        seq_len=8,
        progress=False,
    )
    expected: dict[str, list[int]] = {"train": [], "val": []}
    opts = ReadOptions()  # whole documents: a text file is one record at the default unit
    for source in parse_inputs(inputs):
        for unit in list_units(source, opts, Problems("stop")):
            for rec in read_unit(unit, opts, Problems("stop")):
                val = is_validation(source.name, rec.name, val_fraction=0.3)
                expected["val" if val else "train"] += [*sp.encode(rec.text), sp.eos_id()]
    assert len(meta["sources"]) == 1 + tok_is_bpe
    for split, ids in expected.items():
        assert meta["splits"][split]["documents"] > 0
        assert _shard_ids(out, split).tolist() == ids, split


def _byte_level_hf_dir(tmp_path: Path, *, extra_words: int = 0) -> Path:
    """A GPT-2-style byte-level BPE saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(_corpus_texts(), trainer=trainer)
    wrapper = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")
    if extra_words:
        wrapper.add_tokens([f"word{i}" for i in range(extra_words)])
    out = tmp_path / "hf_tok"
    wrapper.save_pretrained(str(out))
    return out


def test_reused_hf_tokenizer_gives_its_ids(tmp_path):
    from transformers import AutoTokenizer

    hf_dir = _byte_level_hf_dir(tmp_path)
    src = _corpus_dir(tmp_path)
    out = tmp_path / "prepared"
    meta = prepare(
        inputs=[str(src)],
        out=out,
        tokenizer=hf_dir,
        workers=2,
        val_fraction=0.0,
        progress=False,
    )
    assert meta["tokenizer"]["kind"] == "huggingface"
    assert not (out / "tokenizer.model").exists()
    reloaded = AutoTokenizer.from_pretrained(str(out))
    eos = reloaded.eos_token_id
    assert eos == meta["eos_id"]
    expected = [
        i for t in _corpus_texts() for i in [*reloaded.encode(t, add_special_tokens=False), eos]
    ]
    assert _shard_ids(out).tolist() == expected
    # Byte-level BPE: bytes per id are exact, so bits per byte are too.
    token_bytes = np.load(out / "token_bytes.npy")
    assert int(token_bytes[_shard_ids(out)].sum()) == meta["splits"]["train"]["bytes"]


def test_tokenizer_path_that_is_not_one_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="not a SentencePiece model"):
        tokenizer_hf.install(tmp_path / "notes.txt", tmp_path)
    with pytest.raises(UserError, match="nor a directory with"):
        tokenizer_hf.install(tmp_path / "missing", tmp_path)
