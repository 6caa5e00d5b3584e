"""The model presets by name: the Llama-style dense sizes and the sparse (Mixture-of-Experts)
family, and ``get_preset``.

The sparse presets are Qwen3-MoE decoders (``transformers.Qwen3MoeForCausalLM``): DeepSpeed's
AutoEP has a preset for that architecture (``"preset_model": "qwen3_moe"``), so expert
parallelism needs no code of Anneal's, and transformers' Qwen3-MoE computes the router's
load-balancing loss itself (``output_router_logits``). Mixtral, the other architecture with an
AutoEP preset, has no QK-norm and a wider expert per token; Qwen3-MoE is the architecture of
Qwen3-30B-A3B and Qwen3-235B-A22B, and holds OLMoE's shape too (OLMoE's own class, with no
AutoEP preset, differs in its QK-norm over the whole projection).
"""

from __future__ import annotations

from anneal.errors import UserError
from anneal.model.shape import ModelPreset, MoeShape

DENSE = [
    ModelPreset(
        name="tiny",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        seq_len=256,
        nominal_params=None,
        vocab_size=8192,
    ),
    ModelPreset(
        name="125m",
        hidden_size=768,
        intermediate_size=1792,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        seq_len=2048,
        nominal_params=125e6,
    ),
    ModelPreset(
        name="350m",
        hidden_size=1024,
        intermediate_size=2560,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        seq_len=2048,
        nominal_params=350e6,
    ),
    ModelPreset(
        name="1b",
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=18,
        num_attention_heads=16,
        num_key_value_heads=16,
        seq_len=2048,
        nominal_params=1e9,
    ),
    ModelPreset(
        name="7b",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        seq_len=4096,
        nominal_params=7e9,
    ),
]

SPARSE = [
    # The test and demo scale: the tiny dense preset's attention, and 8 experts of which 2 run
    # per token, each half the dense feed-forward's width, so a token's active parameters are
    # the tiny dense model's (plus a 256 x 8 router per layer).
    ModelPreset(
        name="tiny-moe",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        seq_len=256,
        nominal_params=None,
        vocab_size=8192,
        moe=MoeShape(
            num_experts=8,
            top_k=2,
            expert_intermediate_size=344,
            aux_loss_coef=0.01,
            z_loss_coef=0.001,
        ),
    ),
    # OLMoE-1B-7B's shape (Muennighoff et al. 2024, "OLMoE: Open Mixture-of-Experts Language
    # Models", arXiv 2409.02060, Table 1): 16 layers of width 2048, 16 heads, 64 experts of
    # width 1024, 8 per token, no renormalisation of the top-8 weights; load-balancing loss
    # 0.01 and router z-loss 0.001; 6.9B parameters of which 1.3B active.
    ModelPreset(
        name="olmoe-1b-7b",
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        seq_len=4096,
        nominal_params=6.9e9,
        vocab_size=50304,
        moe=MoeShape(
            num_experts=64,
            top_k=8,
            expert_intermediate_size=1024,
            norm_topk_prob=False,
            aux_loss_coef=0.01,
            z_loss_coef=0.001,
        ),
    ),
    # Qwen3-30B-A3B's shape (its config.json on the Hugging Face hub, Qwen/Qwen3-30B-A3B; Qwen
    # Team 2025, "Qwen3 Technical Report", arXiv 2505.09388, Table 2): 48 layers of width 2048,
    # 32 query and 4 key-value heads of 128, 128 experts of width 768, 8 per token, RoPE base
    # 1,000,000, router_aux_loss_coef 0.001; 30.5B parameters of which 3.3B active.
    ModelPreset(
        name="qwen3-30b-a3b",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_size=128,
        seq_len=4096,
        nominal_params=30.5e9,
        vocab_size=151936,
        rope_theta=1_000_000.0,
        moe=MoeShape(
            num_experts=128,
            top_k=8,
            expert_intermediate_size=768,
            aux_loss_coef=0.001,
        ),
    ),
]

PRESETS: dict[str, ModelPreset] = {p.name: p for p in DENSE + SPARSE}


PRETRAINED = "pretrained"
"""The preset name of a recipe whose model is always a Hugging Face checkpoint's
(``recipes/continue_pretraining.py``): it has no shape of its own."""


def get_preset(name: str) -> ModelPreset:
    if name == PRETRAINED:
        raise UserError(
            f"model.preset {PRETRAINED}: this recipe continues a pretrained model and has no "
            f"shape of its own. Give --init-from DIR, a Hugging Face model directory "
            f"(config.json, weights and tokenizer, as save_pretrained writes them)."
        )
    if name not in PRESETS:
        raise UserError(
            f"model.preset {str(name)[:40]!r}: no such preset. Choose one of "
            f"{', '.join(PRESETS)} (--set model.preset=NAME), or set the shape with "
            f"model.hidden_size, model.num_hidden_layers, ... on top of one."
        )
    return PRESETS[name]
