"""Expert parallelism of a sparse model: DeepSpeed's AutoEP, filled into the ds_config and
checked before any process starts.

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

Refused here, each with its reason, before any process starts: expert parallelism on a dense
model, a degree that does not divide the experts or the data-parallel ranks, and the
combinations that DeepSpeed 0.19.8's AutoEP refuses or that Anneal has not run: with tensor or
sequence parallelism (AutoEP refuses both under ZeRO-3), with offload, and another AutoEP preset
than Qwen3-MoE's. Aux-loss-free balancing (``load_balance_coeff``) and expert tensor parallelism
(``expert_tensor_parallel_size``, which AutoEP refuses under ZeRO-3) are refused by the schema
(``anneal.config.ds_schema``); the other ZeRO-3 features AutoEP refuses (MiCS, hpZeRO,
quantized gradients) are no keys of it.
"""

from __future__ import annotations

from anneal.config.ds_schema import autotp_size, expert_parallel_size, sequence_parallel_size
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


def check_expert_layout(ds: dict, preset: ModelPreset, *, world_size: int, source: str) -> None:
    """UserError, with its reason and what works instead, for an expert-parallel layout that
    cannot run (see the module docstring)."""
    if preset.moe is None:
        return
    ep, experts = expert_parallel_size(ds), preset.moe.num_experts
    tp, sp = autotp_size(ds), sequence_parallel_size(ds)
    zero = ds.get("zero_optimization", {})
    fix = f"Set ds.expert_parallel.autoep_size (now {ep}, from {source} or --set)"
    why = None
    if experts % ep:
        fits = [d for d in range(1, experts + 1) if experts % d == 0 and world_size % d == 0]
        why = (
            f"expert_parallel.autoep_size {ep} does not divide the model's {experts} experts "
            f"per layer: each rank of an expert group holds an equal share of them. {fix} to "
            f"one of {fits}."
        )
    elif world_size % ep:
        why = (
            f"expert_parallel.autoep_size is {ep} but the launch has {world_size} rank(s), which "
            f"do not split into expert groups of {ep}. {fix} to a divisor of {world_size} that "
            f"divides {experts}, or launch a multiple of {ep} ranks."
        )
    elif tp > 1 or sp > 1:
        what = f"tensor_parallel.autotp_size {tp}" if tp > 1 else f"sequence_parallel_size {sp}"
        why = (
            f"a sparse model with {what}: DeepSpeed 0.19.8's AutoEP folds expert parallelism "
            f"into AutoTP's groups only for some presets and layouts, and refuses sequence "
            f"parallelism under ZeRO-3; Anneal has run neither with experts and does not offer "
            f"them. Scale a sparse model with expert and data parallelism: drop {what.split()[0]} "
            f"and use --set ds.expert_parallel.autoep_size=N."
        )
    elif "offload_optimizer" in zero or "offload_param" in zero:
        why = (
            "a sparse model with ZeRO offload: DeepSpeed 0.19.8's AutoEP checks offload only "
            "under its own constraints and Anneal has not run it. Drop "
            "zero_optimization.offload_optimizer / offload_param, and share the experts out "
            "with --set ds.expert_parallel.autoep_size=N instead."
        )
    if why:
        raise UserError(f"{source}: {why}")


def resolve_experts(
    ds: dict, preset: ModelPreset, world_size: int, device_type: str, *, source: str
) -> dict:
    """``fill_expert_parallel`` then ``check_expert_layout``: the ds_config of this launch."""
    ds = fill_expert_parallel(ds, preset, device_type=device_type, source=source)
    check_expert_layout(ds, preset, world_size=world_size, source=source)
    return ds


def describe_experts(ds: dict, preset: ModelPreset, *, world_size: int) -> str | None:
    """How experts and tokens are laid out, printed at start; None for a dense model."""
    if preset.moe is None:
        return None
    moe, ep = preset.moe, expert_parallel_size(ds)
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
