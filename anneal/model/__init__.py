"""The model: presets by name (``presets``), the shape they give (``shape``), the transformers
model built from a shape with its init and AdamW groups (``build``), and its parameter and FLOP
counts (``counts``). Dense presets are Llama-style; the sparse ones are Qwen3-MoE decoders.
Nothing here imports DeepSpeed or reads the rank."""

from anneal.model.attention import Attention
from anneal.model.build import (
    build_model,
    hf_model_config,
    init_weights_,
    is_decayed,
    llama_config,
    model_class,
    param_groups,
    qwen3_moe_config,
)
from anneal.model.counts import active_params, count_params, flops_per_token, human_count
from anneal.model.muon import describe_split, muon_param_groups, takes_muon
from anneal.model.presets import PRESETS, PRETRAINED, get_preset
from anneal.model.shape import (
    NOMINAL_VOCAB,
    SHAPE_SIZES,
    ModelPreset,
    MoeShape,
    preset_from_dict,
)

__all__ = [
    "NOMINAL_VOCAB",
    "PRESETS",
    "PRETRAINED",
    "SHAPE_SIZES",
    "Attention",
    "ModelPreset",
    "MoeShape",
    "active_params",
    "build_model",
    "count_params",
    "flops_per_token",
    "get_preset",
    "hf_model_config",
    "human_count",
    "init_weights_",
    "describe_split",
    "muon_param_groups",
    "takes_muon",
    "is_decayed",
    "llama_config",
    "model_class",
    "param_groups",
    "preset_from_dict",
    "qwen3_moe_config",
]
