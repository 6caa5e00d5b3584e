"""A host copy of one rank's checkpoint, taken as DeepSpeed saves it, for an asynchronous save.

``take`` runs DeepSpeed's own ``engine.save_checkpoint`` with ``SnapshotEngine`` installed as
its checkpoint engine for that one call: each ``save(state_dict, path)`` DeepSpeed makes is
recorded for ``path`` instead of being written. What the files will hold is therefore exactly
what a synchronous save writes (the same state dicts, names, ranks and client state).

The record is taken in one of two ways:
- on a GPU (``HostBuffers.pinned``): every tensor is copied to host memory while DeepSpeed
  saves (device-to-host, asynchronous on the stream), and ``take`` waits for the copies;
- on a CPU, where the state already lives in host memory: ``take`` keeps every container and
  value as it is at the save (rebuilt and deep-copied) but only a reference to each tensor
  (``freeze``), and the background writer copies the tensors (``host_copy``) before it writes
  anything. The loop goes on meanwhile, and nothing that changes those tensors may run before
  the copy is done: ``anneal.resilience.background_save.AsyncSaves`` fences the engine's
  ``backward``, ``step`` and ``load_checkpoint`` on it. DeepSpeed changes a saved tensor only
  there (the optimizer's states and fp32 weights in ``step``, Muon's momentum as the gradients
  are reduced at the end of ``backward``, everything in a load): the forward pass of the next
  micro-batch overlaps the copy. torchtitan's ``async_with_pinned_mem`` stages the same way,
  waiting for its staging before the next optimizer step.

The copies go to buffers kept from one save to the next (``HostBuffers``): the state's
structure is the same at every save, so the second save writes into memory that is already
allocated and touched (on a GPU: pinned, so the device-to-host copy runs at full speed, and
synchronised once at the end). The buffers cost one more copy of this rank's checkpoint in
host memory for the whole run (``anneal.planning.memory`` counts it). A buffer is reused only
after the write that read it has finished: at most one save is in flight.

Why not DeepSpeed's decoupled writer (``checkpoint.writer.decoupled``): at 0.19.8 it fails at
ZeRO-1/2, its files fail torch's weights-only loading, and its spawned writer needs
DeepSpeed's launcher's environment (docs/resilience.md, "Asynchronous saves").
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine


class HostBuffers:
    """Host tensors that hold one snapshot, reused by the next: the ``i``-th tensor a save
    copies goes to the ``i``-th buffer while its shape and dtype match (a new one otherwise).
    ``pinned``: page-locked memory, for a copy from a GPU."""

    def __init__(self, *, pinned: bool):
        self.pinned = pinned
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def restart(self) -> None:
        """The next snapshot starts from the first buffer."""
        self._next = 0

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (detached, contiguous) in the next buffer."""
        t = tensor.detach()
        i, self._next = self._next, self._next + 1
        if i == len(self._buffers):
            self._buffers.append(self._new(t))
        elif self._buffers[i].shape != t.shape or self._buffers[i].dtype != t.dtype:
            self._buffers[i] = self._new(t)
        return self._buffers[i].copy_(t, non_blocking=self.pinned)

    def _new(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pinned)

    def ready(self) -> None:
        """Wait for the copies from the device (on a GPU they run asynchronously)."""
        if self.pinned:
            torch.cuda.synchronize()

    @property
    def nbytes(self) -> int:
        """The host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers)


def rebuilt(obj, tensor, other=copy.deepcopy):
    """``obj`` (a state dict as DeepSpeed hands it to ``torch.save``) with every container
    rebuilt (a dict keeps its type: an OrderedDict, a defaultdict; a namedtuple and a
    ``torch.Size`` theirs), each tensor replaced by ``tensor(t)`` and any other value by
    ``other(value)``."""
    if isinstance(obj, torch.Tensor):
        return tensor(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = rebuilt(value, tensor, other)
        return out
    if isinstance(obj, list):
        return [rebuilt(v, tensor, other) for v in obj]
    if isinstance(obj, tuple):
        items = [rebuilt(v, tensor, other) for v in obj]
        if hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return type(obj)(items)  # a tuple, torch.Size
    return other(obj)


def freeze(obj):
    """``obj`` as it is now: every container rebuilt and every other value deep-copied, each
    tensor kept as a (detached) reference to the live one, for ``host_copy`` to copy before
    anything changes it."""
    return rebuilt(obj, torch.Tensor.detach)


def host_copy(obj, buffers: HostBuffers, *, other=copy.deepcopy):
    """``obj`` with every tensor copied to ``buffers`` and every container rebuilt, so that
    nothing in the result changes when the training changes the live state. Any other object
    is deep-copied (``other``: kept as it is, where ``freeze`` copied it already)."""
    return rebuilt(obj, buffers.copy, other)


class SnapshotEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine for one snapshot: ``save`` records the state and the path
    it is for (``files``): a host copy where the buffers are pinned (a GPU), else ``freeze``'s
    record, for the writer to copy. Nothing is written but the directories."""

    def __init__(self, buffers: HostBuffers):
        super().__init__()
        self.name = "AnnealSnapshot"
        self.buffers = buffers
        self.files: list[tuple[Path, object]] = []

    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        state = host_copy(state_dict, self.buffers) if self.buffers.pinned else freeze(state_dict)
        self.files.append((Path(path), state))

    def load(self, path: str, map_location=None):
        raise RuntimeError("the snapshot engine only saves; loading goes through DeepSpeed's own")

    def commit(self, info) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # host_copy copies each tensor on its own already


def take(
    engine, ckpt_dir: Path, *, tag: str, client_state: dict, buffers: HostBuffers
) -> list[tuple[Path, object]]:
    """Collective (DeepSpeed's ``save_checkpoint``): this rank's files of checkpoint ``tag``
    as (path, its state), in the order DeepSpeed saves them: host copies where ``buffers`` are
    pinned, else ``freeze``'s records, which ``host_copy`` must copy before the engine's next
    ``backward``, ``step`` or load (``copied``); its directories are
    made, and any file DeepSpeed writes itself rather than through its checkpoint engine (its
    recovery script, on rank 0) is written."""
    recorder = SnapshotEngine(buffers)
    own = engine.checkpoint_engine
    buffers.restart()
    engine.checkpoint_engine = recorder
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    finally:
        engine.checkpoint_engine = own
    buffers.ready()
    return recorder.files


def copied(files: list[tuple[Path, object]], buffers: HostBuffers) -> list[tuple[Path, object]]:
    """``take``'s files with every tensor in host memory of its own: ``freeze``'s records
    copied to ``buffers``; host copies already (pinned buffers) as they are."""
    if buffers.pinned:
        return files
    buffers.restart()
    return [(path, host_copy(state, buffers, other=lambda v: v)) for path, state in files]


def zipfile_serialization(engine) -> bool:
    """Whether the engine's own checkpoint engine writes torch's zip format (DeepSpeed's
    ``checkpoint.use_zipfile_serialization``; its default otherwise)."""
    return getattr(engine.checkpoint_engine, "zipfile_serialization", True)
