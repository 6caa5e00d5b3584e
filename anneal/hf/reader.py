"""Reading a ``torch.save`` zip checkpoint without loading it.

The pickled index is read with an unpickler that builds no tensors and imports nothing but a
short list of harmless names (``_LazyUnpickler``); each tensor is a ``LazyTensor``, where its
bytes are, read later with ``readinto`` straight from its byte range. Nothing here knows about
ZeRO (``anneal.hf.zero``) or DeepSpeed's file names.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import struct
import warnings
import zipfile
from pathlib import Path

import torch

from anneal.errors import UserError


@dataclasses.dataclass
class _LazyStorage:
    archive: Archive
    key: str
    dtype: torch.dtype


@dataclasses.dataclass
class LazyTensor:
    """A tensor in a checkpoint file: where its bytes are, not the bytes."""

    storage: _LazyStorage
    offset: int
    """Storage offset in elements."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def read_into(self, out: torch.Tensor, start: int = 0) -> None:
        """Copy elements ``[start, start + out.numel())`` of this (contiguous, flattened)
        tensor into ``out`` (1-D, same dtype) with one read from the file."""
        if self.numel() > 1 and tuple(self.stride) != _contiguous_stride(self.shape):
            raise _unreadable(self.storage.archive.path, "it holds a non-contiguous tensor")
        assert out.dtype == self.dtype and out.dim() == 1 and start + out.numel() <= self.numel()
        itemsize = self.dtype.itemsize
        self.storage.archive.read_into(
            self.storage.key, (self.offset + start) * itemsize, out.view(torch.uint8)
        )

    def load(self) -> torch.Tensor:
        out = torch.empty(self.numel(), dtype=self.dtype)
        self.read_into(out)
        return out.view(self.shape)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


class _Opaque:
    """Stands in for any object the index holds that export does not need (numpy RNG state,
    argparse namespaces, ...): nothing of it is imported or run."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def _rebuild_tensor(storage, storage_offset, size, stride, *_):
    return LazyTensor(storage, storage_offset, tuple(size), tuple(stride))


def _rebuild_parameter(data, *_):
    return data


def _rebuild_from_type(func, _new_type, args, _state):
    return func(*args)


_SAFE_BUILTINS = {"set", "frozenset", "slice", "tuple", "list", "dict", "int", "float", "complex"}


class _LazyUnpickler(pickle.Unpickler):
    def __init__(self, file, archive: Archive):
        super().__init__(file)
        self.archive = archive

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild_tensor
        if module == "torch._utils" and name.startswith("_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type
        if module == "torch" and (
            name.endswith("Storage")
            or name == "Size"
            or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        if module == "builtins" and name in _SAFE_BUILTINS:
            import builtins

            return getattr(builtins, name)
        if module.startswith("deepspeed.") and name.endswith("Enum"):  # e.g. ZeroStageEnum
            import enum
            import importlib

            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and issubclass(obj, enum.Enum):
                return obj
        return _Opaque

    def persistent_load(self, pid):
        typename, storage_type, key, _location, _numel = pid
        if typename != "storage" or not isinstance(storage_type, type):
            raise _unreadable(self.archive.path, f"an unknown persistent record {typename!r}")
        if storage_type is torch.UntypedStorage:
            dtype = torch.uint8
        else:
            with warnings.catch_warnings():  # TypedStorage classes are deprecated, still pickled
                warnings.simplefilter("ignore")
                dtype = storage_type.dtype
        return _LazyStorage(self.archive, str(key), dtype)


def _unreadable(path: Path, why: str) -> UserError:
    return UserError(
        f"{path}: {why}, so anneal export cannot read it: not a checkpoint that DeepSpeed wrote "
        f"for Anneal, or one changed after its manifest was written. Export another tag "
        f"(--tag), or copy the checkpoint again from where it was saved."
    )


class Archive:
    """A ``torch.save`` zip file: its index unpickled lazily, its tensors read by offset."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (OSError, zipfile.BadZipFile) as e:
            raise _unreadable(self.path, f"not a torch zip file ({e})") from None
        names = self._zip.namelist()
        pkl = next((n for n in names if n.endswith("/data.pkl")), None)
        if pkl is None:
            raise _unreadable(self.path, "not a torch zip checkpoint (no data.pkl)")
        self.prefix = pkl[: -len("data.pkl")]
        self._offsets: dict[str, tuple[int, int]] = {}
        self._file = open(self.path, "rb")  # noqa: SIM115 - closed in close()

    def index(self):
        with self._zip.open(self.prefix + "data.pkl") as f:
            return _LazyUnpickler(f, self).load()

    def _data_offset(self, key: str) -> tuple[int, int]:
        if key not in self._offsets:
            try:
                info = self._zip.getinfo(f"{self.prefix}data/{key}")
            except KeyError:
                raise _unreadable(self.path, f"its index names a missing record {key!r}") from None
            if info.compress_type != zipfile.ZIP_STORED:
                raise _unreadable(self.path, "its tensor data is compressed")
            self._file.seek(info.header_offset)
            header = self._file.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            self._offsets[key] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
        return self._offsets[key]

    def read_into(self, key: str, byte_offset: int, out: torch.Tensor) -> None:
        start, size = self._data_offset(key)
        n = out.numel()
        if byte_offset + n > size:
            raise _unreadable(self.path, "a tensor runs past its storage record")
        detached = self._file.closed
        if detached:  # reopened for this read only (``detach``)
            self._file = open(self.path, "rb")  # noqa: SIM115 - closed below
        try:
            self._file.seek(start + byte_offset)
            view = memoryview(out.numpy()).cast("B")
            got = self._file.readinto(view)
        finally:
            if detached:
                self._file.close()
        if got != n:
            raise _unreadable(self.path, f"truncated ({got} of {n} bytes)")

    def detach(self) -> None:
        """Record where every tensor record lies, then close the file: each later read opens
        it for itself. For checkpoints of many small files (one per expert: 6,144 for a
        48-layer model of 128 experts), which would otherwise hold two descriptors each."""
        for name in self._zip.namelist():
            if name.startswith(self.prefix + "data/"):
                self._data_offset(name[len(self.prefix + "data/") :])
        self.close()

    def close(self) -> None:
        self._file.close()
        self._zip.close()


# --- the ZeRO layouts --------------------------------------------------------------------------
