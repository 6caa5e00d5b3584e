"""`make test-all`'s shards (tests/conftest.py ``_shard_of``, run by tests/shards.py): together,
with the tests marked alone, they hold every test once; the fast tests, and the slow ones that
read the shared runs, stay in shard 1 with those runs; the files that drive the local cluster
share a shard; the slow files' weights come out balanced. `make test`'s two sessions of fast
tests split whole files, the readers of the shared runs with them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import (
    DEFAULT_WEIGHT_S,
    FAST_DEFAULT_S,
    FAST_WEIGHTS_S,
    SHARD_TOGETHER,
    SHARD_WEIGHTS_S,
    _shard_of,
)


@dataclass(eq=False)
class Item:  # what _shard_of reads of a pytest item
    path: Path
    slow: bool = False
    fixturenames: list[str] = field(default_factory=list)
    alone: bool = False

    def get_closest_marker(self, name):
        return (
            object() if (name == "slow" and self.slow) or (name == "alone" and self.alone) else None
        )


def suite() -> list[Item]:
    items = [Item(Path(f"tests/test_fast{i}.py")) for i in range(20)]
    for name in SHARD_WEIGHTS_S:
        if name != "<fast>":
            items += [Item(Path("tests") / name, slow=True) for _ in range(2)]
            items.append(Item(Path("tests") / name))  # a fast test in a slow file
    items.append(Item(Path("tests/test_new.py"), slow=True))  # not in the table
    items.append(Item(Path("tests/test_reader.py"), slow=True, fixturenames=["shared_runs"]))
    items.append(Item(Path("tests/test_measures.py"), slow=True, alone=True))
    return items


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_shards_partition_the_suite(n):
    items = suite()
    shards = [_shard_of(items, f"{i}/{n}") for i in range(1, n + 1)]
    alone = _shard_of(items, "alone")
    assert [it.path.name for it in alone] == ["test_measures.py"]
    assert sorted(map(id, sum(shards, alone))) == sorted(map(id, items))
    assert all(it in shards[0] for it in items if not it.slow or it.fixturenames)
    for group in SHARD_TOGETHER:
        homes = {i for i, s in enumerate(shards) for it in s if it.slow and it.path.name in group}
        assert len(homes) == 1, group


@pytest.mark.parametrize("n", [2, 3])  # 3: what `make test-all` runs
def test_the_shards_carry_about_the_same_weight(n):
    shards = [_shard_of(suite(), f"{i}/{n}") for i in range(1, n + 1)]
    loads = [
        sum(
            SHARD_WEIGHTS_S.get(name, DEFAULT_WEIGHT_S)
            for name in {it.path.name for it in s if it.slow}
        )
        for s in shards
    ]
    loads[0] += SHARD_WEIGHTS_S["<fast>"]
    heaviest = max(SHARD_WEIGHTS_S.values())
    assert max(loads) - min(loads) <= heaviest / 2, loads


def test_make_tests_two_sessions_split_the_fast_files_whole_and_about_evenly():
    """`make test` (``-m "not slow"``: no slow test selected): both sessions together hold
    every test once, each file in one session, the readers of the shared runs in the first
    (where those runs train) and the weights about even."""
    items = [Item(Path(f"tests/test_fast{i}.py")) for i in range(40) for _ in range(2)]
    items += [Item(Path("tests") / name) for name in FAST_WEIGHTS_S if name.endswith(".py")]
    items.append(Item(Path("tests/test_fast3.py"), fixturenames=["shared_runs"]))
    shards = [_shard_of(items, f"{i}/2") for i in (1, 2)]
    assert sorted(map(id, sum(shards, []))) == sorted(map(id, items))
    homes = {}
    for i, shard in enumerate(shards):
        for it in shard:
            homes.setdefault(it.path.name, set()).add(i)
    assert all(len(h) == 1 for h in homes.values()) and homes["test_fast3.py"] == {0}
    loads = [FAST_WEIGHTS_S["<shared runs>"], 0.0]
    for i, shard in enumerate(shards):
        loads[i] += sum(
            FAST_WEIGHTS_S.get(f, FAST_DEFAULT_S) for f in {it.path.name for it in shard}
        )
    assert abs(loads[0] - loads[1]) <= max(FAST_WEIGHTS_S.values()) / 2, loads


def test_a_shard_computes_on_one_thread_where_the_shards_fill_the_cores(monkeypatch):
    """OMP_NUM_THREADS=1 for each process of a shard when there are at least as many shards as
    cores (torch's default is every core, in each of them); a value the caller set is kept."""
    from tests.shards import one_thread

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert one_thread(3) == one_thread(2) == {"OMP_NUM_THREADS": "1"}
    assert one_thread(1) == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert one_thread(3) == {}


@pytest.mark.parametrize("spec", ["0/2", "3/2", "1", "a/b"])
def test_a_bad_shard_is_a_usage_error(spec):
    with pytest.raises(pytest.UsageError, match="expected i/n, 1 <= i <= n, or alone"):
        _shard_of(suite(), spec)


@pytest.mark.slow
def test_the_alone_session_collects_only_the_files_that_mark_tests_alone(tmp_path):
    """tests/shards.py's last session: a folder among pytest's arguments becomes the files
    under it that mark a test ``alone``; options and files given stay as they are; and in this
    repository those files hold every test marked alone (pytest's own selection, against a
    collection of the whole suite: a file that marked a test alone some other way would lose it
    silently). Slow (12 s: two collections of the suite), as the part of `make test-all` it
    checks."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.shards import alone_args

    (tmp_path / "sub").mkdir()
    marked = "@pytest.mark." + "alone"  # spelled apart: this file marks no test alone
    (tmp_path / "sub" / "test_a.py").write_text(f"{marked}\ndef test(): pass\n")
    (tmp_path / "test_b.py").write_text("def test(): pass\n")
    args = ["-q", "--durations=10", str(tmp_path), "x/test_c.py"]
    assert alone_args(args) == [
        "-q",
        "--durations=10",
        str(tmp_path / "sub" / "test_a.py"),
        "x/test_c.py",
    ]

    def selected(paths):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-p",
                "no:cacheprovider",
                *paths,
            ],
            cwd=ROOT,
            env={**__import__("os").environ, "ANNEAL_TEST_SHARD": "alone"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        return sorted(line for line in done.stdout.splitlines() if "::" in line)

    files = alone_args(["tests"])
    assert files and selected(files) == selected(["tests"])
