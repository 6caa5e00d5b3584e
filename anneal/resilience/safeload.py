"""Checkpoint files from elsewhere are read without running them.

A torch checkpoint is a zip whose ``data.pkl`` is a pickle, and unpickling may call any
function the pickle names (a ``__reduce__`` payload runs ``os.system`` as easily as it rebuilds
a tensor). DeepSpeed loads its own files with ``torch.load(weights_only=False)``, so before
anything of a checkpoint is unpickled, :func:`scan_checkpoint` reads the opcodes of every
pickle in it (no object is built, no tensor byte is read) and refuses a file that names any
global outside the allow-list below: the torch, numpy and DeepSpeed types that Anneal's own
checkpoints hold. :func:`safe_globals` gives the same non-torch types to
``torch.serialization.safe_globals`` for readers that use ``torch.load(weights_only=True)``.

Torch-free at import: the scan is the standard library's ``pickletools`` over the zip.
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path

from anneal.errors import UserError

# (module, name) pairs, or (module, "*") for every name in a module of plain types.
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "complex"),
        ("builtins", "bytearray"),
        ("__builtin__", "set"),
        ("__builtin__", "frozenset"),
        ("__builtin__", "slice"),
        ("__builtin__", "complex"),
        ("__builtin__", "bytearray"),
        ("_codecs", "encode"),  # how protocol 2 spells bytes (numpy's arrays)
        ("torch", "Tensor"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._utils", "_rebuild_parameter_with_state"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch", "dtype"),
        ("torch", "*Storage"),  # FloatStorage, BFloat16Storage, ... and UntypedStorage
        ("torch", "float32"),
        ("torch", "float16"),
        ("torch", "bfloat16"),
        ("torch", "int64"),
        ("torch", "int32"),
        ("torch", "uint8"),
        ("torch", "bool"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.dtypes", "*DType"),  # UInt32DType, Float64DType, ...
        ("argparse", "Namespace"),
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
        ("deepspeed.utils.tensor_fragment", "fragment_address"),
        ("deepspeed.checkpoint.constants", "*"),
    }
)

_STRING_OPS = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}


def allowed(module: str, name: str) -> bool:
    if (module, name) in ALLOWED or (module, "*") in ALLOWED:
        return True
    return any(m == module and pat.startswith("*") and name.endswith(pat[1:]) for m, pat in ALLOWED)


def pickle_globals(data: bytes) -> list[tuple[str, str]]:
    """Every (module, name) a pickle would import, from its opcodes alone.

    The stack is simulated from each opcode's declared effect (``pickletools``), tracking only
    strings, so that ``STACK_GLOBAL`` gets the two names it would really take, through the memo
    and through any ``POP`` or ``DUP`` in between. A name that cannot be told is reported as
    ``("?", "?")``, which no allow-list holds. Raises ``ValueError`` for bytes that are not a
    whole pickle.
    """
    mark = object()
    found: list[tuple[str, str]] = []
    stack: list[object] = []
    memo: dict[int, object] = {}

    def pop(n: int) -> list[object]:
        if n > len(stack):
            raise ValueError("stack underflow")
        taken = stack[len(stack) - n :]
        del stack[len(stack) - n :]
        return taken

    for op, arg, _pos in pickletools.genops(data):
        name, before, after = op.name, op.stack_before, op.stack_after
        if name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
            continue
        if name in _PUT_OPS:
            memo[int(arg)] = stack[-1] if stack else None
            continue
        if pickletools.markobject in before:
            if mark not in stack:
                raise ValueError("no mark on the stack")
            while stack.pop() is not mark:
                pass
            pop(before.index(pickletools.markobject))
        else:
            taken = pop(len(before))
            if name == "STACK_GLOBAL":
                ok = all(isinstance(v, str) for v in taken)
                found.append((taken[0], taken[1]) if ok else ("?", "?"))
            elif name == "DUP":
                stack.extend(taken * 2)
                continue
        if name in _STRING_OPS:
            stack.append(arg if isinstance(arg, str) else None)
        elif name in _GET_OPS:
            stack.append(memo.get(int(arg)))
        elif name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            found.append((module, attr))
            stack.append(None)
        elif name in ("EXT1", "EXT2", "EXT4"):
            found.append(("copyreg extension", str(arg)))
            stack.append(None)
        else:
            stack.extend(mark if a is pickletools.markobject else None for a in after)
    return found


def scan_file(path: Path) -> None:
    """Refuse a torch checkpoint file whose pickles name a global outside the allow-list."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            pickles = [n for n in z.namelist() if n.endswith(".pkl")]
            if not pickles:
                raise zipfile.BadZipFile("no pickle inside")
            for member in pickles:
                _check(path, member, z.read(member))
    except zipfile.BadZipFile as e:
        raise UserError(
            f"{path}: not a torch checkpoint in the zip format torch.save writes ({e}), so it "
            f"is not loaded. Use a checkpoint that Anneal wrote, or resave it with torch.save."
        ) from None


def _check(path: Path, member: str, data: bytes) -> None:
    try:
        names = pickle_globals(data)
    except ValueError as e:
        raise UserError(
            f"{path}: {member} is not a whole pickle ({e}), so the checkpoint is not loaded. "
            f"Use another checkpoint (--resume PATH or --tag), or copy this one again."
        ) from None
    bad = sorted({f"{m}.{n}" for m, n in names if not allowed(m, n)})
    if bad:
        raise UserError(
            f"{path}: refers to {', '.join(bad)}, which a checkpoint of Anneal's never holds; "
            f"loading it could run code, so it is not loaded. Use a checkpoint from a source "
            f"you trust (--resume PATH or --tag), or inspect the file without unpickling it."
        )


def scan_checkpoint(tag_dir: Path, *, skip_hidden: bool = False) -> None:
    """:func:`scan_file` for every ``*.pt`` file in a checkpoint's tag directory.

    ``skip_hidden``: not a file under a hidden name, such as the leftover of an interrupted
    universal conversion (``.universal.tmp``), for a reader that loads only what DeepSpeed names
    and so never reads it (resume). Export reads what its glob finds, hidden names included, so
    it scans them all."""
    tag_dir = Path(tag_dir)
    for path in sorted(tag_dir.rglob("*.pt")):
        if skip_hidden and any(part.startswith(".") for part in path.relative_to(tag_dir).parts):
            continue
        scan_file(path)


def safe_globals() -> list:
    """The non-torch types of the allow-list, as objects for ``torch.serialization.safe_globals``
    (DeepSpeed's imported only here)."""
    import argparse
    import collections

    import numpy as np
    from deepspeed.runtime.zero.config import ZeroStageEnum

    objs: list = [
        argparse.Namespace,
        collections.OrderedDict,
        collections.defaultdict,
        ZeroStageEnum,
        np.ndarray,
        np.dtype,
        np.dtypes.UInt32DType,
        np.dtypes.Float64DType,
        np.dtypes.Float32DType,
        np.dtypes.Int64DType,
    ]
    from numpy._core.multiarray import _reconstruct, scalar

    objs += [_reconstruct, scalar]
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

        objs += [LossScaler, DynamicLossScaler]
    except ImportError:
        pass
    try:
        from deepspeed.utils.tensor_fragment import fragment_address

        objs.append(fragment_address)
    except ImportError:
        pass
    return objs
