"""The experts of a sparse model under their two sets of names.

transformers' Qwen3-MoE model holds each layer's experts fused: ``mlp.experts.gate_up_proj
[E, 2I, H]`` (every expert's gate rows, then its up rows) and ``mlp.experts.down_proj
[E, H, I]``. Its ``save_pretrained``, and the Hub's releases (Qwen3-30B-A3B), hold one matrix
per expert and projection instead: ``mlp.experts.{e}.gate_proj.weight [I, H]``,
``up_proj.weight [I, H]`` and ``down_proj.weight [H, I]``; transformers' conversion mapping
for qwen2_moe and qwen3_moe turns them into the fused ones when it loads
(``MergeModulelist(dim=0)``, then ``Concatenate(dim=1)`` of gate and up). The export writes the
per-expert names (``saved_shapes``: what save_pretrained writes and every reader of the Hub's
layout expects); ``--init-from`` reads either (``fused_shapes``, ``parts``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

_PER_EXPERT = re.compile(
    r"(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight"
)


def per_expert(prefix: str, expert: int, proj: str) -> str:
    """The saved name of one expert's ``proj`` (gate_proj, up_proj, down_proj) under
    ``prefix`` (``model.layers.L.mlp.experts``)."""
    return f"{prefix}.{expert}.{proj}.weight"


def _fused(name: str) -> tuple[str, str] | None:
    """(prefix, gate_up_proj or down_proj) of a fused experts parameter, else None."""
    prefix, _, last = name.rpartition(".")
    if prefix.endswith(".experts") and last in ("gate_up_proj", "down_proj"):
        return prefix, last
    return None


def saved_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A fused model's parameter shapes under the names save_pretrained writes."""
    out = {}
    for name, shape in shapes.items():
        fused = _fused(name)
        if fused is None:
            out[name] = shape
        elif fused[1] == "gate_up_proj":
            n, rows, width = shape
            for e in range(n):
                out[per_expert(fused[0], e, "gate_proj")] = (rows // 2, width)
                out[per_expert(fused[0], e, "up_proj")] = (rows // 2, width)
        else:
            n, width, inter = shape
            out |= {per_expert(fused[0], e, "down_proj"): (width, inter) for e in range(n)}
    return out


def parts(name: str, experts: int) -> list[list[str]]:
    """The saved names a fused parameter is made of: for gate_up_proj, every expert's
    gate_proj, then every expert's up_proj (stacked, then concatenated along the rows); for
    down_proj, every expert's down_proj (stacked)."""
    prefix, last = _fused(name)
    projs = ("gate_proj", "up_proj") if last == "gate_up_proj" else ("down_proj",)
    return [[per_expert(prefix, e, proj) for e in range(experts)] for proj in projs]


def fused_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Weight files' shapes with each layer's complete set of per-expert matrices (experts
    0..n-1, each with gate, up and down of one shape) under the fused names of transformers'
    model; anything else, an incomplete set included, as it is (the fit check names it)."""
    groups: dict[str, dict[str, dict[int, tuple]]] = {}
    out = {}
    for name, shape in shapes.items():
        if m := _PER_EXPERT.fullmatch(name):
            groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = shape
        else:
            out[name] = shape
    for prefix, projs in groups.items():
        fused = _fuse(projs)
        if fused is None:
            out |= {per_expert(prefix, e, p): s for p, d in projs.items() for e, s in d.items()}
        else:
            out[f"{prefix}.gate_up_proj"], out[f"{prefix}.down_proj"] = fused
    return out


def _fuse(projs: dict[str, dict[int, tuple]]) -> tuple[tuple, tuple] | None:
    gate, up, down = (projs.get(p, {}) for p in ("gate_proj", "up_proj", "down_proj"))
    n = len(gate)
    if not n or set(gate) != set(range(n)) or not set(gate) == set(up) == set(down):
        return None
    if len({*gate.values(), *up.values()}) != 1 or len(set(down.values())) != 1:
        return None
    if len(gate[0]) != 2 or len(down[0]) != 2:
        return None
    (inter, width), (width_down, inter_down) = gate[0], down[0]
    return (n, 2 * inter, width), (n, width_down, inter_down)


def fused_loaders(loaders: dict[str, Callable]) -> dict[str, Callable]:
    """``loaders`` (name -> a function that reads the tensor) with each layer's per-expert
    matrices under the fused names of transformers' model, each fused tensor assembled from its
    parts (``parts``) when it is read; other names as they are."""
    out, experts = {}, {}
    for name, load in loaders.items():
        if m := _PER_EXPERT.fullmatch(name):
            experts.setdefault(m["prefix"], set()).add(int(m["e"]))
        else:
            out[name] = load
    for prefix, found in experts.items():
        for fused in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj"):
            out[fused] = functools.partial(_assemble, loaders, parts(fused, len(found)))
    return out


def _assemble(loaders: dict[str, Callable], groups: list[list[str]]):
    import torch

    return torch.cat([torch.stack([loaders[n]() for n in group]) for group in groups], 1)
