"""tests/scripts/ranks.py, which starts the training drills' ranks (``tests.conftest.launch``):
each rank gets the environment DeepSpeed's launcher gives it, a failing rank's status comes
back and the other ranks are stopped, and the ranks stay in the caller's session, so that
killing that session (a test's timeout, the crash drill) kills them all; each of these both
ways it starts a rank (forked after the shared imports, the default, and ``--exec``). A forked
rank runs its script as a new interpreter would: its own ``sys.argv``, ``sys.path[0]``,
``__main__``, seeds and exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, launch, run_process

RANK = """
import json, os, sys, time
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
with open(f"{out}.{rank}.tmp", "w") as f:
    json.dump({**{k: os.environ.get(k) for k in keys}, "pid": os.getpid(), "sid": os.getsid(0)}, f)
os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}")
if mode == "fail" and rank == 1:
    while not os.path.exists(f"{out}.0"):
        time.sleep(0.01)
    sys.exit(3)
if mode != "ok":
    time.sleep(60)
"""


# forked with nothing to import first (the scripts here import no torch), and as new interpreters
MODES = pytest.mark.parametrize("mode", [["--preload="], ["--exec"]], ids=["fork", "exec"])


def _script(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return script


def _launch(mode, *command):
    cmd = launch(2, *command)
    return [*cmd[:2], *mode, *cmd[2:]]


@MODES
def test_each_rank_gets_the_launchers_environment(tmp_path, mode):
    out = tmp_path / "env"
    done = run_process(_launch(mode, str(_script(tmp_path)), str(out), "ok"), timeout_s=60)
    assert done.returncode == 0, done.stderr
    seen = [json.loads((tmp_path / f"env.{r}").read_text()) for r in (0, 1)]
    for r, e in enumerate(seen):
        assert (e["RANK"], e["LOCAL_RANK"], e["CROSS_RANK"]) == (str(r), str(r), "0")
        assert (e["WORLD_SIZE"], e["LOCAL_SIZE"], e["CROSS_SIZE"]) == ("2", "2", "1")
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["OMP_NUM_THREADS"] == "1"
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"] and seen[0]["MASTER_PORT"].isdigit()


@MODES
def test_a_failing_rank_stops_the_others_and_its_status_comes_back(tmp_path, mode):
    out = tmp_path / "env"
    done = run_process(_launch(mode, str(_script(tmp_path)), str(out), "fail"), timeout_s=60)
    assert done.returncode == 3
    # from rank 0's start (after the shared imports): it got SIGTERM, not 10 s of grace or 60 s
    assert time.time() - (tmp_path / "env.0").stat().st_mtime < 5
    pid = json.loads((tmp_path / "env.0").read_text())["pid"]
    assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z"


@MODES
def test_the_ranks_stay_in_the_callers_session(tmp_path, mode):
    out = tmp_path / "env"
    cmd = _launch(mode, str(_script(tmp_path)), str(out), "hang")
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"env.{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        seen = [json.loads((tmp_path / f"env.{r}").read_text()) for r in (0, 1)]
        assert {e["sid"] for e in seen} == {proc.pid}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for e in seen:
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{e['pid']}") and _state(e["pid"]) != "Z":
            assert time.monotonic() < deadline, f"rank pid {e['pid']} outlived its session"
            time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_usage_is_said_on_bad_arguments():
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/scripts/ranks.py"), "two", "x.py"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (
        done.returncode == 2 and "ranks.py [--exec | --preload=MODULE,...] N SCRIPT" in done.stderr
    )


SCRIPT_VIEW = """
import json, os, random, sys
import torch
from helper import NAME
out = sys.argv[1]
rank = os.environ["RANK"]
view = {"argv": sys.argv, "path0": sys.path[0], "main": __name__, "file": __file__,
        "name": NAME, "random": random.random(), "torch": torch.rand(1).item()}
with open(f"{out}.{rank}", "w") as f:
    json.dump(view, f)
sys.exit(int(rank) and 4)
"""


def test_a_forked_rank_runs_its_script_as_a_new_interpreter_would(tmp_path):
    """Its own argv, sys.path[0] (a module beside the script imports), ``__main__``, unseeded
    random numbers unlike the other rank's, and its status: 4 from rank 1's sys.exit(4)."""
    script = tmp_path / "view.py"
    script.write_text(SCRIPT_VIEW)
    (tmp_path / "helper.py").write_text("NAME = 'beside'\n")
    out = tmp_path / "view"
    cmd = launch(2, str(script), str(out), "x")
    done = run_process([*cmd[:2], "--preload=torch", *cmd[2:]], timeout_s=120)
    assert done.returncode == 4, done.stderr
    seen = [json.loads((tmp_path / f"view.{r}").read_text()) for r in (0, 1)]
    for v in seen:
        assert v["argv"] == [str(script), str(out), "x"] and v["path0"] == str(tmp_path)
        assert (v["main"], v["file"], v["name"]) == ("__main__", str(script), "beside")
    assert seen[0]["random"] != seen[1]["random"] and seen[0]["torch"] != seen[1]["torch"]
