"""The expert layout of a sparse model: DeepSpeed's AutoEP, filled into the ds_config and
described at start (its layout checked with the others before any process starts,
``anneal.resolution.layout_check``).

A sparse preset (``anneal.model``: Qwen3-MoE) always trains through AutoEP, at
``"autoep_size": 1`` too (every rank holds every expert and no token leaves its rank), so that the
expert layer, its routing and its checkpoint files are the same at every degree. With
``--set ds.expert_parallel.autoep_size=N`` each layer's E experts are dealt out E/N to the ranks
of each group of N consecutive ranks, and the tokens each rank routes travel to the rank that
holds their expert and back (two all-to-alls per layer). The dense weights stay whole on every
rank and every rank still reads its own samples: the data-parallel size stays the world size,
and so does the batch arithmetic. ZeRO then shards each expert's optimizer state over the
world / N ranks that hold a copy of that expert.

Every ZeRO stage trains a sparse model. At ZeRO-3 AutoEP partitions each expert's weights, like
its optimizer state, over the world / N ranks that hold that expert, and saves them inside each
rank's own ZeRO files (its ``"zero3_partitioned"`` checkpoint format; ZeRO-0/1/2 write
one file per expert), which the manifest lists and hashes like any other file and
``anneal.hf.autoep`` exports.

Refused before any process starts, each with its reason (``anneal.model.layout_rules``, in
the launch's words ``anneal.resolution.layout_check``): expert parallelism on a dense model, a
degree that does not divide the experts or the data-parallel ranks, and the combinations that
DeepSpeed 0.19.8's AutoEP refuses or that Anneal has not run: with tensor or sequence
parallelism (AutoEP refuses both under ZeRO-3) and with offload; and here, as the section is
filled, another AutoEP preset than Qwen3-MoE's. Aux-loss-free balancing
(``load_balance_coeff``) and expert tensor parallelism (``expert_tensor_parallel_size``, which
AutoEP refuses under ZeRO-3) are refused by the schema (``anneal.config.ds_schema``); the other
ZeRO-3 features AutoEP refuses (MiCS, hpZeRO, quantized gradients) are no keys of it.
"""

from __future__ import annotations

from anneal.config.ds_schema import degrees
from anneal.errors import UserError
from anneal.model import ModelPreset

PRESET_MODEL = "qwen3_moe"
"""The AutoEP preset of Anneal's sparse models (transformers' Qwen3-MoE; it also covers the
fused expert layout of Qwen2-MoE)."""
AUTOEP_PRESETS = ("mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3")
"""The presets of DeepSpeed 0.19.8's AutoEP, for the message that refuses the others."""


def fill_expert_parallel(ds: dict, preset: ModelPreset, *, device_type: str, source: str) -> dict:
    """``ds`` with its ``expert_parallel`` section filled in for a sparse model (AutoEP on,
    Qwen3-MoE's preset, ``autoep_size`` 1 unless given, grouped GEMMs on a GPU with bf16 and
    the plain expert loop elsewhere); a dense model's unchanged. UserError for the section on a
    dense model or another preset."""
    section = ds.get("expert_parallel")
    if preset.moe is None:
        if isinstance(section, dict) and section.get("enabled"):
            raise UserError(
                f"{source}: expert_parallel.enabled is true, but the model "
                f"({preset.name}) is dense: it has no experts to share out. Train a sparse "
                f"preset (--set model.preset=tiny-moe, olmoe-1b-7b or qwen3-30b-a3b; "
                f"recipes/pretrain_moe_*.py), or drop the section (--set "
                f"ds.expert_parallel.enabled=false)."
            )
        return ds
    filled = dict(section or {})
    if filled.get("enabled") is False:
        raise UserError(
            f"{source}: expert_parallel.enabled is false, but the model ({preset.name}) is "
            f"sparse, and Anneal trains every sparse model through DeepSpeed's AutoEP (at "
            f"autoep_size 1 every rank holds all experts). Drop the key, or set it to true."
        )
    chosen = filled.get("preset_model", PRESET_MODEL)
    if chosen != PRESET_MODEL:
        others = ", ".join(p for p in AUTOEP_PRESETS if p != PRESET_MODEL)
        raise UserError(
            f"{source}: expert_parallel.preset_model is {str(chosen)[:40]!r}, but Anneal's "
            f"sparse models are Qwen3-MoE decoders, AutoEP's preset {PRESET_MODEL!r}. DeepSpeed "
            f"0.19.8's AutoEP also has presets for {others}; Anneal builds and exports only "
            f"Qwen3-MoE (and Qwen2-MoE checkpoints through --init-from). Drop the key."
        )
    bf16 = bool(ds.get("bf16", {}).get("enabled"))
    filled = {
        "enabled": True,
        "autoep_size": 1,
        "preset_model": PRESET_MODEL,
        "use_grouped_mm": device_type == "cuda" and bf16,
        **filled,
    }
    return {**ds, "expert_parallel": filled}


def describe_experts(ds: dict, preset: ModelPreset, *, world_size: int) -> str | None:
    """How experts and tokens are laid out, printed at start; None for a dense model."""
    if preset.moe is None:
        return None
    moe, ep = preset.moe, degrees(ds).ep
    head = (
        f"experts: {moe.num_experts} per layer x {preset.num_hidden_layers} layers, top-"
        f"{moe.top_k} per token (AutoEP, preset {PRESET_MODEL}); "
    )
    if ep == 1:
        return head + "every rank holds all of them; tokens stay on their rank"
    return head + (
        f"expert-parallel {ep}: each rank holds {moe.num_experts // ep} experts of every "
        f"layer, {world_size // ep} cop{'y' if world_size == ep else 'ies'} of each expert "
        f"over the {world_size} ranks; tokens go all-to-all within each group of {ep} ranks; "
        f"data-parallel {world_size} (every rank reads its own samples)"
    )
