"""Parameter and FLOP counts of a preset, from its shapes alone (no torch for a preset; a
Hugging Face architecture is counted on the meta device).

A sparse model has two counts: its *total* parameters (what memory holds, experts sharded over
the expert-parallel ranks) and its *active* ones, those one token runs through (``top_k`` of
the experts): FLOPs per token and MFU use the active count (``flops_per_token``)."""

from __future__ import annotations

import dataclasses
import functools
import json

from anneal.model.shape import ModelPreset


def count_params(preset: ModelPreset, *, embeddings: bool = True) -> int:
    """Exact parameter count of the preset's model (all experts of a sparse one), from its
    shapes.

    ``embeddings=False`` leaves out the input embedding only; the LM head stays, as in the
    PaLM FLOPs convention (tied embeddings count once, as the head).
    """
    if preset.hf_config is not None:
        return _counted_params(json.dumps(preset.hf_config, sort_keys=True), embeddings)
    h, n_layers = preset.hidden_size, preset.num_hidden_layers
    q = preset.num_attention_heads * preset.head_dim
    kv = preset.num_key_value_heads * preset.head_dim
    attn = 2 * h * q + 2 * h * kv  # q, k, v, o
    norms = 2 * h
    if preset.moe is None:
        mlp = 3 * h * preset.intermediate_size  # gate, up, down (SwiGLU)
    else:  # the experts' SwiGLUs, the router, and Qwen3's RMSNorm of each head's q and k
        moe = preset.moe
        mlp = moe.num_experts * 3 * h * moe.expert_intermediate_size + h * moe.num_experts
        norms += 2 * preset.head_dim
    per_layer = attn + mlp + norms
    head = preset.vocab_size * h
    embed = preset.vocab_size * h if embeddings else 0
    return n_layers * per_layer + h + head + embed


@functools.lru_cache(maxsize=8)
def _counted_params(hf_config: str, embeddings: bool) -> int:
    """The parameters of a Hugging Face architecture, counted on the meta device (biases,
    tied embeddings and other shapes included) without allocating any."""
    import torch

    from anneal.model.build import build_model
    from anneal.model.presets import PRESETS

    preset = dataclasses.replace(PRESETS["tiny"], hf_config=json.loads(hf_config))
    with torch.device("meta"):
        model = build_model(preset)
    total = sum(p.numel() for p in model.parameters())  # a tied matrix once
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    return total if embeddings or tied else total - embed.numel()


def flops_per_token(preset: ModelPreset, *, seq_len: int | None = None) -> float:
    """Training FLOPs per token: ``6N + 12*L*H*Q*T`` (PaLM, appendix B).

    N is the active parameters (``active_params``: a sparse model's token runs through
    ``top_k`` experts, not all), without the input embedding but with the LM head; the second
    term is attention's score and value matmuls with L layers, H heads, Q head dim and T
    context length.
    """
    t = seq_len or preset.seq_len
    n = active_params(preset, embeddings=False)
    return 6 * n + 12 * preset.num_hidden_layers * preset.num_attention_heads * preset.head_dim * t


def active_params(preset: ModelPreset, *, embeddings: bool = True) -> int:
    """The parameters one token runs through: all of a dense model's; a sparse model's less
    the ``num_experts - top_k`` experts of each layer that it skips (the router counts)."""
    total = count_params(preset, embeddings=embeddings)
    moe = preset.moe
    if moe is None:
        return total
    skipped = moe.num_experts - moe.top_k
    return total - preset.num_hidden_layers * skipped * 3 * preset.hidden_size * (
        moe.expert_intermediate_size
    )


def human_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))
