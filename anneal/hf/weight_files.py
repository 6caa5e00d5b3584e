"""The weight files of a Hugging Face model directory (``--init-from DIR``), read as input from
elsewhere: which files (``weight_files``, save_pretrained's names), where a link among them may
lead (``check_links``), each safetensors header checked as the format requires
(``safetensors_header``), and the shapes they hold (``weight_shapes``), which
``anneal.hf.load`` compares with the model of ``config.json`` before anything is allocated.
``anneal.hf.load_weights`` then reads the tensors, each checked finite as it is read
(``check_finite``).

Links: a file of the directory may be a link that resolves inside the directory or, when the
directory is a snapshot of the Hugging Face hub cache (``<cache>/snapshots/<revision>/``, as
``huggingface_hub`` downloads a model), one that resolves to a file directly in that cache's
own ``blobs/`` (``<cache>/blobs/<hash>``, where the hub keeps the bytes its snapshots link
to). A link anywhere else is refused, so that no other file of the machine is read as the
model's.

Safetensors: as the format requires (and the ``safetensors`` library checks), the header's
tensors, sorted by their byte ranges, tile the data buffer exactly: the first begins at 0,
each begins where the one before it ended, the last ends at the end of the file, and each
range holds dtype x shape bytes. Overlapping ranges would give two tensors the same bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path, PurePosixPath

from anneal.errors import UserError
from anneal.files import confined

SAFETENSORS = ("model.safetensors.index.json", "model.safetensors")
PICKLED = ("pytorch_model.bin.index.json", "pytorch_model.bin")
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
"""safetensors dtypes that cast to the training dtype; anything else (integers, packed or
float8 formats) is a quantized checkpoint."""
FINITE_CHUNK = 1 << 24
"""Elements of a tensor checked finite at a time (``check_finite``): where a chunk's sum is not
finite, its mask is at most 16 MiB, whatever the tensor's size."""
COMPUTED = ("rotary_emb.inv_freq",)
"""Buffers some older checkpoints saved, which the model computes from its config."""


def error(directory: Path, text: str) -> UserError:
    return UserError(f"--init-from {directory}: {text}", every_rank=True)


# --- links -----------------------------------------------------------------------------------


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def hub_blobs(directory: Path) -> Path | None:
    """``<cache>/blobs`` when ``directory`` (links followed) is ``<cache>/snapshots/<rev>`` of
    a hub cache whose ``blobs/`` is a directory and not a link; None otherwise."""
    real = _real(directory)
    if real.parent.name != "snapshots":
        return None
    blobs = real.parent.parent / "blobs"
    return blobs if blobs.is_dir() and not blobs.is_symlink() else None


def _resolves_inside(path: Path, root: Path, blobs: Path | None) -> bool:
    real = _real(path)
    return root in real.parents or (blobs is not None and real.parent == blobs)


def _outside(directory: Path, name: str, blobs: Path | None) -> UserError:
    where = f"inside it or into {blobs} (its hub cache's blobs/)" if blobs else "inside it"
    return error(
        directory,
        f"{name} is a link to {_real(directory / name)}, outside the directory. Only links "
        f"that resolve {where} are followed, so that no other file of this machine is read "
        f"as the model's. Copy the file into the directory (cp -L), or give the snapshot "
        f"directory of a Hugging Face hub cache as huggingface_hub wrote it.",
    )


def check_links(directory: Path) -> None:
    """Every entry of ``directory`` that is a link resolves inside it or into its hub cache's
    ``blobs/``; UserError naming the first that does not."""
    root, blobs = _real(directory), hub_blobs(directory)
    try:
        entries = sorted(directory.iterdir())
    except OSError as e:
        msg = f"cannot list it ({e.strerror}). Give a directory you can read."
        raise error(directory, msg) from None
    for entry in entries:
        if entry.is_symlink() and not _resolves_inside(entry, root, blobs):
            raise _outside(directory, entry.name, blobs)


def _plain(name: object) -> bool:
    """A relative path without ``..``, a NUL or a backslash (what an index may name)."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


def _in_place(directory: Path, name: object, *, where: str) -> Path:
    """``directory / name``, refused unless ``name`` is a plain relative path that resolves
    inside ``directory`` or into its hub cache's ``blobs/``."""
    if not _plain(name):
        confined(directory, name, where=where)  # refuses it, naming the entry
    path = directory / str(name)
    if not _resolves_inside(path, _real(directory), hub_blobs(directory)):
        raise _outside(directory, str(name), hub_blobs(directory))
    return path


# --- which files -----------------------------------------------------------------------------


def weight_files(directory: Path) -> list[Path]:
    """The weight files, as save_pretrained names them: safetensors (one file, or shards named
    by ``model.safetensors.index.json``), else ``pytorch_model.bin`` the same way; each, and
    the index, where its links may lead."""
    for index_name, single in (SAFETENSORS, PICKLED):
        index = directory / index_name
        if index.is_file():
            _in_place(directory, index_name, where=str(directory))
            return _indexed(directory, index)
        if (directory / single).is_file():
            return [_in_place(directory, single, where=str(directory))]
    raise error(
        directory,
        "holds no weights (model.safetensors, model-0000x-of-0000n.safetensors with "
        "model.safetensors.index.json, or pytorch_model.bin). Copy the weight files of the "
        "release into it, or give the directory save_pretrained wrote.",
    )


def _indexed(directory: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise error(
            directory,
            f"{index.name} is not an index save_pretrained writes ({e!r:.80})."
            " Restore it from where the model came from.",
        ) from None
    files = [_in_place(directory, n, where=f"{index}, weight_map") for n in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise error(
            directory,
            f"{index.name} names {len(missing)} weight file(s) that are not there "
            f"({', '.join(missing[:3])}): a download that stopped. Copy the missing files.",
        )
    return files


# --- safetensors headers ---------------------------------------------------------------------


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors of a safetensors file: name -> dtype, shape and the absolute byte range of
    its data (``start``, ``end``). Refused when the header is not one (a damaged file), when
    its byte ranges do not tile the data as the format requires (overlapping, with gaps, or
    past the end: a file edited or cut), or when a dtype is not a float (a quantized
    checkpoint)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        try:
            header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
            tensors = {k: _entry(v, 8 + n) for k, v in header.items() if k != "__metadata__"}
            meta = header.get("__metadata__", {})
            meta_ok = isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
        except (
            UnicodeDecodeError,
            ValueError,
            RecursionError,
            TypeError,
            KeyError,
            AttributeError,
        ):
            raise error(
                path.parent,
                f"{path.name} is not a safetensors file (its header cannot be read): "
                f"truncated or damaged. Copy it again.",
            ) from None
    if not meta_ok:
        raise error(
            path.parent,
            f"{path.name} is not a safetensors file (its header's __metadata__ is not a map of "
            f"strings): damaged or edited. Copy it again.",
        )
    _check_layout(path, tensors, data_start=8 + n, size=size)
    odd = sorted({v["dtype"] for v in tensors.values()} - set(FLOAT_DTYPES))
    if odd:
        raise error(
            path.parent,
            f"{path.name} holds tensors of dtype {', '.join(odd)}, which cannot be cast to the "
            f"training dtype (a quantized checkpoint). Give the bf16, fp16 or fp32 release.",
        )
    return tensors


def _entry(v: dict, data_start: int) -> dict:
    """One header entry, its offsets made absolute; ValueError when it is inconsistent."""
    shape = [int(d) for d in v["shape"]]
    lo, hi = (int(x) for x in v["data_offsets"])
    width = FLOAT_DTYPES.get(v["dtype"])
    if (
        min(shape, default=0) < 0
        or not 0 <= lo <= hi
        or (width and hi - lo != width * math.prod(shape))
    ):
        raise ValueError("inconsistent tensor entry")
    return {
        "dtype": str(v["dtype"]),
        "shape": shape,
        "start": data_start + lo,
        "end": data_start + hi,
    }


def _check_layout(path: Path, tensors: dict[str, dict], *, data_start: int, size: int) -> None:
    """The byte ranges, sorted, tile ``[data_start, size)`` exactly, as the safetensors format
    requires (the library's own check: "invalid offset", "file not fully covered")."""
    end = data_start
    for name, v in sorted(tensors.items(), key=lambda kv: (kv[1]["start"], kv[1]["end"])):
        if v["start"] != end:
            what = "overlaps the tensor before it" if v["start"] < end else "leaves a gap"
            raise error(
                path.parent,
                f"{path.name}: the byte range of tensor {name} ([{v['start'] - data_start}, "
                f"{v['end'] - data_start}) of its data) {what}; the safetensors format "
                f"requires the ranges to follow each other without overlap or gap, so two "
                f"tensors would read the same bytes. The file was edited or damaged: copy it "
                f"again from where the model came from.",
            )
        end = v["end"]
    if size < end:
        raise error(
            path.parent,
            f"{path.name} holds {size:,} bytes and its header promises {end:,}: a truncated "
            f"copy. Copy it again.",
        )
    if size > end:
        raise error(
            path.parent,
            f"{path.name} holds {size - end:,} bytes past its last tensor, which the "
            f"safetensors format does not allow: the file was edited or damaged. Copy it "
            f"again from where the model came from.",
        )


# --- shapes and values -----------------------------------------------------------------------


def load_pickled(directory: Path, path: Path) -> dict:
    """A ``.bin`` state dict, read by torch's weights-only loader
    (``anneal.resilience.safeload.load``: a zip archive from byte 0, only allowed classes),
    its tensors memory-mapped (nothing read but the pickle until a tensor is used)."""
    import torch

    from anneal.resilience import safeload

    try:
        state = safeload.load(path, map_location="cpu", mmap=True)
    except UserError as e:
        raise error(
            directory,
            f"{path.name}: {e} Prefer the release's .safetensors files, which hold no code.",
        ) from None
    bad = (
        [n for n, t in state.items() if not torch.is_tensor(t) or not t.is_floating_point()]
        if isinstance(state, dict)
        else [type(state).__name__]
    )
    if bad:
        raise error(
            directory,
            f"{path.name} holds entries that are not floating-point tensors "
            f"({', '.join(map(str, bad[:3]))}): not a model's state dict, or quantized weights "
            f"that cannot be cast for training. Give the bf16, fp16 or fp32 release.",
        )
    return state


def weight_shapes(directory: Path, files: list[Path]) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in ``files``, each file checked whole and readable
    without running code (safetensors headers; ``.bin`` pickles through torch's weights-only
    loader, tensors mapped), no tensor named in two files."""
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for path in files:
        if path.suffix == ".safetensors":
            found = {n: tuple(v["shape"]) for n, v in safetensors_header(path).items()}
        else:
            found = {n: tuple(t.shape) for n, t in load_pickled(directory, path).items()}
        for name, shape in found.items():
            if name in shapes:
                raise twice(directory, name, where[name], path.name)
            shapes[name], where[name] = shape, path.name
    return shapes


def twice(directory: Path, name: str, first: str, second: str) -> UserError:
    return error(
        directory,
        f"the tensor {name} is in two weight files ({first} and {second}), so which one "
        f"is the model's is unknown. Give the directory save_pretrained wrote, unchanged.",
    )


def check_fit(
    directory: Path, want: dict[str, tuple], tied: set[str], have: dict[str, tuple]
) -> None:
    """Every parameter of the model (``want``: name -> shape, a tied matrix once) is in the
    files (``have``) with its shape; nothing else is there besides buffers the model computes
    and the names ``tied`` to a matrix listed once."""
    names = {n for n in have if not n.endswith(COMPUTED) and n not in tied}
    missing, extra = sorted(set(want) - names), sorted(names - set(want))
    differ = [f"{n} {have[n]} (model {want[n]})" for n in want if n in names and have[n] != want[n]]
    if missing or extra or differ:
        raise error(
            directory,
            f"the weight files do not fit the model its config.json describes (missing "
            f"{missing[:3]}, unexpected {extra[:3]}, other shapes {differ[:3]}): a config.json "
            f"of another model, or weights converted with other names. Give the directory "
            f"save_pretrained wrote, unchanged.",
        )


def check_finite(tensor, directory: Path, path: Path, name: str) -> None:
    """UserError naming the file and the tensor when ``tensor`` holds a NaN or an infinity.
    ``FINITE_CHUNK`` elements at a time: a chunk whose sum is finite holds no NaN or infinity
    (either would make the sum one), a reduction that allocates nothing (2 to 6 GB/s on the
    2-core test machine, against 0.1 to 0.5 for a mask); only a chunk whose sum is not finite
    (a non-finite value, or finite values that overflow the sum) is checked element by
    element."""
    import torch

    flat = tensor.reshape(-1)
    for i in range(0, flat.numel(), FINITE_CHUNK):
        chunk = flat[i : i + FINITE_CHUNK]
        if bool(torch.isfinite(chunk.sum())) or bool(torch.isfinite(chunk).all()):
            continue
        raise error(
            directory,
            f"{path.name}: the tensor {name} holds NaN or infinite values, so every loss "
            f"would be NaN and no step could train. The weights were saved after training "
            f"diverged, or the file is damaged: give another checkpoint of the model, or "
            f"copy this one again.",
        )
