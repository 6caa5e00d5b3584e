"""One large text file is a usable corpus, and an input too small to validate on is refused.

Proves: a text file given alone as ``--input`` is cut into many documents at paragraphs and
at the latest every 16 KiB, which joined give back the file; a 1 MB file then gets a
validation split with at least one window of the tiny preset's context (257 tokens); the cut
is the same for any work-unit size and for a gzip copy; an input too small to hold out one
window fails at prepare time with one paragraph (exit 2 through the CLI) and writes nothing,
not even over an existing ``--force`` target; ``--val-fraction 0`` is allowed and gives a
directory without validation data (``has_validation`` says so); and the ``anneal data`` flags
take their defaults from the library.
"""

from __future__ import annotations

import gzip
import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from anneal.cli import build_parser, main
from anneal.data import tokenizer as toklib
from anneal.data.checks import has_validation
from anneal.data.prepare import prepare
from anneal.data.prepare_config import SEQ_LEN, PrepareConfig
from anneal.data.prepared_dir import read_meta
from anneal.data.readers import ReadOptions
from anneal.data.stream import PackedSplit
from anneal.data.text_readers import DOC_BYTES, starts_document

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _one_megabyte() -> str:
    """About 1 MB of real text nobody here wrote: stdlib modules, one after the other."""
    parts, size = [], 0
    for p in sorted(STDLIB.glob("*.py")):
        text = p.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text.encode())
        if size >= 1_000_000:
            break
    return "".join(parts)


@pytest.fixture(scope="module")
def big_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("in") / "corpus.txt"
    path.write_text(_one_megabyte(), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer_model(big_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    toklib.train_sentencepiece([big_file.read_text()[:300_000]], vocab_size=1000, out_path=out)
    return out


def _documents(out: Path) -> list[str]:
    """Every document of every split, decoded through the document index."""
    meta = read_meta(out)
    tok = toklib.load(out)
    docs = []
    for split in ("train", "val"):
        info = meta["splits"][split]
        if not info["shards"]:
            continue
        ids = np.concatenate(
            [np.fromfile(out / split / sh["file"], dtype=meta["dtype"]) for sh in info["shards"]]
        ).astype(np.int64)
        ends = np.fromfile(out / split / "00_docs.bin", dtype="<u8").astype(np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        docs += [tok.decode(ids[a : b - 1].tolist()) for a, b in zip(starts, ends, strict=True)]
    return docs


def _digests(out: Path) -> dict[str, str]:
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*.bin"))
    }


def test_one_megabyte_file_gets_a_validation_window(big_file, tokenizer_model, tmp_path):
    out = tmp_path / "data"
    meta = prepare(inputs=[str(big_file)], out=out, tokenizer=tokenizer_model, progress=False)
    val = meta["splits"]["val"]
    assert val["documents"] > 0 and has_validation(meta, seq_len=SEQ_LEN)
    assert PackedSplit(out, "val", seq_len=SEQ_LEN).n_windows >= 1
    docs = _documents(out)
    assert len(docs) > 100
    assert sum(len(d.encode()) for d in docs) == big_file.stat().st_size
    text = big_file.read_text()
    assert all(d in text for d in docs[:50])  # whole lines of the file, not rearranged


def test_the_cut_does_not_depend_on_units_and_gzip_cuts_alike(big_file, tokenizer_model, tmp_path):
    kw = {"tokenizer": tokenizer_model, "progress": False, "val_fraction": 0.1}
    prepare(inputs=[str(big_file)], out=tmp_path / "a", **kw)
    prepare(inputs=[str(big_file)], out=tmp_path / "b", unit_bytes=10_000, workers=2, **kw)
    gz = tmp_path / "corpus.txt.gz"
    with gzip.open(gz, "wb") as f:
        f.write(big_file.read_bytes())
    meta_gz = prepare(inputs=[str(gz)], out=tmp_path / "c", **kw)
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
    a = read_meta(tmp_path / "a")
    # Another file name holds out other documents; the documents themselves are the same.
    for key in ("documents", "tokens", "bytes"):
        assert sum(meta_gz["splits"][s][key] for s in ("train", "val")) == sum(
            a["splits"][s][key] for s in ("train", "val")
        )
    assert sorted(_documents(tmp_path / "c")) == sorted(_documents(tmp_path / "a"))


def test_paragraphs_and_the_size_bound_start_documents():
    assert starts_document(0, b"\n", 1, b"def f():\n")  # after a blank line
    assert not starts_document(0, b"x = 1\n", 6, b"y = 2\n")
    assert not starts_document(0, b"\n", 1, b"\n")  # blank lines stay with what precedes
    line = b"a" * 99 + b"\n"
    assert starts_document(DOC_BYTES - 50, line, DOC_BYTES + 50, line)  # crossed 16 KiB
    assert starts_document(DOC_BYTES - 100, line, DOC_BYTES, line)  # starts on the mark
    assert not starts_document(DOC_BYTES, line, DOC_BYTES + 100, line)


def test_a_file_without_blank_lines_is_cut_every_16_kib(tokenizer_model, tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"line {i} of a file with no blank line\n" for i in range(5000)))
    out = tmp_path / "out"
    prepare(inputs=[str(path)], out=out, tokenizer=tokenizer_model, val_fraction=0.0, seq_len=8)
    docs = _documents(out)
    size = path.stat().st_size
    assert len(docs) == -(-size // DOC_BYTES)
    assert all(len(d) <= DOC_BYTES + 64 for d in docs) and "".join(docs) == path.read_text()


def test_too_small_an_input_fails_with_one_paragraph_and_writes_nothing(
    tokenizer_model, tmp_path, capsys
):
    small = tmp_path / "small.txt"
    small.write_text("A few lines.\n\nNot nearly enough to hold out a window.\n")
    out = tmp_path / "data"
    args = ["data", "prepare", "--input", str(small), "--out", str(out), "--quiet"]
    args += ["--tokenizer", str(tokenizer_model)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "--val-fraction 0.02" in err and "257 tokens" in err and "--val-fraction 0" in err
    assert len(err.splitlines()) == 1  # one paragraph
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.txt"]
    # Over an earlier prepare's directory with --force: the old one stays as it was.
    out.mkdir()
    (out / "keep").write_text("old")
    (out / "meta.json").write_text('{"format_version": 2}')  # the mark of a prepare's output
    assert main([*args, "--force"]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["keep", "meta.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "small.txt"]
    # No validation data, asked for: allowed, and visible.
    assert main([*args, "--force", "--val-fraction", "0"]) == 0
    meta = read_meta(out)
    assert not has_validation(meta) and meta["splits"]["val"]["shards"] == []


def test_cli_defaults_are_the_librarys():
    args = build_parser().parse_args(["data", "prepare", "--input", "x", "--out", "o"])
    cfg, read = PrepareConfig(inputs=(), out=Path()), ReadOptions()
    for name in ("vocab_size", "model_type", "tokenizer_sample_mb", "val_fraction", "seq_len"):
        assert getattr(args, name) == getattr(cfg, name), name
    for name in ("seed", "workers", "dtype", "shard_tokens"):
        assert getattr(args, name) == getattr(cfg, name), name
    assert (args.text_field, args.on_error) == (read.text_field, read.on_error)
    assert SEQ_LEN == 256
    with pytest.raises(SystemExit):  # --kind was never read; it is gone
        build_parser().parse_args(["data", "synth", "--kind", "markov", "--out", "o"])
