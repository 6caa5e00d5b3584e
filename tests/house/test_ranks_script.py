"""tests/scripts/ranks.py, which starts the training drills' ranks (``tests.conftest.launch``):
each rank gets the environment DeepSpeed's launcher gives it, a failing rank's status comes
back and the other ranks are stopped, and the ranks stay in the caller's session, so that
killing that session (a test's timeout, the crash drill) kills them all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

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


def _script(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return script


def test_each_rank_gets_the_launchers_environment(tmp_path):
    out = tmp_path / "env"
    done = run_process(launch(2, str(_script(tmp_path)), str(out), "ok"), timeout_s=60)
    assert done.returncode == 0, done.stderr
    seen = [json.loads((tmp_path / f"env.{r}").read_text()) for r in (0, 1)]
    for r, e in enumerate(seen):
        assert (e["RANK"], e["LOCAL_RANK"], e["CROSS_RANK"]) == (str(r), str(r), "0")
        assert (e["WORLD_SIZE"], e["LOCAL_SIZE"], e["CROSS_SIZE"]) == ("2", "2", "1")
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["OMP_NUM_THREADS"] == "1"
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"] and seen[0]["MASTER_PORT"].isdigit()


def test_a_failing_rank_stops_the_others_and_its_status_comes_back(tmp_path):
    out = tmp_path / "env"
    started = time.monotonic()
    done = run_process(launch(2, str(_script(tmp_path)), str(out), "fail"), timeout_s=60)
    assert done.returncode == 3
    assert time.monotonic() - started < 5  # rank 0 got SIGTERM, not its 10 s of grace or 60 s
    pid = json.loads((tmp_path / "env.0").read_text())["pid"]
    assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z"


def test_the_ranks_stay_in_the_callers_session(tmp_path):
    out = tmp_path / "env"
    cmd = launch(2, str(_script(tmp_path)), str(out), "hang")
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
    assert done.returncode == 2 and "ranks.py N SCRIPT" in done.stderr
