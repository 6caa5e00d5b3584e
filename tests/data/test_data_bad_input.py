"""Bad input gets one clear message (or is skipped and counted), never a silent wrong result.

Proves: empty files are skipped and counted, an input of nothing but empty files is an error;
non-UTF-8 bytes and JSON Lines lines that are not JSON are reported with file and byte/line
and stop the prepare, or are skipped and counted with ``--on-error skip``; a missing text
field names the fields there are; a vocabulary too large for uint16 picks uint32 and refuses
``--dtype uint16``; a prepared directory whose tokenizer changed, or whose vocabulary differs
from the run being resumed, stops training at plan time; a damaged directory is refused; a
prepare killed midway leaves no directory that looks complete (and the next one cleans up);
and a Hugging Face hub name fails within seconds when offline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from anneal.cli import main
from anneal.data import tokenizer as toklib
from anneal.data.checks import check_matches_run, check_prepared
from anneal.data.prepare import prepare
from anneal.errors import UserError

REPO = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(autouse=True)
def _tokenizer_step_in_this_process(monkeypatch):
    """prepare's tokenizer step runs here instead of in a fresh interpreter
    (``anneal.data.make_tokenizer._in_child``, which imports the tokenizer libraries again:
    1-5 s a prepare on 2 cores, most of this file's time). What these tests check, the
    messages and counts of bad input, does not depend on where that step runs; the child
    itself, and an error coming back from it, are checked by the other prepare tests
    (tests/data/test_data_prepare.py, tests/data/test_hostile_data.py). The interrupted prepares
    below
    are real ``anneal data prepare`` processes, children and all."""
    from anneal.data import make_tokenizer

    monkeypatch.setattr(make_tokenizer, "_in_child", lambda fn, *args: fn(*args))


def _texts() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted((STDLIB / "json").glob("*.py"))]


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    toklib.train_sentencepiece(_texts(), vocab_size=400, out_path=out)
    return out


def _prepare(tmp_path, inputs, tokenizer_model, **kw):
    kw = {"val_fraction": 0.0, "progress": False, "tokenizer": tokenizer_model, **kw}
    return prepare(inputs=[str(i) for i in inputs], out=tmp_path / "out", **kw)


def test_empty_files_are_skipped_and_counted(tmp_path, tokenizer_model):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_text("")
    (src / "b.txt").write_text("hello\n")
    meta = _prepare(tmp_path, [src], tokenizer_model)
    assert meta["skipped"]["empty_files"] == 1
    assert meta["splits"]["train"]["documents"] == 1
    with pytest.raises(UserError, match=r"a\.txt: no documents"):
        _prepare(tmp_path, [src / "a.txt"], tokenizer_model, force=True)


def test_non_utf8_bytes_stop_with_file_and_offset_or_are_skipped(tmp_path, tokenizer_model):
    src = tmp_path / "in"
    src.mkdir()
    (src / "good.txt").write_text("fine text\n")
    (src / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    with pytest.raises(UserError, match=r"latin1\.txt: byte 3: not valid UTF-8.*--on-error skip"):
        _prepare(tmp_path, [src], tokenizer_model)
    assert not (tmp_path / "out").exists()
    meta = _prepare(tmp_path, [src], tokenizer_model, on_error="skip")
    assert meta["skipped"]["records"] == 1
    assert "latin1.txt: byte 3" in meta["skipped"]["examples"][0]
    assert meta["splits"]["train"]["bytes"] == len("fine text\n")


def test_jsonl_line_that_is_not_json_names_file_and_line(tmp_path, tokenizer_model):
    path = tmp_path / "web.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n{"text": broken\n{"text": "four"}\n')
    with pytest.raises(UserError, match=r"web\.jsonl:3: not JSON"):
        _prepare(tmp_path, [path], tokenizer_model)
    meta = _prepare(tmp_path, [path], tokenizer_model, on_error="skip")
    assert meta["skipped"]["records"] == 1
    assert meta["splits"]["train"]["documents"] == 3


def test_jsonl_line_number_is_right_in_a_later_unit(tmp_path, tokenizer_model):
    lines = [json.dumps({"text": f"document {i}"}) for i in range(2000)]
    lines[1500] = "not json"
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"big\.jsonl:1501: not JSON"):
        _prepare(tmp_path, [path], tokenizer_model, unit_bytes=4096, workers=2)


def test_missing_field_names_the_fields_there_are(tmp_path, tokenizer_model):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 1, "content": "x"}\n')
    with pytest.raises(UserError, match=r"rows\.jsonl:1: no field 'text' \(fields: id, content\)"):
        _prepare(tmp_path, [path], tokenizer_model)
    with pytest.raises(UserError, match="--text-field"):
        _prepare(tmp_path, [path], tokenizer_model)
    meta = _prepare(tmp_path, [path], tokenizer_model, text_field="content")
    assert meta["splits"]["train"]["documents"] == 1


def test_parquet_value_that_is_not_text_names_the_row(tmp_path, tokenizer_model):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    rows = [{"text": "first row"}, {"text": "second row"}, {"text": None}, {"text": "fourth"}]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    with pytest.raises(UserError, match=r"rows\.parquet: row 2: 'text' is NoneType"):
        _prepare(tmp_path, [path], tokenizer_model)
    meta = _prepare(tmp_path, [path], tokenizer_model, on_error="skip")
    assert meta["skipped"]["records"] == 1
    assert meta["splits"]["train"]["documents"] == 3


def test_unknown_input_and_bad_weight(tmp_path):
    with pytest.raises(UserError, match="no such file or directory"):
        prepare(inputs=[str(tmp_path / "nope.jsonl")], out=tmp_path / "o", progress=False)
    with pytest.raises(UserError, match="above 0"):
        prepare(inputs=["stdlib:0"], out=tmp_path / "o", progress=False)


def _big_vocab_hf_dir(tmp_path: Path, n_words: int = 70_000) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(n_words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = tmp_path / "big_vocab"
    PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="</s>", unk_token="[UNK]"
    ).save_pretrained(str(out))
    return out


def test_vocabulary_too_large_for_uint16(tmp_path):
    hf_dir = _big_vocab_hf_dir(tmp_path)
    text = tmp_path / "t.txt"
    text.write_text("w1 w69999 w65536 w2")
    meta = prepare(
        inputs=[str(text)], out=tmp_path / "out", tokenizer=hf_dir, val_fraction=0.0, progress=False
    )
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
    ids = np.fromfile(
        tmp_path / "out" / "train" / meta["splits"]["train"]["shards"][0]["file"], dtype="<u4"
    )
    assert ids.tolist() == [3, 70_001, 65_538, 4, 1]
    with pytest.raises(UserError, match=r"--dtype uint16 holds ids below 65536.*70,002"):
        prepare(
            inputs=[str(text)],
            out=tmp_path / "o16",
            tokenizer=hf_dir,
            dtype="uint16",
            progress=False,
        )


@pytest.fixture()
def prepared(tmp_path, tokenizer_model) -> Path:
    src = tmp_path / "in"
    src.mkdir()
    for i, t in enumerate(_texts()):
        (src / f"{i}.py").write_text(t)
    _prepare(tmp_path, [src], tokenizer_model, val_fraction=0.3)
    return tmp_path / "out"


def test_changed_tokenizer_is_refused_at_training_time(prepared, tmp_path):
    """check_prepared is what resolve_run calls (asserted through resolve_run below)."""
    assert check_prepared(prepared)["vocab_size"] == 400
    other = tmp_path / "other.model"
    toklib.train_sentencepiece(_texts()[::-1], vocab_size=401, out_path=other)
    (prepared / "tokenizer.model").write_bytes(other.read_bytes())
    with pytest.raises(UserError, match=r"tokenizer\.model: its sha256 .* differs from the tok"):
        check_prepared(prepared)
    from anneal.cli.recipe import config_from_args
    from anneal.train import resolve_run

    cfg, overrides = config_from_args(
        ["--data", str(prepared), "--out", str(tmp_path / "run")],
        prog="t",
        preset="tiny",
        ds_config="cpu.json",
    )
    with pytest.raises(UserError, match="differs from the tokenizer the shards were made with"):
        resolve_run(cfg, overrides)


def test_resuming_with_another_vocabulary_is_refused(prepared, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    config = {"model": {"vocab_size": 8192}, "run": {"data": {"path": "data/stdlib"}}}
    (run / "config.json").write_text(json.dumps(config))
    meta = check_prepared(prepared)
    with pytest.raises(UserError, match=r"400 ids, but the model in .* was built for 8,192"):
        check_matches_run(meta, data_dir=prepared, run_dir=run)
    # Same size, but the data it was started with has another tokenizer.
    (run / "config.json").write_text(
        json.dumps({"model": {"vocab_size": 400}, "run": {"data": {"path": str(tmp_path / "old")}}})
    )
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "meta.json").write_text(json.dumps({"tokenizer_sha256": "f" * 64}))
    with pytest.raises(UserError, match="differs from the one of"):
        check_matches_run(meta, data_dir=prepared, run_dir=run)
    (tmp_path / "old" / "meta.json").write_text(json.dumps(meta))
    check_matches_run(meta, data_dir=prepared, run_dir=run)  # the same tokenizer: fine


def test_damaged_directory_is_refused(prepared):
    meta = check_prepared(prepared)
    shard = prepared / "train" / meta["splits"]["train"]["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(UserError, match="damaged"):
        check_prepared(prepared)


def _big_input(directory: Path) -> Path:
    """About 28 MB of JSON Lines (the top-level stdlib modules six times over): packing goes on
    for seconds after the first shard lands (3.9 s measured here), ample time to interrupt."""
    path = directory / "big.jsonl"
    if not path.exists():
        files = sorted(p for p in STDLIB.glob("*.py"))
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
        with path.open("w") as f:
            for copy in range(6):
                for text in texts:
                    f.write(json.dumps({"text": f"# copy {copy}\n{text}"}) + "\n")
    return path


def _start_prepare(out: Path, workers: int = 1, source: Path | None = None) -> subprocess.Popen:
    """One worker and small shards: the first shard lands early in packing, which then goes
    on for seconds (``source``: another input than ``_big_input``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "anneal.cli",
        "data",
        "prepare",
        "--input",
        str(source or _big_input(out.parent)),
        "--out",
        str(out),
        "--workers",
        str(workers),
        "--vocab-size",
        "2000",
        "--tokenizer-sample-mb",
        "2",
        "--shard-tokens",
        "65536",
        "--quiet",
    ]
    # A shell that runs the suite in the background (CI, `make test &`) leaves SIGINT ignored,
    # and children inherit that: give this child the default disposition, as at a terminal.
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for_packing(out: Path, proc: subprocess.Popen) -> Path:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        found = list(out.parent.glob(f"{out.name}.partial-*/train/*.bin"))
        if found and found[0].stat().st_size > 0:
            return found[0].parent.parent
        time.sleep(0.02)
    raise AssertionError(f"prepare did not start packing: {proc.communicate()}")


def test_interrupted_prepare_leaves_nothing_that_looks_complete(tmp_path):
    out = tmp_path / "data"
    # Ctrl-C: the partial directory is removed.
    proc = _start_prepare(out)
    partial = _wait_for_packing(out, proc)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0, "prepare finished before the interrupt: the test raced"
    assert not out.exists() and not partial.exists()
    # SIGKILL: nothing can clean up, but nothing looks complete either.
    proc = _start_prepare(out)
    partial = _wait_for_packing(out, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert not out.exists() and partial.exists() and not (partial / "meta.json").exists()
    with pytest.raises(UserError, match="interrupted prepare"):
        check_prepared(out)
    # The next prepare removes the dead one's leftovers (its input need not be the same: one
    # copy of the big one's first 1.5 MB, which it packs in a second where that took seconds).
    small = tmp_path / "small.jsonl"
    small.write_text(_big_input(tmp_path).read_text()[:1_500_000].rpartition("\n")[0] + "\n")
    proc = _start_prepare(out, workers=2, source=small)
    assert proc.wait(timeout=300) == 0, proc.communicate()
    assert not partial.exists()
    check_prepared(out)


def _cli(args: list[str], **env) -> tuple[int, str, float]:
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "anneal.cli", *args],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stderr, time.time() - start


def test_hub_name_fails_fast_and_clearly_offline(tmp_path):
    args = [
        "data",
        "prepare",
        "--input",
        "hf:anneal-test/no-such-dataset",
        "--out",
        str(tmp_path / "o"),
    ]
    rc, err, seconds = _cli(args, HF_HUB_OFFLINE="1")
    assert rc == 2 and "HF_HUB_OFFLINE is set" in err and "local copy" in err
    assert seconds < 60
    # Not marked offline but no network: a short probe instead of retries (a closed port here).
    rc, err, seconds = _cli(args, HF_ENDPOINT="http://127.0.0.1:9")
    assert rc == 2 and "cannot reach the Hugging Face Hub" in err and "HF_HUB_OFFLINE=1" in err
    assert seconds < 30
    assert not (tmp_path / "o").exists()


def test_cli_reports_user_errors_in_one_line(tmp_path, capsys):
    assert (
        main(
            [
                "data",
                "prepare",
                "--input",
                "stdlib",
                "--out",
                str(tmp_path / "o"),
                "--val-fraction",
                "1.5",
            ]
        )
        == 2
    )
    assert "--val-fraction 1.5" in capsys.readouterr().err
