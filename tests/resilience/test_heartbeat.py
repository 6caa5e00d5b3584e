"""The heartbeat's judgement without a distributed run (two ranks' heartbeats in one process):
a peer that finished is not reported; a peer that failed, or whose process is gone, is named
with its host and last step; a file left by an earlier launch is ignored; a communication error
waits for the evidence, any other error does not. Steps do not write: only the thread's beat
does, once per interval, so the write rate per rank does not grow with the step rate."""

import json
import os
import subprocess
import sys

import pytest

from anneal.resilience import heartbeat


@pytest.fixture
def beats(tmp_path, monkeypatch):
    monkeypatch.setattr(heartbeat, "_launch_id", lambda: "launch-1")
    exits = []
    monkeypatch.setattr(heartbeat.Heartbeat, "_exit", lambda self, gone: exits.append(gone))
    made = [heartbeat.Heartbeat(tmp_path, rank=r, world_size=2, timeout_s=60) for r in (0, 1)]
    yield made
    for b in made:
        b.close()


def test_done_is_quiet_and_failed_is_named(beats):
    b0, b1 = beats
    b0.completed(7)
    b1.completed(6)
    assert b0.silent() == []
    b1.close()  # finished
    assert b0.silent() == []
    b1.status = "running"
    b1.failed(ValueError("a bug"))  # not a communication error: returns at once
    [gone] = b0.silent()
    assert gone["rank"] == 1 and gone["step"] == 6 and "failed" in gone["why"]
    report = b0.report([gone])
    assert f"rank 1 on {b1.host} went silent" in report
    assert "Last step completed by each rank: rank 0: 7, rank 1: 6" in report


def test_a_dead_process_is_named_and_old_launches_ignored(beats, tmp_path):
    b0, b1 = beats
    b1.close()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    doc = {
        "rank": 1,
        "host": b0.host,
        "pid": int(dead),
        "beat": 9,
        "step": 3,
        "status": "running",
        "launch": "launch-0",
    }
    (tmp_path / "heartbeat" / "rank1.json").write_text(json.dumps(doc))
    assert b0.silent() == []  # an earlier launch's file
    doc["launch"], doc["status"] = "launch-1", "done"
    (tmp_path / "heartbeat" / "rank1.json").write_text(json.dumps(doc))
    assert b0.silent() == []  # finished, then exited
    doc["status"] = "running"
    (tmp_path / "heartbeat" / "rank1.json").write_text(json.dumps(doc))
    [gone] = b0.silent()
    assert gone["why"] == f"its process {dead} is gone" and gone["step"] == 3
    assert os.getpid() != int(dead)


def test_communication_errors_are_recognised():
    assert heartbeat._is_comm_error(RuntimeError("Connection closed by peer [127.0.0.1]:123"))
    assert not heartbeat._is_comm_error(ValueError("shapes do not match"))


def test_steps_are_written_with_the_next_beat_not_each(beats, tmp_path):
    b0, _ = beats
    b0._stop.set()  # no beat during the test: what is written, is written by completed()
    b0._thread.join()
    path = tmp_path / "heartbeat" / "rank0.json"
    before = json.loads(path.read_text())
    for step in range(1, 101):
        b0.completed(step)
    assert json.loads(path.read_text()) == before  # 100 steps, no write
    b0._write()  # what the thread does at each beat
    after = json.loads(path.read_text())
    assert after["step"] == 100 and after["beat"] == before["beat"] + 1
