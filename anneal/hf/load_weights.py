"""The weights of a Hugging Face checkpoint copied into the training model, one module at a
time (``load_pretrained_``), for ``model.init_from`` (``anneal.hf.load`` read and checked the
directory when the launch was resolved).

Nothing holds the whole model: each safetensors tensor is read from its byte range (the
header's offsets, ``anneal.hf.weight_files.safetensors_header``) with ``readinto`` when its
module's turn comes, not mapped (a mapping would leave the file's pages in the resident set),
and checked finite as it is read (``check_finite``, a chunk at a time: a NaN or an infinity
stops the load with a paragraph naming the file and the tensor). ``.bin``
files are loaded by torch's weights-only loader (``anneal.resilience.safeload.load``,
``mmap=True``): mapped, so their pages do stay resident as they
are read; prefer safetensors. Under ZeRO-3 the model was built partitioned
(``deepspeed.zero.Init``): each module's parameters are gathered in turn
(``GatheredParameters(modifier_rank=0)``, as ``gather``), the first rank of their partition
group (rank 0; under tensor parallelism, the first of each tensor-parallel rank's data-parallel
group) reads and copies the tensors, and leaving the context sends each rank its partition, so a
rank holds its partitions plus one module whole. Under ZeRO-0/1/2 every rank reads each tensor
into its own copy.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from anneal.hf.expert_names import fused_shapes, parts
from anneal.hf.weight_files import (
    check_finite,
    check_fit,
    error,
    load_pickled,
    safetensors_header,
    twice,
    weight_files,
)

_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


class _Tensors:
    """name -> where the tensor is: a byte range of a safetensors file (read with ``readinto``
    when its module's turn comes), or a mapped ``.bin`` state dict. A sparse model's experts
    saved one matrix each (``anneal.hf.expert_names``) are also found under the fused names of
    the model, each fused tensor read from its parts."""

    def __init__(self, directory: Path, stack: contextlib.ExitStack):
        self.directory = directory
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, tuple] = {}
        for path in weight_files(directory):
            if path.suffix == ".safetensors":
                f = stack.enter_context(open(path, "rb"))  # noqa: SIM115 - closed by the stack
                found = {name: (f, info) for name, info in safetensors_header(path).items()}
            else:
                state = load_pickled(directory, path)
                found = {name: (state, None) for name in state}
            for name, (source, info) in found.items():
                if name in self._where:
                    raise twice(directory, name, self._where[name][0].name, path.name)
                self.shapes[name] = tuple(info["shape"] if info else source[name].shape)
                self._where[name] = (path, source, info)
        self.shapes = fused_shapes(self.shapes)

    def read(self, name: str) -> torch.Tensor:
        """The tensor, in the file's dtype, checked finite; a fused experts tensor stacked from
        its parts (``anneal.hf.expert_names.parts``)."""
        if name in self._where:
            return self._read(name)
        groups = parts(name, self.shapes[name][0])
        return torch.cat([torch.stack([self._read(n) for n in group]) for group in groups], 1)

    def _read(self, name: str) -> torch.Tensor:
        """One tensor of the files: one read straight into a new tensor (not a mapping of the
        file, which would leave its pages in the process's resident set)."""
        path, source, info = self._where[name]
        if info is None:
            out = source[name]
        else:
            out = torch.empty(info["shape"], dtype=_TORCH_DTYPES[info["dtype"]])
            source.seek(info["start"])
            n = info["end"] - info["start"]
            if n and source.readinto(memoryview(out.view(-1).view(torch.uint8).numpy())) != n:
                raise error(
                    self.directory,
                    f"{path.name} ended inside {name} (truncated since the launch was "
                    f"checked). Copy it again.",
                )
        check_finite(out, self.directory, path, name)
        return out


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's real shape (under ZeRO-3 ``p`` is a partition; ``ds_shape`` is whole)."""
    shape = getattr(p, "ds_shape", None)
    return tuple(shape if shape is not None else p.shape)


def _check_tensor_names(model: torch.nn.Module, tensors: _Tensors) -> None:
    """Every parameter of the model in the files with its shape; nothing else in the files
    besides buffers the model computes and a head tied to the embedding."""
    want = {name: _shape(p) for name, p in model.named_parameters()}  # a tied matrix once
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(want)
    check_fit(tensors.directory, want, tied, tensors.shapes)


def _first_of_group(p: torch.Tensor) -> bool:
    """Whether this rank is the first of the group ``p`` is partitioned over (ZeRO-3's
    ``ds_process_group``), the rank whose values ``GatheredParameters(modifier_rank=0)`` sends
    to the group: rank 0 of the world, or under tensor parallelism the first rank of each
    tensor-parallel rank's data-parallel group."""
    import torch.distributed as dist

    return dist.get_rank(group=getattr(p, "ds_process_group", None)) == 0


def load_pretrained_(model: torch.nn.Module, directory: Path, *, gather=None) -> dict:
    """Copy the weights in ``directory`` into ``model``'s parameters (cast to their dtype),
    one module at a time (``copy_into_``). Returns counts (tensors, elements, bytes read)."""
    directory = Path(directory)
    with contextlib.ExitStack() as stack:
        tensors = _Tensors(directory, stack)
        _check_tensor_names(model, tensors)
        return copy_into_(model, tensors.read, gather=gather)


def copy_into_(model: torch.nn.Module, read, *, gather=None) -> dict:
    """Copy ``read(name)`` (the whole tensor of each parameter, any float dtype and a shape of
    as many elements) into ``model``, one module at a time; ``gather(params)`` makes a module's
    parameters whole and writable on the first rank of their partition group and partitions
    them again on exit (ZeRO-3; under tensor parallelism each tensor-parallel rank has a group
    of its own), None: each rank writes its copy. A tied parameter is copied once. The caller
    has checked the names and shapes. Returns counts (tensors, elements, bytes read)."""
    done: set[int] = set()
    count = {"tensors": 0, "elements": 0, "bytes_read": 0}
    for prefix, module in model.named_modules():
        params = {
            f"{prefix}.{n}".lstrip("."): p
            for n, p in module.named_parameters(recurse=False)
            if id(p) not in done
        }
        if not params:
            continue
        context = gather(list(params.values())) if gather else contextlib.nullcontext()
        reads = gather is None or _first_of_group(next(iter(params.values())))
        with context, torch.no_grad():
            for name, p in params.items():
                if reads:
                    t = read(name)
                    p.data.copy_(t.view(p.shape).to(p.dtype))
                    count["bytes_read"] += t.numel() * t.element_size()
                    del t
                done.add(id(p))
                count["tensors"] += 1
                count["elements"] += p.ds_numel if hasattr(p, "ds_numel") else p.numel()
    return count
