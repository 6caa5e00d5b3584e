"""``anneal data prepare`` split into tasks (``--tasks N``, ``--task I``, ``--merge``) gives
exactly the directory one node gives, and refuses what would not fit together.

Proves: over mixed inputs (a JSON Lines file cut into many work units, a directory of small
files, a Parquet file, a weighted blend) the merge of N = 1, 3 and 7 tasks, each task a separate
process (7 is more tasks than input files), is byte for byte the one-node directory: every file
and one sha256 of the tree (provenance.json, the record of how it was made, aside); the large
file's units spread over several tasks; a task run again after its marker is not run again; the
merge removes the parts. Refused, each with one paragraph that names the cause and the fix, and
nothing lost (the parts and an earlier --out stay as they were): a merge with tasks missing
(named), a part made under another plan, a part whose bytes changed (its sha256) or whose file
was cut short, a task or merge run with other flags than the plan's, the plan step run again
with other flags (unless --force, which replaces only the parts directory it made), an input
changed since the plan, a plan whose task ranges overlap, leave a gap or do not cover the
units; a task that died leaves nothing that looks complete, and its rerun replaces what it left;
a second process on a task that one runs is refused and the first completes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from anneal.cli import main
from anneal.data.pack import is_validation
from anneal.data.prepared_dir import PreparedDir
from anneal.errors import UserError
from tests.conftest import ROOT, env

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FLAGS = ["--vocab-size", "500", "--unit-mb", "0.04", "--shard-tokens", "20000", "--quiet"]


def paragraphs(package: str) -> list[str]:
    return [
        chunk
        for p in sorted((STDLIB / package).glob("*.py"))
        for chunk in p.read_text(encoding="utf-8").split("\n\n")
        if chunk.strip()
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 1 MB of real text in three forms: a JSON Lines file of about 10 work units at
    --unit-mb 0.04, a directory of 3 files (none of which hashes into validation at 0.02, so
    one is held out: the merge tokenizes that source again, as one node does), a Parquet
    file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("mixed")
    with open(root / "web.jsonl", "w") as f:
        for text in paragraphs("json") + paragraphs("email"):
            f.write(json.dumps({"text": text}) + "\n")
    (root / "small").mkdir()
    for name in ("__init__.py", "config.py", "handlers.py"):
        (root / "small" / name).write_text((STDLIB / "logging" / name).read_text())
    table = pa.table({"text": paragraphs("http")})
    pq.write_table(table, root / "books.parquet", row_group_size=200)
    return root


def inputs(corpus: Path) -> list[str]:
    return [
        "--input",
        f"{corpus / 'web.jsonl'}:0.5",
        "--input",
        f"{corpus / 'small'}:0.2",
        "--input",
        f"{corpus / 'books.parquet'}:0.3",
    ]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "anneal.cli", "data", "prepare", *args],
        cwd=cwd,
        env={**env(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def tree_sha256(directory: Path) -> str:
    """sha256sum's line of every file but provenance.json, sorted by path, hashed: computed
    here from the bytes, apart from PreparedDir.content_sha256."""
    shas = {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in directory.rglob("*")
        if p.is_file() and p.name != "provenance.json"
    }
    lines = "".join(f"{shas[rel]}  {rel}\n" for rel in sorted(shas))
    return hashlib.sha256(lines.encode()).hexdigest()


def files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in directory.rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def one_node(corpus, tmp_path_factory) -> Path:
    """The reference: one `anneal data prepare` of the same inputs and flags (2 workers)."""
    out = tmp_path_factory.mktemp("one") / "data"
    done = cli(*inputs(corpus), *FLAGS, "--out", str(out), "--workers", "2", cwd=out.parent)
    assert done.returncode == 0, done.stderr
    return out


def run_in_tasks(corpus: Path, out: Path, n: int, *, extra=()) -> dict[int, dict]:
    """The plan (in this process, whose working directory must be ``out``'s folder), then every
    task at once as its own process, then (not here) the merge. Returns each task's
    part.json."""
    args = [*inputs(corpus), *FLAGS, "--out", str(out), "--tasks", str(n), *extra]
    assert Path.cwd() == out.parent
    assert main(["data", "prepare", *args]) == 0
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "anneal.cli", "data", "prepare", *args, "--task", str(i)]
            + ["--workers", "1"],
            cwd=out.parent,
            env={**env(), "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
    parts = out.with_name(out.name + ".parts")
    return {i: json.loads((parts / f"task-{i:05d}" / "part.json").read_text()) for i in range(n)}


@pytest.mark.parametrize("n", [1, 3, 7])
def test_tasks_run_apart_merge_into_the_one_node_directory(
    corpus, one_node, tmp_path, n, capsys, monkeypatch
):
    """Each N: the plan, N task processes at once, the merge; the merged tree is the one-node
    tree byte for byte (one sha256 over it, and each file). About 2 s each here (one process
    per task; the plan and the merge in this process, from the folder of --out)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "data"
    parts_of = run_in_tasks(corpus, out, n)
    parts = out.with_name("data.parts")
    if n > 1:  # the large JSON Lines file (source 0) is spread over tasks, not given to one
        holding = [
            t for t, p in parts_of.items() if p["pieces"]["train"].get("0", {}).get("tokens")
        ]
        assert len(holding) >= 2, holding
    if n == 3:  # a resubmitted task that has its marker is not run again
        before = {p: p.stat().st_mtime_ns for p in (parts / "task-00001").rglob("*")}
        capsys.readouterr()
        again = ["--out", str(out), "--tasks", "3", "--task", "1"]
        assert main(["data", "prepare", *inputs(corpus), *FLAGS, *again]) == 0
        assert "complete already" in capsys.readouterr().out
        assert {p: p.stat().st_mtime_ns for p in before} == before
    capsys.readouterr()
    assert main(["data", "prepare", *inputs(corpus), *FLAGS, "--out", str(out), "--merge"]) == 0
    merged = capsys.readouterr()
    want = files(one_node)
    got = files(out)
    want.pop("provenance.json"), got.pop("provenance.json")
    assert sorted(got) == sorted(want)
    assert [f for f in want if got[f] != want[f]] == []
    assert tree_sha256(out) == tree_sha256(one_node)
    assert PreparedDir(out).content_sha256() == PreparedDir(one_node).content_sha256()
    if n == 1:  # the shell's way of taking the same hash (docs/data.md)
        shell = subprocess.run(
            "find . -type f ! -path ./provenance.json -printf '%P\\n' | LC_ALL=C sort | "
            "xargs sha256sum | sha256sum",
            shell=True,
            cwd=out,
            capture_output=True,
            text=True,
            check=True,
        )
        assert shell.stdout.split()[0] == tree_sha256(out)
    assert f"content sha256 {tree_sha256(one_node)}" in merged.out
    assert not parts.exists()  # the merge removed the parts
    made = json.loads((out / "provenance.json").read_text())
    assert [t["task"] for t in made["tasks"]] == list(range(n))
    # The held-out document of the small directory (none of its 3 files hashes below 0.02).
    meta = json.loads((out / "meta.json").read_text())
    small = meta["splits"]["val"]["sources"]["small"]
    names = [p.name for p in (corpus / "small").iterdir()]
    assert not any(is_validation("small", nm, val_fraction=0.02) for nm in names)
    assert small["documents"] == 1


# ---------------------------------------------------------------------------------------------
# Refusals: one paragraph each, nothing lost


def tree(directory: Path) -> dict[str, str]:
    """{relative path: sha256} of every file below ``directory`` (what "nothing lost" keeps)."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def _planned_once(corpus, tmp_path_factory) -> tuple[list[str], Path, Path]:
    """A plan of 3 tasks with every task complete, made once for the module in this process
    (the plan and each task: a second or two each), and a copy of its folder: (the flags,
    --out, the copy)."""
    out = tmp_path_factory.mktemp("planned") / "data"
    args = [*inputs(corpus), *FLAGS, "--out", str(out), "--tasks", "3", "--workers", "1"]
    assert main(["data", "prepare", *args]) == 0
    for i in range(3):
        assert main(["data", "prepare", *args, "--task", str(i)]) == 0
    copy = tmp_path_factory.mktemp("planned_copy") / "folder"
    shutil.copytree(out.parent, copy, symlinks=True)
    return args, out, copy


@pytest.fixture
def planned(_planned_once) -> tuple[list[str], Path, Path]:
    """``_planned_once`` as it was made, for each test to change: its folder (which holds --out,
    the parts directory and nothing else) put back from the copy, at the same path, since the
    plan records --out. (The flags, --out, the parts directory.)"""
    args, out, copy = _planned_once
    shutil.rmtree(out.parent)
    shutil.copytree(copy, out.parent, symlinks=True)
    return args, out, out.with_name("data.parts")


def refused(capsys, *args: str) -> str:
    """Runs ``anneal data prepare ARGS``, which must exit 2 with one paragraph."""
    capsys.readouterr()
    assert main(["data", "prepare", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("anneal data: error: ") and "\n" not in err, err
    return err


def test_merge_refuses_while_tasks_are_missing_and_names_them(planned, capsys):
    """Tasks 0 and 2 without their markers (2 started and did not finish): the merge names
    both, writes nothing, and the parts stay."""
    args, out, parts = planned
    (parts / "task-00000.done.json").unlink()
    shutil.rmtree(parts / "task-00000")  # never ran
    (parts / "task-00002.done.json").unlink()  # died before its marker
    before = tree(parts)
    err = refused(capsys, *args, "--merge")
    assert "2 of 3 tasks have no completion marker: 0, 2 (2 started and did not finish)" in err
    assert "Nothing was written" in err
    assert tree(parts) == before and not out.exists()
    assert not list(out.parent.glob("data.partial-*"))


def test_merge_refuses_a_part_of_another_plan(planned, corpus, tmp_path, capsys):
    """Task 1's part and marker copied from a preparation with another seed: refused, named."""
    args, out, parts = planned
    other = tmp_path / "other"
    other_args = [*inputs(corpus), *FLAGS, "--out", str(other), "--tasks", "3", "--seed", "1"]
    assert main(["data", "prepare", *other_args, "--workers", "1"]) == 0
    assert main(["data", "prepare", *other_args, "--task", "1", "--workers", "1"]) == 0
    shutil.rmtree(parts / "task-00001")
    shutil.copytree(tmp_path / "other.parts" / "task-00001", parts / "task-00001")
    shutil.copy(tmp_path / "other.parts" / "task-00001.done.json", parts)
    before = tree(parts)
    err = refused(capsys, *args, "--merge")
    assert "the parts of tasks 1 were made under another plan" in err
    assert tree(parts) == before and not out.exists()


@pytest.mark.parametrize("damage", ["byte", "last byte", "cut", "part.json"])
def test_merge_refuses_a_tampered_part_and_loses_nothing(planned, one_node, capsys, damage):
    """A byte of a part changed at the same size, in its middle or its last byte (found by its
    xxh3-128 while copying), a part
    cut short (found by its size before writing), its part.json edited (the marker's sha256):
    refused, naming the file and the task to run again; an earlier --out, made by one node, is
    left as it was, and no partial directory stays."""
    args, out, parts = planned
    shutil.copytree(one_node, out)  # what one node made of the same inputs and flags
    earlier = tree(out)
    part = json.loads((parts / "task-00001" / "part.json").read_text())
    (piece,) = [p for p in part["pieces"]["train"].values() if p["tokens"]][:1]
    shard = parts / "task-00001" / "train" / piece["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    if damage in ("byte", "last byte"):
        data[len(data) // 2 if damage == "byte" else -1] ^= 1
        shard.write_bytes(bytes(data))
    elif damage == "cut":
        shard.write_bytes(bytes(data[:-2]))
    else:
        path = parts / "task-00001" / "part.json"
        path.write_text(path.read_text().replace('"skipped": 0', '"skipped": 1'))
    before = tree(parts)
    err = refused(capsys, *args, "--force", "--merge")
    assert "task 1's part changed after the task wrote it" in err
    assert str(parts / "task-00001.done.json") in err and "--task 1" in err
    assert "Nothing was written to --out; the parts are kept" in err
    assert tree(out) == earlier and tree(parts) == before
    assert not list(out.parent.glob("data.partial-*"))
    what = {
        "byte": "differ from the xxh3-128 in part.json",
        "last byte": "differ from the xxh3-128 in part.json",
        "cut": "bytes, not",
        "part.json": "its sha256 differs from the marker's",
    }[damage]
    assert what in err


def test_steps_with_other_flags_are_refused_and_force_replaces_only_the_parts(
    planned, corpus, capsys, monkeypatch
):
    """A task, or the merge, given other flags than the plan's, or run from another working
    directory: refused, naming each flag and the plan's value; the plan step again with other
    flags: refused, and with --force it replaces the parts directory (which it made) and nothing
    else."""
    args, out, parts = planned
    before = tree(parts)
    with monkeypatch.context() as m:
        m.chdir(corpus)
        err = refused(capsys, *args, "--task", "0")
        assert f"this command runs in {os.path.realpath(corpus)}" in err
        assert "Run every step from the plan's working directory" in err
    err = refused(capsys, *args, "--seed", "7", "--task", "0")
    assert "--seed 7 (the plan: 0)" in err and "Nothing was written" in err
    err = refused(capsys, *args, "--val-fraction", "0.1", "--merge")
    assert "--val-fraction 0.1 (the plan: 0.02)" in err
    err = refused(capsys, *args[:-2], "--tasks", "4", "--task", "0")
    assert "--tasks 4 (the plan: 3)" in err
    err = refused(capsys, *args, "--vocab-size", "600")
    assert "--vocab-size 600 (the plan: 500)" in err
    assert tree(parts) == before
    # The plan step again with the same flags keeps the plan and the tasks' parts.
    assert main(["data", "prepare", *args]) == 0
    assert tree(parts) == before
    # With --force and other flags, the parts directory is replaced; a stranger's is not.
    assert main(["data", "prepare", *args, "--vocab-size", "600", "--force"]) == 0
    assert not (parts / "task-00000.done.json").exists()
    stranger = out.with_name("s.parts")
    stranger.mkdir()
    (stranger / "keep.txt").write_text("mine")
    err = refused(
        capsys, *inputs(corpus), *FLAGS, "--out", str(out.with_name("s")), "--tasks", "2", "--force"
    )
    assert "not made by `anneal data prepare --tasks`" in err
    assert (stranger / "keep.txt").read_text() == "mine"


def test_a_plan_step_that_fails_leaves_nothing(corpus, tmp_path, capsys):
    """A hub dataset (refused before anything is written: it cannot be split) and a tokenizer
    that cannot be trained (refused after the parts directory was made): no OUT.parts is left;
    a parts directory that was there before (submit-prepare's logs) stays."""
    out = tmp_path / "data"
    err = refused(capsys, "--input", "hf:someone/corpus", "--out", str(out), "--tasks", "2")
    assert "save_to_disk" in err and "cannot be split into tasks" in err
    args = [*inputs(corpus), "--vocab-size", "260", "--out", str(out), "--tasks", "2"]
    err = refused(capsys, *args)
    assert "--vocab-size" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    logs = tmp_path / "data.parts" / "slurm" / "logs"
    logs.mkdir(parents=True)
    (tmp_path / "data.parts" / ".anneal-prepare-parts").write_text("")
    refused(capsys, *args)
    assert logs.is_dir() and not (tmp_path / "data.parts" / "tokenizer").exists()


def test_an_input_changed_since_the_plan_is_refused(planned, corpus, capsys):
    """An input file that grew after the plan: the next task refuses, naming it."""
    args, out, parts = planned
    web = corpus / "web.jsonl"
    text, was = web.read_text(), web.stat()
    try:
        web.write_text(text + json.dumps({"text": "one more"}) + "\n")
        err = refused(capsys, *args, "--task", "0")
        assert f"{web} changed" in err and "since the plan" in err
    finally:  # as the plan saw it (its size and mtime), for the module's other tests
        web.write_text(text)
        os.utime(web, ns=(was.st_atime_ns, was.st_mtime_ns))


@pytest.mark.parametrize("edit", ["overlap", "gap", "short", "count", "not units"])
def test_a_plan_whose_ranges_do_not_cut_the_units_once_is_refused(planned, capsys, edit):
    """plan.json's ``ranges`` edited (issue 41, point 8): task 1's range moved one unit into
    task 0's (on 7ec025f that plan was accepted: the merge counted those units' input bytes
    twice), or one unit past its end, the last range ending short, a range missing, a range
    that is no pair of unit indices. A task and the merge refuse, naming plan.json and the
    ranges; the parts and --out stay as they were."""
    args, out, parts = planned
    path = parts / "plan.json"
    plan = json.loads(path.read_text())
    r = plan["ranges"]
    assert r[0][0] == 0 and 1 <= r[1][0] < r[1][1]
    was = [list(x) for x in r]
    words = {
        "overlap": f"task 1's units [{r[1][0] - 1}, {r[1][1]}] overlaps task 0's {r[0]}",
        "gap": f"task 1's units [{r[1][0] + 1}, {r[1][1]}] leaves a gap after task 0's {r[0]}",
        "short": f"the ranges end at unit {r[2][1] - 1}, and the inputs cut into {r[2][1]} units",
        "count": f"it holds {json.dumps(r[:2])} for 3 tasks",
        "not units": 'task 1\'s range [1, "9"] is no [start, end) of units',
    }[edit]
    if edit in ("overlap", "gap"):
        r[1][0] += -1 if edit == "overlap" else 1
    elif edit == "short":
        r[2][1] -= 1
    elif edit == "count":
        del r[2]
    else:
        r[1] = [1, "9"]
    path.write_text(json.dumps(plan, indent=1) + "\n")
    before = tree(parts)
    for step in (["--task", "1"], ["--merge"]):
        err = refused(capsys, *args, *step)
        assert f"{path}: its task ranges are not the plan step's: {words}." in err, (err, was)
        assert "the plan step with --force replaces" in err
    assert tree(parts) == before and not out.exists()


def test_a_task_that_died_leaves_nothing_complete_and_runs_again(planned, capsys, monkeypatch):
    """A task killed after renaming its part but before its marker, and one killed while
    packing (its partial directory, its process gone): the merge counts it missing; the next run
    of the task removes both and completes; a task that raises removes its partial itself."""
    args, out, parts = planned
    import socket

    import anneal.data.part as part_module

    (parts / "task-00001.done.json").unlink()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    leftover = parts / f"task-00001.partial-{part_module._host()}-{dead}"
    leftover.mkdir()
    (leftover / part_module.TASK_MARKER).write_text("")
    err = refused(capsys, *args, "--merge")
    assert "1 of 3 tasks have no completion marker: 1 (1 started and did not finish)" in err

    def dies(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(part_module, "pack_units", dies)
    with pytest.raises(KeyboardInterrupt):
        main(["data", "prepare", *args, "--task", "1"])
    assert not (parts / "task-00001").exists() and not leftover.exists()
    assert [p.name for p in parts.glob("task-00001*")] == []
    monkeypatch.undo()
    assert main(["data", "prepare", *args, "--task", "1"]) == 0
    assert json.loads((parts / "task-00001.done.json").read_text())["host"] == socket.gethostname()
    assert main(["data", "prepare", *args, "--merge"]) == 0


HELD = """
import pathlib, sys, time
import anneal.data.part as part
real, go = part.pack_units, pathlib.Path(sys.argv[1])
def waits(*args, **kwargs):  # holds task 1 (its lock taken) until the test says go
    (go.parent / "packing").touch()
    deadline = time.time() + 60
    while not go.exists() and time.time() < deadline:
        time.sleep(0.02)
    return real(*args, **kwargs)
part.pack_units = waits
from anneal.cli import main
sys.exit(main(["data", "prepare", *sys.argv[2:]]))
"""


def test_a_second_process_on_a_running_task_is_refused_and_the_first_finishes(
    planned, capsys, tmp_path
):
    """Task 1 run by a process held while it packs (its lock taken), and meanwhile by this
    one (issue 41, point 8; on 7ec025f this one packed and won, and the first died on an
    OSError traceback at its rename): this one exits 2 with one paragraph naming the holder's
    pid, and leaves no file; the first then completes, its part and marker whole (the marker's
    sha256 of part.json), and the merge takes it. About 4 s (a second Python process)."""
    args, out, parts = planned
    (parts / "task-00001.done.json").unlink()
    shutil.rmtree(parts / "task-00001")
    go = tmp_path / "go"
    first = subprocess.Popen(
        [sys.executable, "-c", HELD, str(go), *args, "--task", "1"],
        cwd=os.getcwd(),
        env={**env(), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while not (tmp_path / "packing").exists() and first.poll() is None:
            assert time.time() < deadline, "the first process never reached packing"
            time.sleep(0.02)
        assert first.poll() is None, first.communicate()
        before = tree(parts)
        err = refused(capsys, *args, "--task", "1")
        assert "task 1 is being run by another process now" in err
        assert f"pid {first.pid}" in err and "Nothing was written" in err
        assert tree(parts) == before
    finally:
        go.touch()
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    done = json.loads((parts / "task-00001.done.json").read_text())
    part = parts / "task-00001" / "part.json"
    assert hashlib.sha256(part.read_bytes()).hexdigest() == done["part_sha256"]
    assert not list(parts.glob("task-00001.partial-*"))
    assert main(["data", "prepare", *args, "--merge"]) == 0


# ---------------------------------------------------------------------------------------------
# Slurm: the three batch scripts (the real cluster: tests/launcher/test_data_scale_slurm.py)


def submit_prepare(capsys, *args: str) -> tuple[int, str, str]:
    from launcher.__main__ import main as launcher_main

    capsys.readouterr()
    code = launcher_main(["submit-prepare", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


JOB = ["--tasks", "3", "--partition", "debug", "--time", "00:30:00"]


def test_submit_prepare_dry_run_shows_three_chained_steps(corpus, tmp_path, capsys):
    """--dry-run prints the plan, array and merge scripts (valid bash), each running `anneal
    data prepare` with the given flags and --tasks plus its step's; nothing is written."""
    out = tmp_path / "data"
    flags = [*inputs(corpus), *FLAGS, "--out", str(out)]
    code, printed, err = submit_prepare(capsys, *JOB, "--nodes", "2", "--dry-run", "--", *flags)
    assert code == 0, err
    assert printed.startswith("3 of 3 tasks to run: plan, tasks, merge")
    scripts = printed.split("# ")[1:]
    names = [s.split(" would hold:")[0] for s in scripts if "would hold" in s]
    assert names == [
        str(out.with_name("data.parts") / "slurm" / f"{s}.sbatch")
        for s in ("plan", "tasks", "merge")
    ]
    command = "data prepare " + " ".join(flags) + " --tasks 3"
    assert command + "\n" in printed
    assert command + ' --task "$SLURM_ARRAY_TASK_ID"\n' in printed
    assert command + " --merge\n" in printed
    assert printed.count("#SBATCH --kill-on-invalid-dep=yes") == 2  # the array and the merge
    assert "# the array: --array=0-2%2" in printed
    for text in printed.split("# /")[1:]:
        body = text.split("would hold:\n", 1)[1]
        subprocess.run(["bash", "-n"], input=body, text=True, check=True)
    assert not out.with_name("data.parts").exists() and not out.exists()


def test_submit_prepare_again_submits_only_what_is_left(planned, capsys):
    """With the plan there and tasks 0 and 2 complete: no plan job, an array of task 1 only;
    with other flags: the steps' own refusal."""
    args, out, parts = planned
    (parts / "task-00001.done.json").unlink()
    flags = [a for a in args if a not in ("--tasks", "3")]
    code, printed, err = submit_prepare(capsys, *JOB, "--dry-run", "--", *flags)
    assert code == 0, err
    assert printed.startswith(f"1 of 3 tasks to run (the plan in {parts} is kept): tasks, merge")
    assert "--array=1\n" in printed and "plan.sbatch" not in printed
    code, printed, err = submit_prepare(capsys, *JOB, "--dry-run", "--", *flags, "--seed", "3")
    assert code == 2 and "--seed 3 (the plan: 0)" in err


def test_the_scripts_carry_the_flags_exactly_and_refuse_injection(tmp_path):
    """A flag with spaces, quotes and `$(...)` reaches the command as one argument, never run;
    the task id comes from Slurm's variable; control characters, Slurm's own syntax in the logs'
    path, and unsafe job values are refused, one paragraph each."""
    from launcher import slurm

    argv = tmp_path / "argv.sh"
    argv.write_text('#!/bin/sh\nfor a in "$@"; do printf "[%s]\\n" "$a"; done\n')
    argv.chmod(0o755)
    odd = "/data/my corpus/it's $(touch pwned) `id`.jsonl"
    kw = dict(
        job_name="p",
        tasks=4,
        partition="debug",
        time="01:00:00",
        account=None,
        logs=tmp_path / "d.parts" / "slurm" / "logs",
        workdir=tmp_path,
        python=str(argv),
        prepare_args=["--input", odd, "--out", "d"],
    )
    text = slurm.render_prepare(step="tasks", **kw)
    done = subprocess.run(
        ["bash", "-c", text],
        capture_output=True,
        text=True,
        env={"SLURM_ARRAY_TASK_ID": "2", "SLURM_JOB_ID": "9", "PATH": os.environ["PATH"]},
    )
    assert done.stdout.splitlines()[1:] == [
        f"[{a}]"
        for a in [
            "-m",
            "anneal.cli",
            "data",
            "prepare",
            "--input",
            odd,
            "--out",
            "d",
            "--tasks",
            "4",
            "--task",
            "2",
        ]
    ], done.stdout + done.stderr
    assert not (tmp_path / "pwned").exists()
    bad = [
        (dict(prepare_args=["--input", "a\ntouch /tmp/x"]), "prepare flag"),
        (dict(logs=Path("/d%j.parts/slurm/logs")), "holds '%'"),
        (dict(logs=Path('/d".parts/slurm/logs')), "holds '\"'"),
        (dict(workdir=Path("/w\n#SBATCH --x")), "the working directory"),
        (dict(python="/py\rthon"), "the Python"),
        (dict(partition="a;b"), "--partition"),
        (dict(time="1:00:00; id"), "--time"),
        (dict(account="a b"), "--account"),
    ]
    for change, match in bad:
        with pytest.raises(UserError) as e:
            slurm.render_prepare(step="plan", **{**kw, **change})
        assert match in str(e.value) and "\n" not in str(e.value), e.value


def test_the_plan_says_the_node_hours_of_preparation(capsys):
    """`anneal plan` gives the node-hours of preparing its tokens: D / (measured tokens per
    second per core x 128 cores) / 3600, in its JSON and on its data line."""
    from anneal import planning
    from anneal.planning.planner import PREPARE_NODE_CORES, PREPARE_TOKENS_PER_CORE_S

    p = planning.plan(tokens=15e12)
    want = 15e12 / (PREPARE_TOKENS_PER_CORE_S * PREPARE_NODE_CORES) / 3600
    assert p.prepare_node_hours == pytest.approx(want, rel=1e-12)
    assert p.to_dict()["prepare_node_hours"] == p.prepare_node_hours
    line = next(x for x in planning.format_plan(p).splitlines() if "data prep" in x)
    assert (
        f"{want:,.0f} node-hours" in line and f"{PREPARE_TOKENS_PER_CORE_S:,.0f} tokens/s" in line
    )
