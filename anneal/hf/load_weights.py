"""The weights of a Hugging Face checkpoint copied into the training model, one module at a
time (``load_pretrained_``), for ``model.init_from`` (``anneal.hf.load`` read and checked the
directory when the launch was resolved).

Nothing holds the whole model: each safetensors tensor is read from its byte range (the
header's offsets, ``anneal.hf.load.safetensors_header``) with ``readinto`` when its module's
turn comes, not mapped (a mapping would leave the file's pages in the resident set). ``.bin``
files, after ``anneal.resilience.safeload`` scanned them, are loaded with
``torch.load(weights_only=True, mmap=True)``: mapped, so their pages do stay resident as they
are read; prefer safetensors. Under ZeRO-3 the model was built partitioned
(``deepspeed.zero.Init``): each module's parameters are gathered in turn
(``GatheredParameters(modifier_rank=0)``, as ``gather``), rank 0 reads and copies the tensors,
and leaving the context sends each rank its partition, so a rank holds its partitions plus one
module whole. Under ZeRO-0/1/2 every rank reads each tensor into its own copy.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from anneal.dist import rank
from anneal.errors import UserError
from anneal.hf.load import safetensors_header, weight_files

# Buffers some older checkpoints saved, which the model computes from its config.
_COMPUTED = ("rotary_emb.inv_freq",)


_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


class _Tensors:
    """name -> where the tensor is: a byte range of a safetensors file (read with ``readinto``
    when its module's turn comes), or a mapped ``.bin`` state dict."""

    def __init__(self, directory: Path, stack: contextlib.ExitStack):
        self.directory = directory
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, tuple] = {}
        for path in weight_files(directory):
            if path.suffix == ".safetensors":
                f = stack.enter_context(open(path, "rb"))  # noqa: SIM115 - closed by the stack
                for name, info in safetensors_header(path).items():
                    self.shapes[name] = tuple(info["shape"])
                    self._where[name] = (f, info)
            else:
                state = _load_pickled(path)
                for name, tensor in state.items():
                    self.shapes[name] = tuple(tensor.shape)
                    self._where[name] = (state, None)

    def names(self) -> set[str]:
        return set(self._where)

    def read(self, name: str) -> torch.Tensor:
        """The tensor, in the file's dtype: one read straight into a new tensor (not a mapping
        of the file, which would leave its pages in the process's resident set)."""
        source, info = self._where[name]
        if info is None:
            return source[name]
        out = torch.empty(info["shape"], dtype=_TORCH_DTYPES[info["dtype"]])
        source.seek(info["start"])
        n = info["end"] - info["start"]
        if n and source.readinto(memoryview(out.view(-1).view(torch.uint8).numpy())) != n:
            raise UserError(
                f"--init-from {self.directory}: {Path(source.name).name} ended inside {name} "
                f"(truncated since the launch was checked). Copy it again.",
                every_rank=True,
            )
        return out


def _load_pickled(path: Path) -> dict:
    from anneal.resilience import safeload

    with torch.serialization.safe_globals(safeload.safe_globals()):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
            raise UserError(
                f"--init-from {path.parent}: {path.name} cannot be read as a torch state dict "
                f"({str(e).splitlines()[0][:200]}). Use the release's .safetensors files, or "
                f"resave the model with save_pretrained.",
                every_rank=True,
            ) from None
    bad = [n for n, t in state.items() if not torch.is_tensor(t) or not t.is_floating_point()]
    if not isinstance(state, dict) or bad:
        raise UserError(
            f"--init-from {path.parent}: {path.name} holds entries that are not floating-point "
            f"tensors ({', '.join(map(str, bad[:3]))}): not a model's state dict, or quantized "
            f"weights that cannot be cast for training. Give the bf16, fp16 or fp32 release.",
            every_rank=True,
        )
    return state


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's real shape (under ZeRO-3 ``p`` is a partition; ``ds_shape`` is whole)."""
    shape = getattr(p, "ds_shape", None)
    return tuple(shape if shape is not None else p.shape)


def _check_names(model: torch.nn.Module, tensors: _Tensors) -> None:
    """Every parameter of the model in the files with its shape; nothing else in the files
    besides buffers the model computes and a head tied to the embedding."""
    want = {name: _shape(p) for name, p in model.named_parameters()}  # a tied matrix once
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(want)
    have = {n for n in tensors.names() if not n.endswith(_COMPUTED) and n not in tied}
    missing, extra = sorted(set(want) - have), sorted(have - set(want))
    differ = [
        f"{n} {tensors.shapes[n]} (model {want[n]})"
        for n in want
        if n in have and tensors.shapes[n] != want[n]
    ]
    if missing or extra or differ:
        raise UserError(
            f"--init-from {tensors.directory}: the weight files do not fit the model its "
            f"config.json describes (missing {missing[:3]}, unexpected {extra[:3]}, other "
            f"shapes {differ[:3]}): a config.json of another model, or weights converted "
            f"with other names. Give the directory save_pretrained wrote, unchanged.",
            every_rank=True,
        )


def load_pretrained_(model: torch.nn.Module, directory: Path, *, gather=None) -> dict:
    """Copy the weights in ``directory`` into ``model``'s parameters (cast to their dtype),
    one module at a time; ``gather(params)`` makes a module's parameters whole and writable
    on rank 0 and partitions them again on exit (ZeRO-3), None: each rank writes its copy.
    Returns counts (tensors, elements, bytes read)."""
    directory = Path(directory)
    reads = gather is None or rank() == 0
    done: set[int] = set()
    count = {"tensors": 0, "elements": 0, "bytes_read": 0}
    with contextlib.ExitStack() as stack:
        tensors = _Tensors(directory, stack)
        _check_names(model, tensors)
        for prefix, module in model.named_modules():
            params = {
                f"{prefix}.{n}".lstrip("."): p
                for n, p in module.named_parameters(recurse=False)
                if id(p) not in done
            }
            if not params:
                continue
            context = gather(list(params.values())) if gather else contextlib.nullcontext()
            with context, torch.no_grad():
                for name, p in params.items():
                    if reads:
                        t = tensors.read(name)
                        p.data.copy_(t.to(p.dtype))
                        count["bytes_read"] += t.numel() * t.element_size()
                        del t
                    done.add(id(p))
                    count["tensors"] += 1
                    count["elements"] += p.ds_numel if hasattr(p, "ds_numel") else p.numel()
    return count
