"""Asynchronous saves (``train.async_save``) on the real engine, in this process (one rank,
gloo, fp32 on CPU), at ZeRO-1, 2 and 3: a save taken while the training goes on writes exactly
the files a synchronous save of the same step writes (the same names, every tensor and value
equal), although the live state moved on two steps while its write was in flight; until every
file is written the tag is no checkpoint (no manifest, not intact, not ``latest``), and the
commit comes with its manifest verified; a resume from it continues with the very loss a resume
from the synchronous save gives. At ZeRO-2: a second save waits for the one in flight and says
so, keep-K prunes only after the new checkpoint is committed, and a write that fails (ENOSPC
from the fault hook, as on a full disk) leaves the previous checkpoint intact, removes the
uncommitted tag and stops with one paragraph that names the rank, the file and the error.
Three engines are built here (about 5 s each on 2 cores), cheaper than launches."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch

from anneal.errors import UserError
from anneal.resilience import checkpoint
from anneal.resilience.background_save import AsyncSaves
from anneal.resilience.faults import Fault, Faults
from tests.conftest import SMALL, resolve_tiny, sets

_ENGINES: dict[int, tuple] = {}


@pytest.fixture(scope="module")
def engine_of(tiny_data, tmp_path_factory, world_of_one):
    """``engine_of(stage)``: the tiny SMALL engine at that ZeRO stage, built once."""
    from anneal.train.engine import build_engine

    def build(stage: int):
        if stage not in _ENGINES:
            out = tmp_path_factory.mktemp(f"async-{stage}") / "run"
            args = [*("--out", str(out), "--data", str(tiny_data), "--max-steps", "10"), *SMALL]
            launch = resolve_tiny(
                [*args, *sets(f"ds.zero_optimization.stage={stage}")], world_size=1
            )
            _ENGINES[stage] = build_engine(launch)
        return _ENGINES[stage]

    yield build
    _ENGINES.clear()


def _train(engine, steps: int, *, seed: int, before_backward=lambda: None) -> list[float]:
    """``steps`` optimizer steps on random tokens; each micro-batch's loss. ``before_backward``
    is called after each forward."""
    from anneal.train.loss import next_token_loss, targets
    from anneal.train.step import model_inputs

    g, losses = torch.Generator().manual_seed(seed), []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 64), generator=g)
        inputs, y = model_inputs(engine, x[:, :-1], x[:, 1:], None)
        with targets(engine.module, y):
            loss = next_token_loss(engine(**inputs).logits, y)
        before_backward()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _client(step: int) -> dict:
    return {"step": step, "tokens": step * 1000, "data": {"position": step}, "zero_stage": None}


def _same(a, b, where: str) -> None:
    """Bitwise equal nested states (tensors by value, dtype and shape)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b or repr(a) == repr(b), where


def _slow(s: float) -> Faults:
    return Faults([Fault("save_slow", s=s)], rank=0)


class _Held:
    """A fault hook that holds a background write before its second file until ``release``, and
    for at least ``s`` seconds: the write is in flight for as long as the test needs, however
    slow the training beside it (a fixed sleep of 1 s ran out under load, before the test
    looked). With ``copy_s``, it holds the host copy of a CPU snapshot until the training's
    first forward after the save is done (``forward_done``), then ``copy_s`` seconds more, the
    time of many of this engine's steps: the backward that comes next would change the state
    before it is copied, but for the fence on the engine (a fixed hold of 0.4 s from the save
    ran out under load before the first backward came, and the fence had little to wait for)."""

    def __init__(self, s: float, copy_s: float = 0.0):
        self.s, self.copy_s, self.release = s, copy_s, threading.Event()
        self.forward_done = threading.Event()

    def before_snapshot_copy(self, step: int) -> None:
        if self.copy_s:
            assert self.forward_done.wait(120), "the test never trained after the save"
            time.sleep(self.copy_s)

    def before_save_write(self, step: int, index: int) -> None:
        if index == 1:
            start = time.monotonic()
            assert self.release.wait(120), "the test never released the write"
            time.sleep(max(0.0, self.s - (time.monotonic() - start)))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_async_save_writes_the_state_of_its_step_and_resumes_as_the_sync_one(
    stage, engine_of, tmp_path
):
    engine = engine_of(stage)
    _train(engine, 2, seed=0)
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    checkpoint.save(engine, sync_dir, step=2, client_state=_client(2), keep_last=3)
    commits = []

    def on_commit(tag_dir, step, times):
        commits.append((tag_dir, step, checkpoint.is_intact(tag_dir), times.write_s > 0.5))

    held = _Held(0.6, copy_s=0.4)
    saves = AsyncSaves(
        engine, async_dir, keep_last=3, keep_every=0, on_commit=on_commit, fault=held
    )
    tag = saves.save(step=2, client_state=_client(2))
    assert saves.in_flight.times.blocking_s < 0.4  # the copy is not waited for here
    # the state moves on while the write is in flight, but the first backward waits for the copy
    never_stopped = _train(engine, 2, seed=1, before_backward=held.forward_done.set)
    assert saves.in_flight.times.blocking_s >= 0.35
    saves.poll()  # its write is held after the first file: not committed yet
    assert saves.in_flight is not None and not commits
    assert checkpoint.read_manifest(tag) is None and checkpoint.intact_checkpoints(async_dir) == []
    assert not (async_dir / "latest").exists()
    held.release.set()
    saves.finish()
    assert commits == [(tag, 2, True, True)]
    assert (async_dir / "latest").read_text() == tag.name
    assert checkpoint.verify(tag) == []

    names = sorted(checkpoint.read_manifest(tag)["files"])
    assert names == sorted(checkpoint.read_manifest(sync_dir / tag.name)["files"])
    assert len(names) >= 2
    for name in names:
        if name.endswith(".pt"):
            _same(
                torch.load(sync_dir / tag.name / name, weights_only=False),
                torch.load(tag / name, weights_only=False),
                name,
            )

    after = {}
    for source in (sync_dir, async_dir):
        checkpoint.load(engine, source / tag.name, ckpt_dir=source, zero_stage=stage)
        after[source.name] = _train(engine, 2, seed=1)
    assert after["async"] == after["sync"] == never_stopped  # bitwise, the steps after the save


def test_one_save_in_flight_pruning_after_commit_and_a_failed_write(engine_of, tmp_path, caplog):
    engine = engine_of(2)
    ckpt = tmp_path / "checkpoints"
    committed = []
    saves = AsyncSaves(
        engine,
        ckpt,
        keep_last=1,
        keep_every=0,
        on_commit=lambda tag_dir, step, times: committed.append(step),
        fault=_slow(1.0),
    )
    saves.save(step=1, client_state=_client(1))
    saves.finish()
    assert committed == [1]
    saves.save(step=2, client_state=_client(2))
    assert checkpoint.intact_checkpoints(ckpt) == [ckpt / "step00000001"]  # kept until 2 commits
    with caplog.at_level(logging.WARNING, logger="anneal.resilience.background_save"):
        saves.save(step=3, client_state=_client(3))  # waits for step 2's write
    assert "the background write of step 2 is still in progress; waiting for it" in caplog.text
    assert committed == [1, 2]
    assert checkpoint.intact_checkpoints(ckpt) == [ckpt / "step00000002"]  # 1 pruned after 2
    assert saves.in_flight.times.waited_s > 0.3

    saves.fault = Faults([Fault("save_fail", step=4)], rank=0)
    saves.finish()
    saves.save(step=4, client_state=_client(4))
    with pytest.raises(UserError) as failed:
        saves.finish()
    message = str(failed.value)
    tag4 = ckpt / "step00000004"
    assert failed.value.every_rank
    assert f"the asynchronous save of step 4 ({tag4}) failed in its background write" in message
    assert f"rank 0: {tag4}/" in message and "No space left on device" in message
    assert f"the previous checkpoint, {ckpt / 'step00000003'}, is intact" in message
    assert not tag4.exists()
    assert checkpoint.intact_checkpoints(ckpt) == [ckpt / "step00000003"]
    assert checkpoint.verify(ckpt / "step00000003") == []
    assert (ckpt / "latest").read_text() == "step00000003"


def test_the_report_shows_what_saves_cost_and_a_save_that_waited():
    from anneal.observe.report import PROBLEM, saves_signal

    def save(step, blocking_s, **more):
        return {
            "kind": "event",
            "event": "checkpoint",
            "step": step,
            "blocking_s": blocking_s,
            **more,
        }

    assert saves_signal([{"kind": "event", "event": "checkpoint", "step": 1}]) == []
    [sync] = saves_signal([save(1, 3.0, asynchronous=False), save(2, 5.0, asynchronous=False)])
    assert sync.status == "healthy"
    assert sync.detail == "2 save(s); the loop waited 5.00 s (median, max 5.00 s), synchronous"
    rows = [
        save(2, 0.2, asynchronous=True, write_s=6.0, waited_s=0.0),
        save(4, 0.3, asynchronous=True, write_s=7.0, waited_s=0.0),
        save(6, 4.0, asynchronous=True, write_s=8.0, waited_s=3.5),
    ]
    [fine] = saves_signal(rows[:2])
    assert fine.status == "healthy" and fine.detail == (
        "2 save(s); the loop waited 0.30 s (median, max 0.30 s); written behind the training in "
        "7.00 s (median)"
    )
    [waited] = saves_signal(rows)
    assert waited.status == PROBLEM and "the saves of steps [6] waited" in waited.detail


def test_the_host_copy_is_pinned_on_a_gpu_and_reused_from_save_to_save(tmp_path):
    """On a CUDA engine the snapshot's buffers are page-locked (resolved here without a GPU);
    a second copy of a state of the same shapes goes to the same buffers, and what the copy
    holds does not move with the live state."""
    from anneal.resilience.snapshot import HostBuffers, host_copy

    class OnGpu:
        device = torch.device("cuda", 0)

    saves = AsyncSaves(OnGpu(), tmp_path, keep_last=1, keep_every=0, on_commit=print)
    assert saves.buffers.pinned
    buffers = HostBuffers(pinned=False)
    live = {"w": torch.arange(6.0).view(2, 3)[:, 1], "steps": [1, (2, torch.ones(2))]}
    first = host_copy(live, buffers)
    live["w"].add_(10)
    assert first["w"].tolist() == [1.0, 4.0] and first["steps"][1][0] == 2
    held = buffers.nbytes
    buffers.restart()
    second = host_copy(live, buffers)
    assert second["w"].tolist() == [11.0, 14.0] and buffers.nbytes == held
    assert second["w"].data_ptr() == first["w"].data_ptr()  # the same buffer, written again
