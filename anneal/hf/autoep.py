"""A sparse run's checkpoint read back into transformers' Qwen3-MoE names.

DeepSpeed's AutoEP trains each ``model.layers.L.mlp`` (transformers' ``Qwen3MoeSparseMoeBlock``)
as an ``AutoEPMoELayer``: the router as ``mlp.router.gate.weight [E, H]`` (plus an alias of the
same tensor, ``mlp.gate.gate.weight``, that transformers' router-logit capture looks for), and
the experts as grouped tensors ``experts.w1 [E_local, I, H]`` (gate), ``experts.w3 [E_local, I,
H]`` (up) and ``experts.w2 [E_local, H, I]`` (down), each expert-parallel rank holding its
``E / ep`` experts. A ZeRO-0/1/2 checkpoint keeps the router with the other weights (in the
optimizer's fp32 partitions under ZeRO-1/2) and writes one file per expert
(``anneal.resilience.ds_files.expert_file_name``) holding ``{prefix}.experts.w1.E``, ``w2.E``
and ``w3.E`` as the module holds them; its ``ds_autoep_layers`` entry (in the model states)
names each layer's module, expert count and file number.

AutoEP's import (``deepspeed.moe.ep_repack._repack_fused_3d``) cuts transformers' fused
``experts.gate_up_proj [E, 2I, H]`` into ``w1 = gate_up_proj[:, :I]`` (gate: transformers'
``Qwen3MoeExperts.forward`` takes ``gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)``)
and ``w3 = gate_up_proj[:, I:]`` (up), and takes ``experts.down_proj [E, H, I]`` as ``w2``; the
router becomes ``mlp.gate.weight`` again. ``with_experts`` writes each expert under the names
save_pretrained writes, ``mlp.experts.{e}.gate_proj.weight`` (w1), ``up_proj`` (w3) and
``down_proj`` (w2) (``anneal.hf.expert_names``), which transformers fuses back when it loads,
each expert's bytes read lazily when its tensor is written (a file opened per read).
``reference_to_hf`` builds the fused tensors itself (``torch.cat`` of w1 and w3) with
``torch.load(weights_only=True)`` for the verification: an independent reader and an
independent mapping, checked against transformers' own.

The experts are the expert files' values: the module's weights, fp32 in an fp32 run; in a bf16
run bf16, which are exactly the fp32 master weights rounded (what a bf16 export writes anyway).
At ZeRO-3 AutoEP writes no expert files: ``anneal.hf.autoep_zero3`` reads the experts' fp32
master weights from the ranks' partitions, and the router stays with the other weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from anneal.errors import UserError
from anneal.hf import autoep_zero3
from anneal.hf.expert_names import per_expert
from anneal.hf.reader import Archive, LazyTensor
from anneal.hf.zero import (
    EXPERT_PARAM,
    NOT_A_CHECKPOINT,
    Piece,
    TensorSource,
    ZeroCheckpoint,
    load_weights_only,
)
from anneal.resilience.ds_files import (
    PER_EXPERT_FILES,
    ZERO3_FORMAT,
    checkpoint_files,
    expert_file_name,
)


def _layers(tag_dir: Path, model_state) -> list[dict]:
    """The ``ds_autoep_layers`` of the model states: [] for a dense model; UserError for a
    layout the export does not read (neither per-expert files nor ZeRO-3's partitions)."""
    layers = model_state.get("ds_autoep_layers") if isinstance(model_state, dict) else None
    if not layers:
        return []
    formats = {str(layer.get("checkpoint_format")) for layer in layers}
    if formats not in ({PER_EXPERT_FILES}, {ZERO3_FORMAT}):
        raise UserError(
            f"{tag_dir}: its experts are saved as {', '.join(sorted(formats))}, which anneal "
            f"export does not read; it reads DeepSpeed 0.19.8 AutoEP's per-expert files "
            f"(ZeRO-0/1/2) and its {ZERO3_FORMAT} partitions (ZeRO-3), as Anneal's sparse "
            f"training writes them. Export a checkpoint of an Anneal run (--tag)."
        )
    return layers


def _zero3(layers: list[dict]) -> bool:
    return layers[0].get("checkpoint_format") == ZERO3_FORMAT


def expert_file(tag_dir: Path, layer: dict, expert: int, mp_rank: int = 0) -> Path:
    """DeepSpeed's name of one expert's file (``DeepSpeedEngine._get_expert_ckpt_name``)."""
    return Path(tag_dir) / expert_file_name(layer["moe_layer_id"], expert, mp_rank)


def _router_names(prefix: str) -> tuple[str, str, str]:
    """AutoEP's router, its alias, and transformers' name of the router."""
    return f"{prefix}.router.gate.weight", f"{prefix}.gate.gate.weight", f"{prefix}.gate.weight"


def _in_transformers_names(sources: list[TensorSource], layers: list[dict]) -> list[TensorSource]:
    """The checkpoint's other tensors in transformers' names: each router renamed, its alias
    and any expert parameter left out (the expert files hold those)."""
    rename, drop = {}, set()
    for layer in layers:
        router, alias, hf = _router_names(layer["module_path"])
        rename[router] = hf
        drop.add(alias)
    kept = []
    for s in sources:
        if s.name in drop or EXPERT_PARAM.search(s.name):
            continue
        kept.append(dataclasses.replace(s, name=rename.get(s.name, s.name)))
    missing = set(rename.values()) - {s.name for s in kept}
    if missing:
        raise UserError(f"no router weights for {sorted(missing)[:3]}")
    return kept


def _expert_tensors(path: Path, prefix: str, expert: int, archives: list) -> dict[str, LazyTensor]:
    """w1, w2 and w3 of one expert file, as lazy tensors (the file closed until read)."""
    archive = Archive(path)
    archives.append(archive)
    index = archive.index()
    archive.detach()
    found = {}
    for w in ("w1", "w2", "w3"):
        t = index[f"{prefix}.experts.{w}.{expert}"]
        if not isinstance(t, LazyTensor) or len(t.shape) != 2:
            raise UserError(f"{path.name}: {w} is not a matrix")
        found[w] = t
    return found


def _expert_sources(tag_dir: Path, layer: dict, archives: list) -> list[TensorSource]:
    """One layer's experts under the names save_pretrained writes
    (``anneal.hf.expert_names``): expert ``e``'s ``gate_proj`` is its w1, ``up_proj`` its w3
    and ``down_proj`` its w2, each read from its expert file."""
    prefix, n = layer["module_path"], int(layer["num_experts"])
    experts = [
        _expert_tensors(expert_file(tag_dir, layer, e), prefix, e, archives) for e in range(n)
    ]
    (inter, hidden), dtype = experts[0]["w1"].shape, experts[0]["w1"].dtype
    for e, w in enumerate(experts):
        shapes = {k: tuple(t.shape) for k, t in w.items()}
        if shapes != {"w1": (inter, hidden), "w2": (hidden, inter), "w3": (inter, hidden)}:
            raise UserError(f"expert {e} of {prefix} has shapes {shapes}, unlike expert 0's")
        if {t.dtype for t in w.values()} != {dtype}:
            raise UserError(f"expert {e} of {prefix} is not all {dtype}")
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    return [
        TensorSource(
            per_expert(f"{prefix}.experts", e, names[w]),
            tuple(t.shape),
            dtype,
            (Piece(t, 0, t.numel()),),
        )
        for e, tensors in enumerate(experts)
        for w, t in tensors.items()
    ]


def with_experts(ckpt: ZeroCheckpoint) -> ZeroCheckpoint:
    """``ckpt`` in transformers' Qwen3-MoE names when AutoEP saved it (its model states'
    ``ds_autoep_layers``): the routers renamed, their aliases dropped, and each layer's fused
    experts read lazily from the per-expert files. A dense checkpoint is returned as it is."""
    try:
        layers = _layers(ckpt.tag_dir, ckpt.archives[0].index())
        if not layers:
            return ckpt
        sources = _in_transformers_names(ckpt.sources, layers)
        if _zero3(layers):
            sources += autoep_zero3.expert_sources(ckpt)
        for layer in [] if _zero3(layers) else layers:
            sources += _expert_sources(ckpt.tag_dir, layer, ckpt.archives)
    except UserError as e:
        if str(e).startswith(str(ckpt.tag_dir)):
            raise
        raise _not_autoep_layout(ckpt.tag_dir, str(e)) from None
    except NOT_A_CHECKPOINT as e:
        raise _not_autoep_layout(ckpt.tag_dir, f"{type(e).__name__}: {e}") from None
    return dataclasses.replace(ckpt, sources=sources)


def _not_autoep_layout(tag_dir: Path, why: str) -> UserError:
    return UserError(
        f"{tag_dir}: its expert files are not laid out as DeepSpeed's AutoEP writes them "
        f"({why}); anneal export reads the checkpoints that Anneal's sparse training writes. "
        f"Export another tag (--tag), or copy the checkpoint again from where it was saved."
    )


def reference_to_hf(tag_dir: Path, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``anneal.hf.zero.reference_state_dict``'s weights in transformers' names when AutoEP
    saved the checkpoint, its experts read with ``torch.load(weights_only=True)``; the router's
    alias checked to hold the router's values. Dense: ``sd`` as it is."""
    model_files, _ = checkpoint_files(tag_dir)
    model_state = load_weights_only(model_files[0])
    module = model_state.get("module") or {}
    sd, layers = dict(sd), _layers(tag_dir, model_state)
    grouped = autoep_zero3.reference_experts(tag_dir) if layers and _zero3(layers) else {}
    for layer in layers:
        prefix = layer["module_path"]
        router, alias, hf = _router_names(prefix)
        if alias in module and not torch.equal(module[alias], module[router]):
            raise UserError(f"{tag_dir}: {alias} differs from {router}, which it aliases")
        sd.pop(alias, None)
        sd[hf] = sd.pop(router)
        for w in ("w1", "w2", "w3"):
            sd.pop(f"{prefix}.experts.{w}", None)
        if grouped:  # ZeRO-3: [E, I, H] gate and up, [E, H, I] down
            w1, w2, w3 = (grouped[f"{prefix}.experts.{w}"] for w in ("w1", "w2", "w3"))
            sd[f"{prefix}.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
            sd[f"{prefix}.experts.down_proj"] = w2
            continue
        gate_up, down = [], []
        for e in range(int(layer["num_experts"])):
            f = load_weights_only(expert_file(tag_dir, layer, e))
            key = f"{prefix}.experts.{{}}.{e}"
            gate_up.append(torch.cat([f[key.format("w1")], f[key.format("w3")]], dim=0))
            down.append(f[key.format("w2")])
        sd[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up).float()
        sd[f"{prefix}.experts.down_proj"] = torch.stack(down).float()
    return sd
