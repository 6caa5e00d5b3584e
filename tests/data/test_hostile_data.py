"""Hostile but honest input to the data commands: a clear refusal, never a loss or a traceback.

Proves (issue 18): `anneal data prepare --force` and `anneal data synth --force` replace only a
directory their own command wrote, never an input, `.`, a file or a stranger's directory, and
leave no `OUT.old-PID` behind; the clean-up of interrupted prepares deletes only a dead
prepare's own partial directory; a shard whose bytes changed at the same size is named when a
window is read (a UserError, also through the prefetch thread) and `anneal data verify` lists
every damaged file, every tokenizer file included (two ids swapped in tokenizer.json beside an
unchanged tokenizer.model); meta.json may not name a file outside its directory; tokenizer
training reports a bad record or an empty input as packing does, and a --vocab-size too small
(or too large) for the sample as one to raise (or lower), with the bound; bad weights
(``a.txt:abc`` included), overlapping and same-named inputs get their own message; `anneal fit
--out` replaces only a fit file; and any garbage in meta.json is a UserError naming meta.json
and the key. Each refusal exits 2 (or raises UserError), names the problem and the fix, prints
no traceback, and leaves every file around it as it was (the tree is hashed before and after).
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from anneal.cli import main
from anneal.data import prepare as prepare_module
from anneal.data import tokenizer as toklib
from anneal.data.checks import check_prepared
from anneal.data.prepare import prepare
from anneal.data.prepared_dir import read_meta
from anneal.data.sources import parse_inputs
from anneal.errors import UserError
from anneal.planning.law import FIT_FORMAT
from tests.conftest import tree

SEQ = 16
PARTIAL_MARKER = ".anneal-prepare-partial"  # anneal.data.prepare.PARTIAL_MARKER
TEXT = "".join(
    f"line {i}: the quick brown fox jumps over the lazy dog {i * 7}\n" for i in range(60)
)


def refused(argv: list[str], capsys, *, root: Path, names: tuple[str, ...]) -> str:
    """Run the CLI; assert exit 2, one message naming each of ``names``, no traceback, and
    nothing changed below ``root``. Returns the message."""
    before = tree(root)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "\n  File " not in err and "\nAt:" not in err, err
    for name in names:
        assert name in err, f"{name!r} not in: {err}"
    assert tree(root) == before
    return err


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    toklib.train_sentencepiece([TEXT], vocab_size=300, out_path=out)
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer_model) -> Path:
    """A small prepared directory (train and val shards of a few hundred ids), made once."""
    root = tmp_path_factory.mktemp("prepared")
    src = root / "corpus"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(TEXT * 2)
    prepare(
        inputs=[str(src)],
        out=root / "data",
        tokenizer=tokenizer_model,
        val_fraction=0.3,
        seq_len=SEQ,
        shard_tokens=1024,
        workers=1,
        progress=False,
    )
    return root / "data"


@pytest.fixture()
def data(prepared, tmp_path) -> Path:
    """A copy of the prepared directory that a test may damage."""
    return Path(shutil.copytree(prepared, tmp_path / "data"))


def _corpus(tmp_path: Path) -> Path:
    src = tmp_path / "corpus"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_text(TEXT)
    return src


def _prep_args(inputs, out, tokenizer_model=None) -> list[str]:
    argv = ["data", "prepare", "--out", str(out), "--quiet", "--val-fraction", "0"]
    argv += ["--workers", "1"]
    for i in inputs:
        argv += ["--input", str(i)]
    if tokenizer_model is not None:
        argv += ["--tokenizer", str(tokenizer_model)]
    else:
        argv += ["--vocab-size", "300"]
    return argv


# --- item 2 and 9: what --force may replace ---------------------------------------------------


def test_prepare_force_onto_its_input_is_refused_and_the_corpus_kept(tmp_path, capsys):
    src = _corpus(tmp_path)
    argv = _prep_args([src], src) + ["--force"]
    refused(argv, capsys, root=tmp_path, names=(f"--out {src}", "reads", "apart from the inputs"))
    inner = _prep_args([src], src / "prepared") + ["--force"]
    refused(inner, capsys, root=tmp_path, names=("--out", "reads"))


def test_prepare_force_refuses_a_directory_it_did_not_write(tmp_path, capsys, tokenizer_model):
    src = _corpus(tmp_path)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    argv = _prep_args([src], out, tokenizer_model) + ["--force"]
    refused(argv, capsys, root=tmp_path, names=(str(out), "not a prepared data directory"))
    # A meta.json of another tool (a synthetic corpus) is not prepare's mark either.
    (out / "meta.json").write_text('{"synth": {"kind": "markov"}}')
    refused(argv, capsys, root=tmp_path, names=("--force will not delete it",))


def test_prepare_force_replaces_an_earlier_prepare_and_leaves_nothing_beside(
    tmp_path, capsys, tokenizer_model, prepared
):
    src = _corpus(tmp_path)
    out = Path(shutil.copytree(prepared, tmp_path / "out"))
    assert main(_prep_args([src], out, tokenizer_model) + ["--force"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]
    assert check_prepared(out)["sources"][0]["name"] == "corpus"
    assert not (out / PARTIAL_MARKER).exists()


@pytest.mark.parametrize("kind", ["file", "dot", "unwritable", "under-a-file"])
def test_prepare_bad_out_is_one_message(tmp_path, capsys, monkeypatch, kind):
    """A file at --out (with --force: no OUT.old-PID left), --out ., an --out that cannot be
    created: one message each, no traceback."""
    src = _corpus(tmp_path)
    note = tmp_path / "notes.txt"
    note.write_text("keep me")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):  # root ignores the mode bits; procfs refuses even root
        locked = Path("/proc/1")
    out, why = {
        "file": (note, "a file (or link) is there"),
        "dot": (Path("."), "working directory"),
        "unwritable": (locked / "data", "not a writable directory"),
        "under-a-file": (note / "data", "not a writable directory"),
    }[kind]
    argv = _prep_args([src], out) + ["--force"]
    refused(argv, capsys, root=tmp_path, names=(f"--out {out}", why))
    assert not list(tmp_path.glob("*.old-*")) and not list(tmp_path.glob("*.partial-*"))
    if locked.is_relative_to(tmp_path):
        locked.chmod(0o755)


def test_synth_force_replaces_only_a_synthetic_corpus(tmp_path, capsys):
    out = tmp_path / "synth"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["data", "synth", "--out", str(out), "--documents", "2", "--doc-chars", "64"]
    refused([*args, "--force"], capsys, root=tmp_path, names=(str(out), "not a synthetic corpus"))
    refused([*args, "--out", "."], capsys, root=tmp_path, names=("working directory",))
    (out / "notes.txt").unlink()
    assert main(args) == 0  # an empty directory is taken
    assert main([*args, "--force", "--seed", "1"]) == 0  # its own output is replaced
    assert json.loads((out / "meta.json").read_text())["synth"]["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["synth"]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_partial_cleanup_deletes_only_a_dead_prepares_own_directory(tmp_path):
    """Only ``OUT.partial-PID`` with a dead PID that carries the prepare's marker goes; a
    directory of the same shape without the marker, another OUT's partial (the old glob
    matched ``da*a`` against ``data``), a link, a file and a huge PID stay."""
    dead = _dead_pid()
    own = tmp_path / f"da*a.partial-{dead}"
    own.mkdir()
    (own / PARTIAL_MARKER).write_text("x")
    (own / "train").mkdir()
    keep = {
        tmp_path / f"data.partial-{dead}": "another OUT whose name the glob matched",
        tmp_path / f"da*a.partial-{dead}0": "no marker",
        tmp_path / "da*a.partial-99999999999999999999": "a PID no process has",
        tmp_path / f"da*a.partial-x{dead}": "not digits",
    }
    for path in keep:
        path.mkdir()
        (path / "precious.txt").write_text("keep")
    (keep_file := tmp_path / f"da*a.partial-{dead + 1}").write_text("a file")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / PARTIAL_MARKER).write_text("x")
    link = tmp_path / f"da*a.partial-{dead + 2}"
    link.symlink_to(elsewhere)
    before = tree(tmp_path)
    assert getattr(prepare_module, "PARTIAL_MARKER", PARTIAL_MARKER) == PARTIAL_MARKER
    prepare_module._remove_stale_partials(tmp_path / "da*a")
    after = tree(tmp_path)
    assert not own.exists()
    gone = [k for k in before if k == str(own) or k.startswith(f"{own}/")]
    assert after == {k: v for k, v in before.items() if k not in gone}
    assert keep_file.is_file() and link.is_symlink() and (elsewhere / PARTIAL_MARKER).exists()


# --- item 6: same-size damage to a shard ----------------------------------------------------


def _damage(data: Path) -> Path:
    """Overwrite the first train shard with ids far beyond the vocabulary, at the same size."""
    shard = data / "train" / read_meta(data)["splits"]["train"]["shards"][0]["file"]
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    return shard


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_shard_damaged_at_the_same_size_is_named_when_read(data, prefetch):
    from anneal.data.stream import PackedSplit, TokenStream

    shard = _damage(data)
    check_prepared(data)  # sizes match: only the ids tell
    split = PackedSplit(data, "train", seq_len=SEQ)
    stream = TokenStream(
        split, seed=0, rank=0, world_size=1, micro_batch=split.n_windows, prefetch=prefetch
    )
    try:
        with pytest.raises(UserError) as info:
            stream.next_batch()
    finally:
        stream.close()
    msg = str(info.value)
    assert str(shard) in msg  # names the file
    assert f"anneal data verify {data}" in msg and "--force" in msg  # and the fixes
    assert "65535" in msg and f"{split.vocab_size:,}" in msg
    assert not info.value.every_rank  # only this rank read it: the recipe names the rank


def test_data_verify_lists_every_damaged_file(data, capsys):
    assert main(["data", "verify", str(data)]) == 0
    assert "and the tokenizer match" in capsys.readouterr().out
    shard = _damage(data)
    val = data / "val" / read_meta(data)["splits"]["val"]["shards"][0]["file"]
    val.unlink()
    err = refused(["data", "verify", str(data)], capsys, root=data.parent, names=())
    assert f"train/{shard.name} (sha256 differs" in err and f"val/{val.name} (missing)" in err
    assert "2 of" in err and "anneal data prepare" in err and "--force" in err


def swap_two_ids(tokenizer_json: Path, text: str) -> tuple[str, str]:
    """Swap the ids of the first two different pieces that ``text`` encodes to in a Hugging
    Face ``tokenizer.json`` (same pieces, same size class of edit: what a careless edit or a
    mix-up of vocabularies does). Returns the two pieces."""
    from tokenizers import Tokenizer

    pieces = list(dict.fromkeys(Tokenizer.from_file(str(tokenizer_json)).encode(text).tokens))
    doc = json.loads(tokenizer_json.read_text())
    vocab = doc["model"]["vocab"]
    a, b = pieces[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tokenizer_json.write_text(json.dumps(doc, ensure_ascii=False))
    return a, b


def test_data_verify_covers_every_tokenizer_file(data, capsys):
    """meta.json records every file the tokenizer was saved as; two ids swapped in
    tokenizer.json (tokenizer.model unchanged) fail `anneal data verify` and the training-time
    check, naming tokenizer.json. A directory prepared before that record (no
    ``tokenizer_files``) still verifies, and says which tokenizer files it could not cover."""
    files = read_meta(data)["tokenizer_files"]
    assert sorted(files) == ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    assert main(["data", "verify", str(data)]) == 0
    assert "tokenizer.json, tokenizer.model, tokenizer_config.json" in capsys.readouterr().out
    swap_two_ids(data / "tokenizer.json", TEXT)
    err = refused(["data", "verify", str(data)], capsys, root=data.parent, names=())
    assert "1 of" in err and "tokenizer.json (sha256 differs" in err and "--force" in err, err
    with pytest.raises(UserError, match=r"tokenizer\.json: its sha256 .* differs from the tok"):
        check_prepared(data)
    meta = json.loads((data / "meta.json").read_text())
    del meta["tokenizer_files"]  # as prepared by an older Anneal
    (data / "meta.json").write_text(json.dumps(meta))
    assert check_prepared(data)["vocab_size"] == 300
    assert main(["data", "verify", str(data)]) == 0
    out = capsys.readouterr().out
    assert "(tokenizer.model)" in out and "no sha256 for tokenizer.json, tokenizer_config" in out


# --- item 14: file names in meta.json stay inside their directory -----------------------------


@pytest.mark.parametrize(
    "name", ["../../outside.bin", "/etc/passwd", "../val/00_00000.bin", "link.bin", "", "a\\b"]
)
def test_meta_json_cannot_name_a_file_outside_its_directory(data, name, capsys):
    from anneal.data.stream import PackedSplit

    (data.parent / "outside.bin").write_bytes(b"\0" * 4096)
    (data / "train" / "link.bin").symlink_to(data.parent / "outside.bin")
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"]["train"]["shards"][0]["file"] = name
    (data / "meta.json").write_text(json.dumps(meta))
    key = "splits.train.shards[0].file"
    for read in (lambda: PackedSplit(data, "train", seq_len=SEQ), lambda: check_prepared(data)):
        with pytest.raises(UserError) as info:
            read()
        assert "meta.json" in str(info.value) and key in str(info.value)
        assert repr(name) in str(info.value) and "inside its own directory" in str(info.value)
    refused(["data", "verify", str(data)], capsys, root=data.parent, names=("meta.json", key))


# --- item 8: tokenizer training reports the input's problem ---------------------------------


@pytest.mark.parametrize(
    "case", ["bad-jsonl-line", "bad-utf8-in-dir", "empty-file", "dir-of-empty-files"]
)
def test_tokenizer_training_reports_the_inputs_problem_like_packing(tmp_path, capsys, case):
    inp = tmp_path / "in"
    if case == "bad-jsonl-line":
        inp = tmp_path / "web.jsonl"
        inp.write_text('{"text": "fine"}\n{"text": "also fine"}\nnot json\n')
        names = (f"{inp}:3", "not JSON", "Fix or remove the line", "--on-error skip")
    elif case == "bad-utf8-in-dir":
        inp.mkdir()
        (inp / "good.txt").write_text(TEXT)
        (inp / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
        names = ("latin1.txt: byte 3", "not valid UTF-8", "iconv", "--on-error skip")
    elif case == "empty-file":
        inp = tmp_path / "empty.txt"
        inp.write_text("")
        names = (f"--input {inp}: no documents", "Check the input")
    else:  # a directory of empty files, and a JSON Lines file of blank lines
        inp.mkdir()
        (inp / "a.txt").write_text("")
        (inp / "b.jsonl").write_text("\n\n")
        names = (f"--input {inp}: no documents", "Check the input", "--text-field")
    err = refused(_prep_args([inp], tmp_path / "out"), capsys, root=tmp_path, names=names)
    assert "sentencepiece" not in err and "vocab-size" not in err


def test_every_document_held_out_is_said_so(tmp_path, capsys):
    one = tmp_path / "one.txt"
    one.write_text("a single short document\n")
    argv = _prep_args([one], tmp_path / "out") + ["--val-fraction", "0.9999"]
    err = refused(argv, capsys, root=tmp_path, names=("--val-fraction", "went to validation"))
    assert "sentencepiece" not in err


@pytest.mark.parametrize("size", ["0", "-5", "259", "1000000000", "2147483647"])
def test_absurd_vocab_size_is_refused_before_anything(tmp_path, capsys, size):
    src = _corpus(tmp_path)
    argv = _prep_args([src], tmp_path / "out") + ["--vocab-size", size]
    refused(argv, capsys, root=tmp_path, names=(f"--vocab-size {size}", "at least 260", "8192"))


def test_a_vocabulary_too_small_or_too_large_for_the_text_says_which_way(tmp_path, capsys):
    """A sample of 200 distinct characters needs room for each: --vocab-size 300 is told to
    choose a larger one, with the minimum, and that minimum trains; three short lines support
    only so many merges: 5000 is told to choose a smaller one, with the most."""
    rng = random.Random(0)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 200)]
    wide = tmp_path / "wide.txt"
    wide.write_text("\n\n".join("".join(rng.choices(chars, k=300)) for _ in range(50)))
    argv = _prep_args([wide], tmp_path / "out") + ["--vocab-size", "300"]
    err = refused(argv, capsys, root=tmp_path, names=("vocabulary of 300", "larger --vocab-size"))
    assert "smaller --vocab-size" not in err and "character_coverage" not in err, err
    least = int(err.split("at least ")[-1].rstrip(".\n").replace(",", ""))
    assert 456 <= least < 470, err  # 256 bytes, 200 characters, a few control pieces
    assert main(_prep_args([wide], tmp_path / "out") + ["--vocab-size", str(least)]) == 0
    short = tmp_path / "short.txt"
    short.write_text("hello world\n\nfoo bar baz\n")
    argv = _prep_args([short], tmp_path / "out2") + ["--vocab-size", "5000"]
    err = refused(argv, capsys, root=tmp_path, names=("smaller --vocab-size", "or less here"))
    assert "larger" not in err


# --- item 9: inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weight", ["-1", "0", "1e", "nan", "inf", "-0.5", "+0", "abc", "", "0.5x", "½"]
)
def test_a_bad_weight_is_called_a_bad_weight(tmp_path, capsys, weight):
    """Number-like or not (``a.txt:abc``), what follows the last colon of an existing input
    is called a weight that is not a (positive) number, never a missing file."""
    src = _corpus(tmp_path)
    a = src / "0.txt"
    argv = _prep_args([f"{a}:{weight}", f"{src / '1.txt'}:1"], tmp_path / "out")
    err = refused(argv, capsys, root=tmp_path, names=(f"--input {a}:{weight}", "weight"))
    assert "no such file" not in err and "above 0" in err
    assert f"the weight {weight!r} after the last colon is not a" in err, err
    for spec in (f"stdlib:{weight}", f"{src / '*.txt'}:{weight}"):  # not a path alone
        refused(_prep_args([spec], tmp_path / "out"), capsys, root=tmp_path, names=("weight",))


def test_weights_whose_sum_overflows_are_refused(tmp_path, capsys):
    src = _corpus(tmp_path)
    argv = _prep_args([f"{src / '0.txt'}:1e308", f"{src / '1.txt'}:1e308"], tmp_path / "out")
    refused(argv, capsys, root=tmp_path, names=("weights", "add up", "0.7 and 0.3"))


def test_a_glob_that_matches_nothing_says_so(tmp_path, capsys):
    argv = _prep_args([str(tmp_path / "shards" / "*.jsonl")], tmp_path / "out")
    refused(argv, capsys, root=tmp_path, names=("matches no file", "quote it"))


def test_two_files_with_one_name_are_two_sources(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "x.txt").write_text(d)
    sources = parse_inputs([str(tmp_path / "a" / "x.txt"), str(tmp_path / "b" / "x.txt")])
    assert [s.name for s in sources] == ["a/x.txt", "b/x.txt"]
    (tmp_path / "c" / "a").mkdir(parents=True)
    (tmp_path / "c" / "a" / "x.txt").write_text("c")
    names = [s.name for s in parse_inputs([str(tmp_path / d / "x.txt") for d in ("a", "c/a")])]
    assert names == [f"{tmp_path.name}/a/x.txt", "c/a/x.txt"]
    # Names that were already unique stay as they were (they seed the validation split).
    assert [s.name for s in parse_inputs([str(tmp_path / "a"), str(tmp_path / "b")])] == ["a", "b"]


@pytest.mark.parametrize("second", ["inside", "same", "same-spelled-otherwise", "glob"])
def test_an_input_read_twice_is_refused_saying_which(tmp_path, capsys, monkeypatch, second):
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path)
    other = {
        "inside": "corpus/1.txt",
        "same": "corpus",
        "same-spelled-otherwise": "./corpus/../corpus/",
        "glob": "corpus/*.txt",
    }[second]
    why = "lies inside" if second in ("inside", "glob") else "both read"
    argv = _prep_args(["corpus", other], tmp_path / "out")
    refused(argv, capsys, root=tmp_path, names=("--input corpus", f"--input {other}", why))


# --- item 9: anneal fit --out -----------------------------------------------------------------


def test_fit_out_replaces_only_a_fit_file(tmp_path, capsys):
    csv = tmp_path / "runs.csv"
    rows = [
        (n, d, 1.7 + 400 / n**0.34 + 400 / d**0.28) for n in (1e6, 1e7, 1e8) for d in (1e8, 1e9)
    ]
    csv.write_text("params,tokens,loss\n" + "".join(f"{n},{d},{loss}\n" for n, d, loss in rows))
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    args = ["fit", "--csv", str(csv), "--starts", "4", "--bootstrap", "0"]
    refused([*args, "--out", str(notes)], capsys, root=tmp_path, names=("exists", "--force"))
    refused(
        [*args, "--out", str(notes), "--force"],
        capsys,
        root=tmp_path,
        names=("not a fit file", "will not replace"),
    )
    refused([*args, "--out", str(tmp_path)], capsys, root=tmp_path, names=("a directory",))
    photo = tmp_path / "fit.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    fit = tmp_path / "fit.json"
    refused(
        [*args, "--out", str(fit), "--force"],
        capsys,
        root=tmp_path,
        names=(f"--plot {photo}", "not a PNG written by Matplotlib"),
    )
    photo.unlink()
    fit.write_text(json.dumps({"format": FIT_FORMAT, "version": 0}))  # an earlier fit's file
    assert main([*args, "--out", str(fit), "--force", "--seed", "3"]) == 0  # its own: replaced
    assert json.loads(fit.read_text())["method"]["seed"] == 3
    from anneal.files import is_matplotlib_png

    assert is_matplotlib_png(photo) and not is_matplotlib_png(csv)  # the plot --force may replace
    capsys.readouterr()


# --- meta.json garbage ------------------------------------------------------------------------


def _set(meta: dict, path: str, value) -> None:
    keys = path.split(".")
    obj = meta
    for k in keys[:-1]:
        obj = obj[int(k)] if isinstance(obj, list) else obj[k]
    last = keys[-1]
    if value is _DELETE:
        del obj[last]
    elif isinstance(obj, list):
        obj[int(last)] = value
    else:
        obj[last] = value


_DELETE = object()
GARBAGE = [
    ("vocab_size", "400", "vocab_size"),
    ("vocab_size", -1, "vocab_size"),
    ("vocab_size", True, "vocab_size"),
    ("vocab_size", 70000, "vocab_size"),
    ("vocab_size", _DELETE, "vocab_size"),
    ("dtype", "float32", "dtype"),
    ("dtype", None, "dtype"),
    ("format_version", 99, "format_version"),
    ("eos_id", 10**6, "eos_id"),
    ("splits", [], "splits"),
    ("splits.val", _DELETE, "splits.val"),
    ("splits.train.shards", {}, "splits.train.shards"),
    ("splits.train.shards.0", "00_00000.bin", "splits.train.shards[0]"),
    ("splits.train.shards.0.tokens", -5, "splits.train.shards[0].tokens"),
    ("splits.train.shards.0.tokens", 1.5, "splits.train.shards[0].tokens"),
    ("splits.train.shards.0.file", 7, "splits.train.shards[0].file"),
    ("splits.train.shards.0.source", 3, "splits.train.shards[0].source"),
    ("splits.train.shards.0.sha256", "xyz", "splits.train.shards[0].sha256"),
    ("splits.train.tokens", 1, "splits.train.tokens"),
    ("sources", "corpus", "sources"),
    ("sources.0", 5, "sources[0]"),
    ("sources.0.name", None, "sources[0].name"),
    ("blend", "weighted", "sources[0].weight"),
    ("blend", 3, "blend"),
    ("tokenizer_files", [], "tokenizer_files"),
    ("tokenizer_files", {"tokenizer.json": "xyz"}, "tokenizer_files['tokenizer.json']"),
]


def _garbage_id(case) -> str:
    return case[2] + "-" + ("deleted" if case[1] is _DELETE else repr(case[1])[:12])


@pytest.mark.parametrize(("path", "value", "key"), GARBAGE, ids=[_garbage_id(g) for g in GARBAGE])
def test_meta_json_garbage_names_the_key(data, capsys, path, value, key):
    meta = json.loads((data / "meta.json").read_text())
    _set(meta, path, value)
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError) as info:
        check_prepared(data)
    msg = str(info.value)
    assert "meta.json" in msg and key in msg and "anneal data prepare" in msg, msg
    refused(["data", "verify", str(data)], capsys, root=data.parent, names=("meta.json", key))


def test_meta_json_shard_size_that_does_not_match_the_file(data, capsys):
    meta = json.loads((data / "meta.json").read_text())
    shard = meta["splits"]["train"]["shards"][0]
    shard["tokens"] += 1
    meta["splits"]["train"]["tokens"] += 1
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=rf"{shard['file']}: .* bytes, meta.json says .*damaged"):
        check_prepared(data)
    err = refused(["data", "verify", str(data)], capsys, root=data.parent, names=(shard["file"],))
    assert "meta.json says" in err


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "null", '"text"', "[" * 100_000])
def test_meta_json_that_is_not_an_object(data, capsys, text):
    (data / "meta.json").write_text(text)
    with pytest.raises(UserError, match="meta.json"):
        check_prepared(data)
    refused(["data", "verify", str(data)], capsys, root=data.parent, names=("meta.json",))


def _mutate(rng: random.Random, value, depth: int = 0):
    """A random change somewhere inside a JSON value."""
    junk = [None, True, -1, 0, 2**70, 1.5, float("nan"), "", "../x", "/etc/passwd", [], {}, "a"]
    if isinstance(value, dict) and value and depth < 6 and rng.random() < 0.8:
        key = rng.choice(list(value))
        if rng.random() < 0.15:
            del value[key]
        else:
            value[key] = _mutate(rng, value[key], depth + 1)
        return value
    if isinstance(value, list) and value and depth < 6 and rng.random() < 0.8:
        i = rng.randrange(len(value))
        value[i] = _mutate(rng, value[i], depth + 1)
        return value
    return rng.choice(junk)


def test_random_garbage_in_meta_json_is_a_clear_error_or_accepted(data):
    """Property-style: 150 seeded random mutations of a real meta.json. Each one is accepted
    or refused with a UserError naming meta.json; never another exception."""
    from anneal.data.stream import PackedSplit

    good = json.loads((data / "meta.json").read_text())
    rng = random.Random(18)
    for _ in range(150):
        meta = _mutate(rng, copy.deepcopy(good))
        (data / "meta.json").write_text(json.dumps(meta))
        for read in (
            lambda: check_prepared(data),
            lambda: PackedSplit(data, "train", seq_len=SEQ).batch([0]),
        ):
            try:
                read()
            except UserError as e:
                assert "meta.json" in str(e) or str(data) in str(e), str(e)


def test_window_ids_are_checked_cheaply(prepared):
    """The check at read is one max over seq_len + 1 ids (no hashing): a window still reads
    in microseconds."""
    import time

    from anneal.data.stream import PackedSplit

    split = PackedSplit(prepared, "train", seq_len=SEQ)
    start = time.perf_counter()
    for j in range(1000):
        split.window(j % split.n_windows)
    assert (time.perf_counter() - start) / 1000 < 1e-3
    assert np.all(split.window(0) < split.vocab_size)
