"""``python -m launcher submit-prepare`` on a real two-node Slurm (Debian's slurm-wlm and munge,
the fixture of tests/launcher/test_cluster.py): an array of 4 tasks over mixed inputs (a JSON Lines
file
cut across tasks, a directory of small files, a Parquet file, a weighted blend); one task is
killed while it packs, the merge is then cancelled by Slurm (its dependency can never be met),
and submitting again runs only that task and the merge; the merged tree's sha256 is the one of
a one-node ``anneal data prepare`` of the same inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from anneal.data.prepared_dir import PreparedDir
from tests.conftest import ROOT
from tests.data.test_data_scale import paragraphs
from tests.launcher import test_cluster
from tests.launcher.test_cluster import Slurm, wait_for

pytestmark = pytest.mark.slow
slurm = test_cluster.slurm  # the two-node cluster (a module-scoped fixture)

FLAGS = ["--vocab-size", "500", "--unit-mb", "0.05", "--shard-tokens", "50000", "--quiet"]
SLOW_TASK = """\
import os
if os.environ.get("SLURM_ARRAY_TASK_ID") == os.environ.get("ANNEAL_TEST_SLOW_TASK", "none"):
    import time
    import anneal.data.pack as pack
    _tokenize = pack.tokenize_unit
    def tokenize_unit(unit):
        time.sleep(0.5)  # a task slow enough to be killed while it packs
        return _tokenize(unit)
    tokenize_unit.__module__, tokenize_unit.__qualname__ = "anneal.data.pack", "tokenize_unit"
    pack.tokenize_unit = tokenize_unit
"""


def make_corpus(root: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    with open(root / "web.jsonl", "w") as f:
        for package in ("json", "email", "xml/dom", "unittest"):
            for text in paragraphs(package):
                f.write(json.dumps({"text": text}) + "\n")
    (root / "notes").mkdir()
    for i, text in enumerate(paragraphs("logging")[:40]):
        (root / "notes" / f"{i:03d}.txt").write_text(text)
    pq.write_table(pa.table({"text": paragraphs("http")}), root / "books.parquet")
    return [
        "--input",
        f"{root / 'web.jsonl'}:0.6",
        "--input",
        f"{root / 'notes'}:0.1",
        "--input",
        f"{root / 'books.parquet'}:0.3",
    ]


def submit(slurm: Slurm, flags: list[str], cwd: Path, extra_env: dict) -> str:
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "submit-prepare",
        "--tasks",
        "4",
        "--partition",
        "debug",
        "--time",
        "00:10:00",
        "--",
        *flags,
    ]
    done = subprocess.run(
        cmd, cwd=cwd, env={**slurm.env, **extra_env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def job_of(printed: str, step: str) -> str:
    return printed.split(f"submitted {step}: job ")[1].split()[0]


def logs(parts: Path) -> str:
    return "\n".join(
        f"== {p.name}\n{p.read_text()[-1500:]}"
        for p in sorted((parts / "slurm" / "logs").glob("*"))
    )


def test_a_killed_task_reruns_alone_and_the_merge_is_the_one_node_tree(slurm, tmp_path):
    """About 20 s here (a real cluster is the point): a one-node reference, the plan, 4 tasks
    on 2 nodes (two at a time), one killed and run again, the merge."""
    flags = [*make_corpus(tmp_path / "corpus"), *FLAGS]
    ref = tmp_path / "one"
    done = subprocess.run(
        [sys.executable, "-m", "anneal.cli", "data", "prepare", *flags, "--out", str(ref)],
        cwd=tmp_path,
        env={**slurm.env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_TASK)
    out, parts = tmp_path / "data", tmp_path / "data.parts"
    flags += ["--out", str(out)]
    slow = {"PYTHONPATH": f"{hooks}:{ROOT}", "ANNEAL_TEST_SLOW_TASK": "3"}
    first = submit(slurm, flags, tmp_path, slow)
    array, merge = job_of(first, "tasks"), job_of(first, "merge")
    assert "4 of 4 tasks to run: plan, tasks, merge" in first

    def packing() -> bool:
        state = slurm.job(f"{array}_3").get("JobState")
        assert state in (None, "PENDING", "RUNNING"), state + logs(parts)
        return bool(list(parts.glob("task-00003.partial-*")))

    wait_for(packing, timeout_s=240, what="task 3 packing", on_timeout=lambda: logs(parts))
    slurm("scancel", f"{array}_3")
    for t in range(3):
        wait_for(
            lambda t=t: (parts / f"task-{t:05d}.done.json").is_file(),
            timeout_s=240,
            what=f"task {t}",
            on_timeout=lambda: logs(parts),
        )
    wait_for(
        lambda: slurm.job(merge).get("JobState") in ("CANCELLED", None),
        timeout_s=120,
        what="the merge cancelled (its dependency failed)",
    )
    assert not (parts / "task-00003.done.json").exists() and not out.exists()
    assert list(parts.glob("task-00003.partial-*"))  # what the kill left, nothing complete
    markers = {t: json.loads((parts / f"task-{t:05d}.done.json").read_text()) for t in range(3)}

    again = submit(slurm, flags, tmp_path, {"PYTHONPATH": str(ROOT)})
    assert f"1 of 4 tasks to run (the plan in {parts} is kept): tasks, merge" in again
    assert "(--array=3)" in again and "submitted plan" not in again
    merge2 = job_of(again, "merge")
    wait_for(
        lambda: slurm.job(merge2).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"),
        timeout_s=300,
        what="the second merge",
        on_timeout=lambda: logs(parts),
    )
    assert slurm.job(merge2)["JobState"] == "COMPLETED", logs(parts)
    task_logs = sorted(p.name for p in (parts / "slurm" / "logs").glob("task-*"))
    assert [n for n in task_logs if n.startswith("task-3-")] and len(task_logs) == 5, task_logs
    made = json.loads((out / "provenance.json").read_text())
    assert made["tasks"][:3] == [{k: m[k] for k in made["tasks"][0]} for m in markers.values()]
    assert PreparedDir(out).content_sha256() == PreparedDir(ref).content_sha256()
    merge_log = next((parts / "slurm" / "logs").glob(f"merge-{merge2}.out")).read_text()
    assert f"content sha256 {PreparedDir(ref).content_sha256()}" in merge_log
    print(f"merged tree sha256 {made['content_sha256']} = one node's")
