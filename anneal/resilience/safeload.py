"""Checkpoint files from elsewhere are read without running them.

A torch checkpoint is a zip whose ``data.pkl`` is a pickle, and unpickling may call any function
the pickle names (a ``__reduce__`` payload runs ``os.system`` as easily as it rebuilds a tensor).
So no pickle from disk is ever given to Python's own unpickler: every file of a checkpoint is
read by :func:`load`, that is ``torch.load(weights_only=True)``, whose unpickler is torch's own
(maintained with torch, not re-implemented here). It builds tensors, plain containers and the
exact classes of :func:`safe_globals`, each allowed by its full name, and refuses every other
global, any dotted name reached through an allowed module included, before anything is called.

Before that, :func:`check_archive` refuses a file that is not a zip archive starting at byte 0:
torch falls back to its legacy format for any file that does not begin with a zip header, and
Python's ``zipfile`` accepts data in front of an archive, so pickle bytes placed before a real
checkpoint would otherwise be what torch reads.

DeepSpeed reads its checkpoint files through its checkpoint engine (here a
subclass of DeepSpeed's torch engine that loads through :func:`load`, :func:`install`-ed by
every load) and, on a few paths
(universal checkpoints), with ``torch.load(weights_only=False)`` of its own; :func:`loading`
forces those into the weights-only loader too, through torch's own switch
``TORCH_FORCE_WEIGHTS_ONLY_LOAD``. ``anneal.resilience.universal`` runs DeepSpeed's converter
under the same switch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickletools
import re
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

from anneal.errors import UserError
from anneal.resilience import ds_files

ZIP_MAGIC = b"PK\x03\x04"
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
"""torch's own switch: set to 1, every ``torch.load`` is weights-only, whatever its caller asked."""
_FORCE_UNSAFE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def safe_globals() -> list:
    """The classes and functions a checkpoint of Anneal's holds beyond torch's own tensors,
    each exactly (``torch.serialization.safe_globals`` allows an object by its module and
    qualified name, never a module): the RNG states (numpy's arrays and dtypes), DeepSpeed's
    ZeRO stage, loss scalers and universal-checkpoint addresses, and containers."""
    import argparse
    import collections

    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    from numpy._core.multiarray import _reconstruct, scalar

    return [
        argparse.Namespace,
        collections.OrderedDict,
        collections.defaultdict,
        ZeroStageEnum,
        LossScaler,
        DynamicLossScaler,
        fragment_address,
        np.ndarray,
        np.dtype,
        np.dtypes.UInt32DType,
        np.dtypes.Int64DType,
        np.dtypes.Float32DType,
        np.dtypes.Float64DType,
        _reconstruct,
        scalar,
    ]


def check_archive(path: Path) -> None:
    """Refuse a file that is not a zip archive beginning at byte 0 with ``data.pkl`` inside,
    before torch sees it (torch would read a non-zip file as its legacy pickle format)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(len(ZIP_MAGIC))
        if head != ZIP_MAGIC:
            raise zipfile.BadZipFile(f"it begins with {head!r}, not a zip header")
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
        if not infos or min(i.header_offset for i in infos) != 0:
            raise zipfile.BadZipFile("its archive does not begin at byte 0")
        if not any(i.filename.endswith("data.pkl") for i in infos):
            raise zipfile.BadZipFile("no data.pkl inside")
    except (OSError, zipfile.BadZipFile) as e:
        raise UserError(
            f"{path}: not a torch checkpoint in the zip format torch.save writes ({e}), so it "
            f"is not loaded (torch would read it as its legacy pickle format)."
        ) from None


def load(path: Path, *, map_location=None, mmap: bool = False):
    """``torch.load(path, weights_only=True)`` with :func:`safe_globals`, after
    :func:`check_archive`. A file torch's weights-only unpickler refuses (a global outside its
    list, an opcode it does not run, bytes that are no pickle) is one UserError naming it."""
    import torch

    check_archive(path)
    try:
        with _allowing_safe_globals(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Detected pickle protocol 4 ..."
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - any failure to read untrusted bytes is the file's
        raise UserError(
            f"{path}: torch's weights-only loader refuses it ({unpickler_refusal(e)}), and "
            f"loading it any other way could run code, so it is not loaded."
        ) from None


def unpickler_refusal(e: Exception) -> str:
    """What torch's weights-only unpickler refused, from its message; else the exception."""
    text = str(e)
    if "Weights only load failed" in text:
        body = text.split("Check the documentation")[0]
        if "WeightsUnpickler error:" in body:
            why = body.split("WeightsUnpickler error:", 1)[1]
        else:  # a blocked module: torch's first paragraph, then what it refused
            why = body.split("\n\n", 1)[-1]
        why = " ".join(why.split())
        if m := re.fullmatch(r"Unsupported operand (\d+)", why):
            op = {ord(o.code): o.name for o in pickletools.opcodes}.get(int(m[1]), "unknown")
            why = f"pickle opcode {m[1]} ({op}), which it does not run"
        return why[:300]
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


def check_checkpoint(tag_dir: Path, *, skip_hidden: bool = False) -> None:
    """:func:`load` every ``*.pt`` of a checkpoint's tag directory, tensors memory-mapped and
    never read, so that a refusal comes before anything is loaded, the same on every rank.

    ``skip_hidden``: not a file under a hidden name (a leftover that nothing loads)."""
    import torch

    tag_dir = Path(tag_dir)
    for path in sorted(tag_dir.rglob("*.pt")):
        if skip_hidden and any(part.startswith(".") for part in path.relative_to(tag_dir).parts):
            continue
        state = load(path, map_location="cpu", mmap=True)
        if ds_files.is_expert_file(path.name):
            if not (
                isinstance(state, dict) and state and all(map(torch.is_tensor, state.values()))
            ):
                raise UserError(
                    f"{path}: holds a {type(state).__name__} that is not a dict of tensors, not "
                    f"what DeepSpeed's AutoEP saves in an expert's file, so it is not loaded."
                )
            continue
        key = ds_files.states_key(path.name)
        if key and not (isinstance(state, dict) and key in state):
            raise UserError(
                f"{path}: holds a {type(state).__name__} without {key!r}, not what DeepSpeed "
                f"saves in such a file, so it is not loaded."
            )


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Within: every ``torch.load`` of this process is weights-only with :func:`safe_globals`,
    whatever its caller asked (torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``): DeepSpeed's own
    loads of universal checkpoints pass ``weights_only=False``."""
    saved = {k: os.environ.get(k) for k in (FORCE_WEIGHTS_ONLY, _FORCE_UNSAFE)}
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    os.environ.pop(_FORCE_UNSAFE, None)
    try:
        with _allowing_safe_globals():
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _allowing_safe_globals():
    """``torch.serialization.safe_globals`` for those of :func:`safe_globals` not yet allowed:
    on leaving, torch's context removes what it added, so a nested one must add nothing that an
    outer one holds."""
    import torch

    held = set(torch.serialization.get_safe_globals())
    return torch.serialization.safe_globals([g for g in safe_globals() if g not in held])


def forced_env() -> dict[str, str]:
    """The environment for a child process that loads checkpoints (DeepSpeed's converter):
    this one's, with torch's weights-only switch on."""
    env = {k: v for k, v in os.environ.items() if k != _FORCE_UNSAFE}
    env[FORCE_WEIGHTS_ONLY] = "1"
    return env


@functools.cache
def _engine_class() -> type:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine, saving as it does, loading through :func:`load`."""

        def load(self, path: str, map_location=None):
            return load(Path(path), map_location=map_location)

    return SafeCheckpointEngine


def install(engine) -> None:
    """Make a DeepSpeed engine read every checkpoint file through :func:`load`."""
    if not isinstance(engine.checkpoint_engine, _engine_class()):
        engine.checkpoint_engine = _engine_class()(engine._config)
