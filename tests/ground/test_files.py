"""anneal.files: the one atomic write every small state file goes through, and the one rule for
a command that writes a directory (claim_output, replace_dir): it replaces only an empty
directory or its own earlier output, never ., an ancestor of the working directory, an input
or a file."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from anneal.errors import UserError
from anneal.files import claim_output, replace_dir, write_atomic


@pytest.mark.parametrize("durable", [False, True])
def test_write_atomic_replaces_and_leaves_nothing_beside(tmp_path, durable):
    path = tmp_path / "state.json"
    path.write_text("old")
    write_atomic(path, "new", durable=durable)
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_failed_write_keeps_the_old_file_and_cleans_up(tmp_path):
    path = tmp_path / "latest"
    path.write_text("step_00000010")
    with pytest.raises(TypeError):
        write_atomic(path, None)  # type: ignore[arg-type]  # the write itself fails
    assert path.read_text() == "step_00000010"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_module_stays_torch_free():
    """The data commands and benchmarks import it; it must not drag torch in."""
    code = "import sys, anneal.files; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _ours(path):
    return (path / "MARK").is_file()


def test_claim_output_refuses_what_it_did_not_make(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("corpus")
    (tmp_path / "file").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes").write_text("mine")
    refused = {
        ".": "working directory",
        str(tmp_path.parent): "working directory",
        "/": "root",
        "file": "a file",
        "in": "which this command reads",
        "in/sub": "which this command reads",
        "foreign": "not a thing written",
    }
    for out, why in refused.items():
        with pytest.raises(UserError) as e:
            claim_output(
                tmp_path / out if out not in (".", "/") else out,
                force=True,
                made_by_us=_ours,
                what="thing",
                inputs=[tmp_path / "in"],
            )
        msg = str(e.value)
        assert "--out" in msg and (why in msg or "parents or the root" in msg), (out, msg)
    with pytest.raises(UserError, match="not a writable directory"):
        claim_output(tmp_path / "file" / "out", force=False, made_by_us=_ours, what="thing")
    with pytest.raises(UserError, match="pass --force"):
        claim_output(tmp_path / "foreign", force=False, made_by_us=_ours, what="thing")
    assert (tmp_path / "foreign" / "notes").read_text() == "mine"
    assert (tmp_path / "in" / "a.txt").read_text() == "corpus"


def test_claim_output_takes_new_empty_and_own_directories(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "MARK").write_text("")
    for out in ("new/deeper", "empty", "own"):
        claim_output(tmp_path / out, force=True, made_by_us=_ours, what="thing")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_claim_output_refuses_an_unwritable_parent(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(UserError, match="not a writable directory"):
        claim_output(tmp_path / "ro" / "out", force=False, made_by_us=_ours, what="thing")


def test_replace_dir_swaps_and_leaves_nothing_beside(tmp_path):
    for name in ("out", "partial"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "MARK").write_text(name)
    replace_dir(tmp_path / "partial", tmp_path / "out")
    assert (tmp_path / "out" / "MARK").read_text() == "partial"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
