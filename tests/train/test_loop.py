"""The order of everything around the step in the Trainer's loop, without training: a stand-in
for the step function and a minimal engine-like object (``Engine`` below, made for this test
only; every integration test runs the real DeepSpeed engine) drive the real Trainer, guard,
checkpoint save and load, preemption and observers of a tiny launch.

It proves: the guard looks at a step before validation, the scoring of the downstream tasks and
the save, and a rewind goes back to the checkpoint before the spike and on, with none of them on
the rewound step; a
preemption saves first (or finds the regular save of that step) and stops after it; a failing
step reaches the observers and no end-of-run comes; the end-of-run observer comes only after the
last step, and its plots and report after the other observers closed; metrics.jsonl holds the
same rows and events, in the same order, as the observers were told."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from anneal.resilience.guard import Guard
from anneal.resilience.preempt import Preempted
from anneal.rundir import RunDir, read_evals, read_metrics
from anneal.train.observers import Observer
from anneal.train.trainer import Data, Trainer
from tests.conftest import resolve_tiny


class Engine:
    """What the Trainer, the guard and a checkpoint's save and load ask of DeepSpeed's engine,
    for this loop-order test only: each save writes one small file and keeps its client state,
    which a load gives back; a save takes ``save_s``."""

    device = torch.device("cpu")
    module = torch.nn.Module()
    _config = None
    sequence_parallel_size, data_parallel_group, dp_world_size = 1, None, 1

    def __init__(self, save_s: float = 0.0):
        from anneal.resilience import safeload

        self.save_s = save_s
        self.checkpoint_engine = safeload._engine_class()(None)
        self.lr_scheduler = Scheduler()
        self.saved: dict[str, dict] = {}

    def was_step_applied(self) -> bool:
        return True

    # an asynchronous save fences these two; the stand-in step calls neither
    def backward(self, loss):
        raise AssertionError("the stand-in step does not call backward")

    def step(self):
        raise AssertionError("the stand-in step does not call step")

    def get_global_grad_norm(self) -> float:
        return 1.0

    def save_checkpoint(self, save_dir: str, *, tag: str, client_state: dict, save_latest):
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / "client.json").write_text(json.dumps(client_state["data"]))
        self.saved[tag] = client_state
        time.sleep(self.save_s)

    def load_checkpoint(self, load_dir: str, *, tag: str, **kwargs):
        return str(Path(load_dir) / tag), self.saved[tag]


class Scheduler:
    def apply(self) -> None: ...

    def scale_peak(self, factor: float) -> None: ...

    def change_on_resume(self) -> None: ...


class Recorder(Observer):
    """Every call the observers get, in order: (what, step)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def on_step(self, row: dict) -> None:
        self.calls.append(("step", row["step"]))

    def on_val(self, row: dict) -> None:
        self.calls.append(("val", row["step"]))

    def on_eval(self, doc: dict) -> None:
        self.calls.append(("eval", doc["step"]))

    def on_event(self, step: int, event: str, **fields) -> None:
        self.calls.append((event, step))

    def on_checkpoint(self, tag_dir: Path) -> None:
        self.calls.append(("saved", int(tag_dir.name.removeprefix("step"))))

    def on_failure(self, error: BaseException) -> None:
        self.calls.append(("failure", str(error)))

    def on_end(self) -> None:
        self.calls.append(("end",))

    def close(self) -> None:
        self.calls.append(("close",))


def stand_in_step(losses: list[float], *, signal_at: int = 0, fail_at: int = 0):
    """A train step that reads its micro-batches (so the data position moves as a real step's),
    advances the state, and returns a train row with the next of ``losses``; at step
    ``signal_at`` this process gets SIGUSR1, at ``fail_at`` the step raises. It sets the
    preemption flag as the real step's collective does on one rank."""
    losses = iter(losses)

    def step(engine, stream, state, shape, preemption=None):
        for _ in range(shape.grad_accum):
            stream.next_batch()
        if state.step + 1 == fail_at:
            raise RuntimeError(f"step {fail_at} failed")
        state.step += 1
        state.tokens += shape.tokens_per_step
        if state.step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        preemption.requested_by_any = preemption.signalled
        return {
            "kind": "train",
            "step": state.step,
            "tokens": state.tokens,
            "loss": next(losses),
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": 1000.0,
        }

    return step


def validate(engine, val, token_bytes, *, n_samples: int, micro_batch: int, attention) -> dict:
    return {"kind": "val", "step": 0, "val_loss": 2.0, "val_ppl": 7.389, "val_bpb": 1.0}


class Tasks:
    """In place of ``anneal.eval.in_loop.InLoop``: a scoring's document, at once."""

    def score(self, *, step: int, tokens: int) -> dict:
        task = {"metrics": {"acc": 0.5}, "chance": 0.25, "config_sha256": "0" * 64}
        return {"step": step, "tokens": tokens, "tasks": {"t": task}, "seconds": 0.0}


def trainer(
    tiny_data: Path,
    out: Path,
    step,
    *,
    save_s: float = 0.0,
    tasks: bool = False,
    async_save: bool = False,
) -> tuple[Trainer, Recorder]:
    """A Trainer of the tiny recipe: 6 steps, validation and a save every 2, the guard from 2
    good steps on; ``step`` for its train step, saves of ``save_s`` seconds; with ``tasks``, a
    stand-in scoring of downstream tasks every 2 steps; with ``async_save``, saves in the
    background (the stand-in engine writes its file in the snapshot, so the write behind it has
    nothing to do and the save commits after the next step)."""
    args = ["--data", str(tiny_data), "--out", str(out), "--max-steps", "6"]
    args += ["--val-every", "2", "--save-every", "2", "--set", "guard.min_history=2"]
    if async_save:
        args += ["--set", "train.async_save=true"]
    if tasks:
        args += ["--set", "train.eval_tasks=t", "--set", "train.eval_tasks_every=2"]
    launch = resolve_tiny(args, world_size=1)
    guard = Guard(launch.cfg.guard, run_dir=out, resuming=False)
    recorder = Recorder()
    t = Trainer(
        launch,
        Engine(save_s),
        guard,
        RunDir.for_launch(launch),
        Data.open(launch),
        watchers=[recorder],
    )
    t.train_step, t.val_step = step, validate
    t.tasks = Tasks() if tasks else None
    return t, recorder


def told(run: Path) -> list[tuple]:
    """metrics.jsonl as (what, step), as the Recorder writes them."""
    names = {"train": "step", "val": "val", "eval": "eval"}
    return [(names.get(r["kind"]) or r["event"], r["step"]) for r in read_metrics(run)]


def test_guard_before_validation_and_save_and_a_rewind_goes_on(tiny_data, world_of_one, tmp_path):
    """A spike at step 4 (due for validation, a scoring and a save) is rewound to the save of
    step 2, with none of them at step 4; the loop goes on from step 3 to the last step, then
    the end-of-run observer, whose report exists once the Trainer returns."""
    out = tmp_path / "run"
    losses = [3.0, 2.9, 2.8, 30.0, 2.8, 2.7, 2.6, 2.5]
    t, rec = trainer(tiny_data, out, stand_in_step(losses), tasks=True)
    summary = t.train(None, {})
    assert rec.calls == [
        ("eval", 0),  # the baseline before the first step
        ("step", 1),
        ("step", 2),
        ("val", 2),
        ("eval", 2),
        ("checkpoint", 2),
        ("saved", 2),
        ("step", 3),
        ("step", 4),
        ("spike", 4),
        ("rewind", 4),
        ("skip", 4),
        ("step", 3),
        ("step", 4),
        ("val", 4),
        ("eval", 4),
        ("checkpoint", 4),
        ("saved", 4),
        ("step", 5),
        ("step", 6),
        ("val", 6),
        ("eval", 6),
        ("checkpoint", 6),
        ("saved", 6),
        ("end",),
        ("close",),
    ]
    assert told(out) == [c for c in rec.calls if c[0] not in ("saved", "end", "close")]
    assert [doc["step"] for doc in read_evals(out)] == [0, 2, 4, 6]  # evals/step-N.json
    assert summary["step"] == 6 and (out / "report.txt").is_file()  # drawn after the close
    assert t.run_dir.stepped


def test_an_asynchronous_save_is_told_once_committed_and_a_rewind_goes_to_it(
    tiny_data, world_of_one, tmp_path
):
    """With ``train.async_save``: the ``snapshot`` event at the save step, the ``checkpoint``
    event and ``on_checkpoint`` only once committed (after the next step's row is made, before
    the observers get it); a spike at step 4 rewinds to step 2's committed save; the last
    save is committed before the end of the run."""
    out = tmp_path / "run"
    losses = [3.0, 2.9, 2.8, 30.0, 2.8, 2.7, 2.6, 2.5]
    t, rec = trainer(tiny_data, out, stand_in_step(losses), async_save=True)
    t.train(None, {})
    saved = [("checkpoint", 2), ("saved", 2)]
    assert rec.calls == [
        ("step", 1),
        ("step", 2),
        ("val", 2),
        ("snapshot", 2),
        *saved,
        ("step", 3),
        ("step", 4),
        ("spike", 4),
        ("rewind", 4),
        ("skip", 4),
        ("step", 3),
        ("step", 4),
        ("val", 4),
        ("snapshot", 4),
        ("checkpoint", 4),
        ("saved", 4),
        ("step", 5),
        ("step", 6),
        ("val", 6),
        ("snapshot", 6),
        ("checkpoint", 6),
        ("saved", 6),
        ("end",),
        ("close",),
    ]
    assert told(out) == [c for c in rec.calls if c[0] not in ("saved", "end", "close")]
    [rewind] = [e for e in read_metrics(out, "event") if e["event"] == "rewind"]
    assert rewind["to_step"] == 2, rewind
    events = [e for e in read_metrics(out, "event") if e["event"] == "checkpoint"]
    assert all(e["asynchronous"] and "write_s" in e and "blocking_s" in e for e in events)


@pytest.mark.parametrize("signal_at", [2, 3], ids=["on-a-save-step", "between-saves"])
def test_preemption_comes_after_the_save(tiny_data, world_of_one, tmp_path, signal_at):
    """A signal during step 2 (a save step): the regular save, then the preemption, which
    finds that checkpoint (it spends no time saving) and exits 75. During step 3: the
    preemption saves step 3 itself (a save of 0.3 s), then stops. No end-of-run either way."""
    out = tmp_path / "run"
    step = stand_in_step([3.0, 2.9, 2.8], signal_at=signal_at)
    t, rec = trainer(tiny_data, out, step, save_s=0.3)
    with pytest.raises(Preempted) as stopped:
        t.train(None, {})
    assert stopped.value.code == 75
    before = [("step", 1), ("step", 2), ("val", 2), ("checkpoint", 2), ("saved", 2)]
    if signal_at == 3:
        before += [("step", 3), ("checkpoint", 3), ("saved", 3)]
    assert rec.calls == [*before, ("preempt", signal_at), ("close",)]
    assert told(out) == [c for c in rec.calls if c[0] not in ("saved", "close")]
    (preempt,) = read_metrics(out, "event")[-1:]
    assert (preempt["save_s"] >= 0.3) == (signal_at == 3), preempt


def test_a_failing_step_reaches_the_observers_and_no_end(tiny_data, world_of_one, tmp_path):
    """A step that raises: the observers get ``on_failure`` and close; no end-of-run."""
    t, rec = trainer(tiny_data, tmp_path / "run", stand_in_step([3.0], fail_at=2))
    with pytest.raises(RuntimeError, match="step 2 failed"):
        t.train(None, {})
    assert rec.calls == [("step", 1), ("failure", "step 2 failed"), ("close",)]
    assert not (tmp_path / "run" / "report.txt").exists()
