"""A host copy of one rank's checkpoint, taken as DeepSpeed saves it, for an asynchronous save.

``take`` runs DeepSpeed's own ``engine.save_checkpoint`` with ``SnapshotEngine`` installed as
its checkpoint engine for that one call: each ``save(state_dict, path)`` DeepSpeed makes is
recorded as (path, a copy of the state in host memory) instead of being written. What the
files will hold is therefore exactly what a synchronous save writes (the same state dicts,
names, ranks and client state), and nothing is read from the live tensors after ``take``
returns: the training goes on and changes them while ``anneal.resilience.background_save``
writes the copies.

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


def host_copy(obj, buffers: HostBuffers):
    """``obj`` (a state dict as DeepSpeed hands it to ``torch.save``) with every tensor copied
    to ``buffers`` and every container rebuilt, so that nothing in the result changes when the
    training changes the live state. Any other object is deep-copied."""
    if isinstance(obj, torch.Tensor):
        return buffers.copy(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps an OrderedDict's (or a defaultdict's) type
        for key, value in obj.items():
            out[key] = host_copy(value, buffers)
        return out
    if isinstance(obj, list):
        return [host_copy(v, buffers) for v in obj]
    if isinstance(obj, tuple):
        items = [host_copy(v, buffers) for v in obj]
        if hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return type(obj)(items)  # a tuple, torch.Size
    return copy.deepcopy(obj)


class SnapshotEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine for one snapshot: ``save`` records a host copy of the
    state and the path it is for (``files``); nothing is written but the directories."""

    def __init__(self, buffers: HostBuffers):
        super().__init__()
        self.name = "AnnealSnapshot"
        self.buffers = buffers
        self.files: list[tuple[Path, object]] = []

    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        self.files.append((Path(path), host_copy(state_dict, self.buffers)))

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
    as (path, host copy of its state), in the order DeepSpeed saves them; its directories are
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


def zipfile_serialization(engine) -> bool:
    """Whether the engine's own checkpoint engine writes torch's zip format (DeepSpeed's
    ``checkpoint.use_zipfile_serialization``; its default otherwise)."""
    return getattr(engine.checkpoint_engine, "zipfile_serialization", True)
