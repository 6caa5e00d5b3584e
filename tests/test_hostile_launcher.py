"""Hostile input to the launcher (``python -m launcher``) and bench/gpu.sh: refused as one clear
paragraph with exit 2, no traceback, and nothing around the command changed (issue 18).

Proves, one surface at a time:
- ``hostfile``: every value is checked before anything is written (``--slots 0`` is refused,
  not taken for 8; ``--slots -1`` writes nothing); an existing ``--out`` is kept byte for byte
  unless ``--force``, and ``--force`` replaces only a hostfile (never another file or a
  directory), by renaming a complete new file over it; hostfiles with garbage, binary bytes,
  Unicode digits, huge slot counts or duplicate hosts are refused with the line.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from launcher.__main__ import main as launcher_main

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "recipes" / "pretrain_tiny.py")
GPU_SH = ROOT / "bench" / "gpu.sh"


def tree(root: Path) -> dict[str, str]:
    """{relative path: sha256 of the file, or 'dir'} for everything under ``root``."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def launch(capsys, argv: list[str]) -> tuple[int, str, str]:
    """``python -m launcher ARGV`` in-process: (exit code, stdout, stderr), never a traceback."""
    code = launcher_main(argv)
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err
    return code, printed.out, printed.err


def refused(capsys, argv: list[str], *must: str) -> str:
    """Assert that ``argv`` exits 2 with one paragraph on stderr holding every ``must``."""
    code, out, err = launch(capsys, argv)
    assert code == 2, out + err
    assert err.startswith("launcher: error: ") and len(err.strip().splitlines()) == 1, err
    for text in must:
        assert text in err, f"{text!r} not in: {err}"
    return err


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    """A real prepared directory from a few kilobytes of text (a 300-token vocabulary)."""
    from anneal.data.prepare import prepare

    src = tmp_path_factory.mktemp("src") / "text.txt"
    src.write_text("\n\n".join(f"document {i}: " + "the quick brown fox " * 40 for i in range(150)))
    out = tmp_path_factory.mktemp("prep") / "data"
    prepare(inputs=[str(src)], out=out, vocab_size=300, val_fraction=0.2)
    return out


# --- hostfile: item 7 ---------------------------------------------------------------------


def test_slots_zero_is_refused_not_taken_for_the_default(tmp_path, capsys):
    out = tmp_path / "hf"
    refused(
        capsys,
        ["hostfile", "--hosts", "a,b", "--slots", "0", "--out", str(out)],
        "--slots",
        "at least 1",
        "e.g. 8",
    )
    assert tree(tmp_path) == {}


def test_negative_slots_write_nothing(tmp_path, capsys):
    out = tmp_path / "sub" / "hf"
    err = refused(
        capsys,
        ["hostfile", "--hosts", "a", "--slots", "-1", "--out", str(out)],
        "--slots",
        "at least 1",
    )
    assert "line 1" not in err  # the flag is blamed, not a file it should not have written
    assert tree(tmp_path) == {}


@pytest.mark.parametrize(
    "bad",
    [
        ["--slots", "-1"],
        ["--slots", "5000"],
        ["--hosts", "a,b;reboot"],
        ["--hosts", "a,a"],
        ["--nodes", "3"],
        [],  # the file exists and there is no --force
    ],
    ids=["negative-slots", "huge-slots", "metachar-host", "duplicate-host", "nodes", "no-force"],
)
def test_a_refused_call_leaves_the_existing_hostfile_byte_identical(tmp_path, capsys, bad):
    out = tmp_path / "hf"
    out.write_bytes(b"# mine, hand-written\ngpu001 slots=8\r\n")
    before = tree(tmp_path)
    hosts = [] if "--hosts" in bad else ["--hosts", "gpu001,gpu002"]
    force = ["--force"] if bad else []  # refused for the value, not for the existing file
    err = refused(capsys, ["hostfile", "--out", str(out), *hosts, *bad, *force])
    assert (bad[0] if bad else "--force") in err
    assert tree(tmp_path) == before


def test_an_existing_hostfile_is_replaced_only_with_force_and_atomically(tmp_path, capsys):
    out = tmp_path / "hf"
    out.write_text("old1 slots=2\n")
    before = tree(tmp_path)
    argv = ["hostfile", "--hosts", "gpu001,gpu002", "--slots", "4", "--out", str(out)]
    refused(capsys, argv, f"--out {out}: exists", "--force")
    assert tree(tmp_path) == before
    inode = out.stat().st_ino
    code, printed, _ = launch(capsys, [*argv, "--force"])
    assert code == 0 and "wrote" in printed
    assert out.read_text() == "gpu001 slots=4\ngpu002 slots=4\n"
    # A new file renamed over the old one (a reader sees one or the other), nothing beside it.
    assert out.stat().st_ino != inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("kind", ["text", "directory", "link", "empty"])
def test_force_replaces_nothing_but_a_hostfile(tmp_path, capsys, kind):
    out = tmp_path / "target"
    if kind == "text":
        out.write_text("my notes\nnot a hostfile\n")
    elif kind == "empty":
        out.write_text("")
    elif kind == "directory":
        out.mkdir()
        (out / "keep.txt").write_text("keep")
    else:
        (tmp_path / "real").write_text("gpu1 slots=8\n")
        out.symlink_to(tmp_path / "real")
    before = tree(tmp_path)
    err = refused(
        capsys, ["hostfile", "--hosts", "gpu001", "--out", str(out), "--force"], f"--out {out}"
    )
    assert any(s in err for s in ("not a hostfile", "a directory", "a link")), err
    assert "Name a" in err or "Choose a new file" in err
    assert tree(tmp_path) == before


def test_out_in_a_file_that_is_not_a_directory(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    before = tree(tmp_path)
    refused(
        capsys,
        ["hostfile", "--hosts", "a", "--out", str(tmp_path / "file" / "hf")],
        "not a writable directory",
    )
    assert tree(tmp_path) == before


# Hostfiles a user might hand over: each refused with the file, the line or the problem, and
# the fix, before anything else happens. ``run`` reads the hostfile first, so no data needed.
BAD_HOSTFILES = {
    "binary": (b"\xff\xfe\x00\x81gpu1 slots=8\n", "not UTF-8 text"),
    "superscript-slots": ("gpu1 slots=\u00b2\n".encode(), "line 1"),
    "fullwidth-slots": ("gpu1 slots=\uff18\n".encode(), "line 1"),
    "huge-slots": (b"gpu1 slots=99999999999999999999\n", "more than 1024"),
    "zero-slots": (b"gpu1 slots=0\n", "at least 1"),
    "unicode-host": ("gp\u00fc1 slots=8\n".encode(), "characters other than"),
    "bom": ("\ufeffgpu1 slots=8\n".encode(), "characters other than"),
    "nul": (b"gpu1\x00x slots=8\n", "characters other than"),
    "duplicate": (b"gpu1 slots=8\ngpu2 slots=8\ngpu1 slots=4\n", "line 3"),
    "extra-field": (b"gpu1 slots=8 extra\n", "is not 'HOST slots=N'"),
    "no-slots": (b"gpu1\n", "is not 'HOST slots=N'"),
    "long-host": (b"h" * 300 + b" slots=8\n", "longer than any DNS name"),
    "comments-only": (b"# gpu1 slots=8\n\n", "no hosts"),
    "huge-file": (b"a" * (2 << 20), "larger than"),
}


@pytest.mark.parametrize("case", BAD_HOSTFILES, ids=list(BAD_HOSTFILES))
def test_bad_hostfiles_are_refused_before_anything_runs(tmp_path, capsys, case):
    data, match = BAD_HOSTFILES[case]
    hf = tmp_path / "hf"
    hf.write_bytes(data)
    before = tree(tmp_path)
    err = refused(
        capsys,
        [
            "run",
            RECIPE,
            "--hostfile",
            str(hf),
            "--dry-run",
            "--device",
            "cpu",
            "--",
            "--out",
            str(tmp_path / "run"),
        ],
        f"hostfile {hf}",
        match,
    )
    assert len(err) < 600  # the message quotes a bounded piece of the line, not the file
    assert tree(tmp_path) == before


def test_a_directory_or_a_device_is_not_a_hostfile(tmp_path, capsys):
    for path in (tmp_path, Path("/dev/null"), Path("/dev/zero")):
        refused(
            capsys,
            ["run", RECIPE, "--hostfile", str(path), "--device", "cpu", "--dry-run"],
            f"hostfile {path}: not a regular file",
        )
    assert tree(tmp_path) == {}


def test_the_sbatch_script_replaces_the_hostfile_of_its_previous_run():
    """A requeued job writes RUN/hostfile again: the template passes --force (a hostfile it
    wrote is all --force replaces)."""
    text = (ROOT / "launcher" / "templates" / "multinode.sbatch").read_text()
    line = next(ln for ln in text.splitlines() if "-m launcher hostfile" in ln)
    assert "--force" in line
