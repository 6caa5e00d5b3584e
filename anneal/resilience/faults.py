"""Fault injection for tests and drills: ``ANNEAL_FAULTS`` makes a run misbehave on purpose.

``ANNEAL_FAULTS="nan_loss@step=30,spike@step=40:x=50,kill@step=55,slow_rank@rank=1:s=5"``:
comma-separated faults, each ``kind@key=value[:key=value...]``.

- ``nan_loss@step=N``: the loss of every micro-batch of step N is NaN (so are its gradients).
  Each rank logs whether its weights changed over that step. ``nan_loss@sample=I``: the loss of
  the micro-batch that holds global sample I.
- ``spike@step=N:x=F``: the loss of step N is multiplied by F (default 50), gradients too. It
  recurs whenever step N runs again, e.g. after a rewind (a drill for ``guard.max_rewinds``).
- ``spike@sample=I:x=F``: the loss of the micro-batch that holds global sample I is multiplied
  by F: a bad sample in the data, which a rewind that skips it leaves behind.
- ``kill@step=N``: SIGKILL at the start of step N (a crash: no cleanup, no save).
- ``slow_rank@s=S``: sleep S seconds at the start of every step (``step=N``: only step N),
  before a ``kill`` of the same step.
- ``save_slow@s=S``: an asynchronous save's background write (``train.async_save``) sleeps S
  seconds after its first file (``step=N``: only the save of step N), so that it is still in
  flight, half written, over the next steps: the drills of a crash, a preemption and the end
  of a run during a background write.
- ``save_slow_copy@s=S``: on a CPU engine, the background write sleeps S seconds before it
  copies the snapshot's tensors to host memory: the engine's next ``backward`` waits for the
  copy (the drill of the fence that keeps a snapshot the state of its step).
- ``save_fail@step=N``: the background write of the save of step N fails with ENOSPC after its
  first file, as on a full disk (without ``step``: every save's).

Every fault takes ``rank=R`` to act on that rank only. ``Faults.wrap`` hooks them around the
step from outside (``anneal.train.step.train_step`` has no branch for them); unset,
``from_env`` returns None and the step runs as it is.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import signal
import time

import torch

from anneal.errors import UserError

ENV = "ANNEAL_FAULTS"
log = logging.getLogger(__name__)

_FAULT_KEYS = {
    "nan_loss": {"step", "sample", "rank"},
    "spike": {"step", "sample", "rank", "x"},
    "kill": {"step", "rank"},
    "slow_rank": {"step", "rank", "s"},
    "save_slow": {"step", "rank", "s"},
    "save_slow_copy": {"step", "rank", "s"},
    "save_fail": {"step", "rank"},
}


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int | None = None
    sample: int | None = None
    rank: int | None = None
    x: float = 50.0
    s: float = 1.0


def parse(text: str) -> list[Fault]:
    """The faults in an ``ANNEAL_FAULTS`` value; UserError on a malformed one."""
    faults = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, _, rest = item.partition("@")
        if kind not in _FAULT_KEYS:
            raise UserError(
                f"{ENV}: unknown fault {kind!r} in {item!r}; faults are {', '.join(_FAULT_KEYS)}."
            )
        fields = {}
        for pair in filter(None, rest.split(":")):
            key, eq, value = pair.partition("=")
            if not eq or key not in _FAULT_KEYS[kind]:
                raise UserError(
                    f"{ENV}: {item!r}: expected key=value with keys "
                    f"{', '.join(sorted(_FAULT_KEYS[kind]))}, got {pair!r}."
                )
            try:
                fields[key] = float(value) if key in ("x", "s") else int(value)
            except ValueError:
                msg = f"{ENV}: {item!r}: {key} must be a number, got {value!r}."
                raise UserError(msg) from None
        if kind == "kill" and "step" not in fields:
            raise UserError(f"{ENV}: {item!r} needs a step, e.g. {kind}@step=30.")
        if kind in ("spike", "nan_loss") and ("step" in fields) == ("sample" in fields):
            raise UserError(f"{ENV}: {item!r} needs step=N or sample=I (one of them).")
        faults.append(Fault(kind, **fields))
    return faults


def from_env(rank: int) -> Faults | None:
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    faults = [f for f in parse(text) if f.rank is None or f.rank == rank]
    log.warning("%s=%s: injecting %d fault(s) on this rank", ENV, text, len(faults))
    return Faults(faults, rank=rank)


def fingerprint(module: torch.nn.Module) -> tuple[float, float]:
    """(sum, sum of |.|) of this rank's parameters (its ZeRO-3 partition where partitioned)."""
    total = torch.zeros(2, dtype=torch.float64)
    for p in module.parameters():
        t = getattr(p, "ds_tensor", p.data).detach().double().cpu()
        total += torch.stack([t.sum(), t.abs().sum()])
    return tuple(total.tolist())


class Faults:
    """The faults that act on this rank, hooked around the step by ``wrap``."""

    def __init__(self, faults: list[Fault], *, rank: int):
        self.faults = faults
        self.rank = rank
        self._before: tuple[float, float] | None = None
        self._nan_step: int | None = None

    def _at(self, kind: str, step: int) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.step == step]

    def _nan_at(self, step: int, samples: list[int]) -> bool:
        return any(
            f.kind == "nan_loss" and (f.step == step or f.sample in samples) for f in self.faults
        )

    def wrap(self, step_fn, loss_fn):
        """``step_fn`` (``anneal.train.step.train_step``) with these faults: ``step_start`` and
        ``step_end`` around it, and each micro-batch's loss (``loss_fn``) made faulty where
        asked, knowing its global samples from the stream it reads."""

        def faulty_step(engine, stream, state, shape, preemption=None):
            step = state.step + 1
            self.step_start(step, engine.module)
            seen = _Recording(stream)

            def loss(logits, targets):
                return self.loss(loss_fn(logits, targets), step, seen.samples)

            row = step_fn(engine, seen, state, shape, preemption, loss_fn=loss)
            self.step_end(step, engine.module)
            return row

        return faulty_step

    def step_start(self, step: int, module: torch.nn.Module) -> None:
        """Before the first micro-batch of optimizer step ``step``."""
        for f in self.faults:  # before a kill of the same step: a drill's write goes on meanwhile
            if f.kind == "slow_rank" and f.step in (None, step):
                time.sleep(f.s)
        if self._at("kill", step):
            log.warning("fault: kill at step %d", step)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        # a drill with a NaN fault compares the weights around every step (sample-keyed NaNs
        # are only known once the batch is read)
        nan = any(f.kind == "nan_loss" for f in self.faults)
        self._before = fingerprint(module) if nan else None

    def loss(self, loss: torch.Tensor, step: int, samples: list[int]) -> torch.Tensor:
        """The loss of one micro-batch (of global ``samples``), made faulty where asked."""
        if self._nan_at(step, samples):
            log.warning("fault: nan_loss at step %d (samples %s)", step, samples)
            self._nan_step = step
            return loss * math.nan
        for f in self.faults:
            if f.kind == "spike" and (f.step == step or f.sample in samples):
                log.warning("fault: spike x%g at step %d (samples %s)", f.x, step, samples)
                loss = loss * f.x
        return loss

    def step_end(self, step: int, module: torch.nn.Module) -> None:
        if self._before is not None and self._nan_step == step:
            after = fingerprint(module)
            changed = after != self._before
            log.warning(
                "fault: nan_loss at step %d: weights %s on rank %d",
                step,
                "CHANGED" if changed else "unchanged",
                self.rank,
            )
            self._before = None

    def before_snapshot_copy(self, step: int) -> None:
        """In an asynchronous save's background write of step ``step``, before it copies a CPU
        engine's state to host memory: ``save_slow_copy`` sleeps (the engine's next update
        waits for the copy)."""
        for f in self.faults:
            if f.kind == "save_slow_copy" and f.step in (None, step):
                log.warning("fault: save_slow_copy %gs before the host copy of step %d", f.s, step)
                time.sleep(f.s)

    def before_save_write(self, step: int, index: int) -> None:
        """In an asynchronous save's background write of step ``step``, before its file number
        ``index`` (from 0): before the second (every rank writes at least two: its model and
        optimizer states), ``save_slow`` sleeps and ``save_fail`` raises ENOSPC."""
        for f in self.faults:
            if f.kind == "save_slow" and f.step in (None, step) and index == 1:
                log.warning("fault: save_slow %gs in the background write of step %d", f.s, step)
                time.sleep(f.s)
            if f.kind == "save_fail" and f.step in (None, step) and index == 1:
                log.warning("fault: save_fail in the background write of step %d", step)
                raise OSError(errno.ENOSPC, "No space left on device (fault injection)")


class _Recording:
    """A token stream that remembers the global samples of the last batch it gave."""

    def __init__(self, stream):
        self._stream = stream
        self.samples: list[int] = []

    def next_batch(self):
        self.samples = self._stream.indices_at(self._stream.position)
        return self._stream.next_batch()

    def __getattr__(self, name):
        return getattr(self._stream, name)
