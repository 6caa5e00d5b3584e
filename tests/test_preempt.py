"""Preemption in one process: a signal sets a flag and nothing else, the stop saves once and
exits 75, and a second signal (SIGUSR1 or SIGTERM) during the save neither interrupts nor
repeats it. The real path across ranks, DeepSpeed's launcher, srun and a requeue is in
tests/test_cluster.py."""

import json
import os
import signal

import pytest
import torch

from anneal.resilience import checkpoint
from anneal.resilience.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption
from anneal.train.observers import Observer


class Events(Observer):
    """The run's observers, as far as preemption tells them: its events, kept."""

    def __init__(self):
        self.rows = []

    def on_event(self, step, event, **fields):
        self.rows.append({"step": step, "event": event, **fields})


def test_second_signal_during_the_save(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    p = Preemption(tmp_path)
    pid_files = list((tmp_path / "preempt").glob("*.pid"))
    assert [f.read_text().strip() for f in pid_files] == [str(os.getpid())]
    assert not p.requested(torch.device("cpu"))
    os.kill(os.getpid(), signal.SIGUSR1)
    assert p.requested(torch.device("cpu"))
    saves = []

    def save():
        os.kill(os.getpid(), signal.SIGUSR1)  # a second and third signal mid-save
        os.kill(os.getpid(), signal.SIGTERM)
        tag = tmp_path / "checkpoints" / checkpoint.tag_for(7)
        tag.mkdir(parents=True)
        (tag / "shard.pt").write_bytes(b"x" * 1000)
        manifest = {"tag": tag.name, "step": 7, "world_size": 1, "files": {"shard.pt": 1000}}
        (tag / checkpoint.MANIFEST).write_text(json.dumps(manifest))
        saves.append(7)

    events = Events()
    with pytest.raises(Preempted) as info:
        p.stop(step=7, ckpt_dir=tmp_path / "checkpoints", save=save, events=events)
    assert info.value.code == PREEMPTED_EXIT_CODE == 75
    assert saves == [7]
    assert checkpoint.is_intact(tmp_path / "checkpoints" / "step00000007")
    (row,) = events.rows
    assert row["event"] == "preempt" and row["signal"] == "SIGUSR1"
    assert row["checkpoint_bytes"] > 1000
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored
    assert not list((tmp_path / "preempt").glob("*.pid"))


def test_no_save_when_the_step_was_just_saved(tmp_path):
    p = Preemption(tmp_path)
    tag = tmp_path / "checkpoints" / checkpoint.tag_for(3)
    tag.mkdir(parents=True)
    (tag / checkpoint.MANIFEST).write_text(json.dumps({"step": 3, "files": {}}))
    with pytest.raises(Preempted):
        p.stop(step=3, ckpt_dir=tmp_path / "checkpoints", save=pytest.fail, events=Events())
