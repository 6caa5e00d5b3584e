"""A preset -> its transformers config -> a freshly constructed causal LM, and what training
does to its parameters before the engine: the seeded init and the AdamW groups.

The model knows nothing about distribution. ZeRO-3 partitioning is applied by the caller
(``anneal.train``) wrapping construction in ``deepspeed.zero.Init``; this module only offers
``init_weights_`` so that the caller can re-apply the std-0.02 init that construction under
``zero.Init`` skips (embeddings otherwise come out with std 1.0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anneal.model.attention import SDPA
from anneal.model.shape import ModelPreset

if TYPE_CHECKING:  # torch is imported where it is used: presets and counts are read by
    # commands that never build a model (`anneal data prepare`, `plan`, `estimate`), and
    # importing torch costs them 2-3 s and about 200 MB of resident memory.
    import torch
    from torch import nn


def _decoder_kwargs(preset: ModelPreset) -> dict:
    """What every preset's transformers config takes alike: the shape, RoPE, init, untied
    embeddings, no KV cache and no special token ids."""
    return dict(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.seq_len,
        rope_theta=preset.rope_theta,
        initializer_range=preset.initializer_range,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def llama_config(preset: ModelPreset):
    from transformers import LlamaConfig

    return LlamaConfig(**_decoder_kwargs(preset))


def qwen3_moe_config(preset: ModelPreset):
    """The Qwen3-MoE config of a sparse preset: every layer sparse, no shared expert, the
    router's logits returned (its load-balancing loss and the balance metrics need them)."""
    from transformers import Qwen3MoeConfig

    moe = preset.moe
    return Qwen3MoeConfig(
        **_decoder_kwargs(preset),
        head_dim=preset.head_dim,
        moe_intermediate_size=moe.expert_intermediate_size,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        router_aux_loss_coef=moe.aux_loss_coef,
        output_router_logits=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def hf_model_config(preset: ModelPreset):
    """The transformers config of the model: a Hugging Face checkpoint's own (``hf_config``,
    its ``max_position_embeddings`` and RoPE settings kept), the sparse preset's Qwen3-MoE or
    the Llama preset's."""
    if preset.hf_config is None:
        return qwen3_moe_config(preset) if preset.is_moe else llama_config(preset)
    from transformers import AutoConfig

    doc = dict(preset.hf_config)
    config = AutoConfig.for_model(doc.pop("model_type"), **doc)
    config.use_cache = False
    return config


def model_class(config):
    """The causal-LM class of a transformers config (its module imported)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)]


def build_model(preset: ModelPreset, *, attention: str = SDPA) -> nn.Module:
    """A freshly constructed causal LM (LlamaForCausalLM for a dense preset,
    Qwen3MoeForCausalLM for a sparse one) in fp32 with ``attention`` (transformers'
    ``attn_implementation``: the launch's choice, ``anneal.model.attention``; SDPA by default)."""
    cfg = hf_model_config(preset)
    cfg._attn_implementation = attention
    return model_class(cfg)(cfg)


def is_decayed(p: torch.Tensor) -> bool:
    """Weight decay goes on 2-D+ weights only.

    Under ZeRO-3 a partitioned parameter is a 1-D shard (``p.dim() == 1``); its real shape is
    ``p.ds_shape``. Reading ``dim()`` would silently give no decay at all.
    """
    shape = getattr(p, "ds_shape", None)
    ndim = len(shape) if shape is not None else p.dim()
    return ndim >= 2


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """AdamW groups: decoupled decay on matrices, none on norm weights and biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if is_decayed(p) else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def _init_module_(module: nn.Module, std: float) -> None:
    from torch import nn

    experts = [getattr(module, k) for k in ("gate_up_proj", "down_proj") if hasattr(module, k)]
    if experts and all(isinstance(p, nn.Parameter) for p in experts):  # fused 3-D experts
        for p in experts:
            nn.init.normal_(p, mean=0.0, std=std)
    elif isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding) or "Router" in type(module).__name__:
        nn.init.normal_(module.weight, mean=0.0, std=std)  # a router: an expert x hidden matrix
    elif hasattr(module, "weight") and "RMSNorm" in type(module).__name__:
        nn.init.ones_(module.weight)


def init_weights_(model: nn.Module, *, std: float, seed: int, gather=None) -> None:
    """Deterministic init: N(0, std) for Linear and Embedding weights, ones for RMSNorm.

    ``gather(params)`` is a context manager that makes a module's parameters whole and
    writable (``deepspeed.zero.GatheredParameters`` under ZeRO-3); modules are visited one at a
    time so at most one module is ever gathered. The result depends only on ``seed``, not on
    the ZeRO stage or the number of ranks.
    """
    import torch

    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for module in model.modules():
            params = list(module.parameters(recurse=False))
            if not params:
                continue
            if gather is None:
                with torch.no_grad():
                    _init_module_(module, std)
            else:
                with gather(params), torch.no_grad():
                    _init_module_(module, std)
    finally:
        torch.random.set_rng_state(gen_state)
