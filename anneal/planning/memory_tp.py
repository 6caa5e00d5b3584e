"""Tensor parallelism in the memory estimate: what DeepSpeed's AutoTP shards and what it keeps.

AutoTP (``"tensor_parallel": {"autotp_size": t}``, anneal/resolution/parallel.py) shards a Llama
model by its Hugging Face ``tp_plan``: q, k, v, gate and up column-wise, o and down row-wise,
and the LM head column-wise with its output gathered. The embedding and the RMSNorm weights stay
whole on every rank. So on each GPU, before ZeRO::

    P_gpu = P_replicated + P_sharded / t

and ZeRO then partitions P_gpu over the data-parallel group of n / t ranks. Activations follow
Korthikanti et al. 2022 (arXiv 2205.05198, Table 2): with tensor parallelism and no sequence
parallelism a GPT layer keeps ``s b h (10 + 24/t + 5 a s / (h t))`` bytes, the 10 being the
layer norms' and the two block inputs' tensors, which every rank of the group holds whole. In
Anneal's Llama block that is the two RMSNorms' saved tensors (the inputs of q/k/v and of
gate/up); every other saved tensor belongs to a sharded matmul and divides by t. The LM head's
gathered output is the full logits on every rank, and Anneal's chunked loss falls back to the
plain one under TP (anneal/train/loss.py), so the logits are counted whole, with the plain loss.
"""

from __future__ import annotations

from anneal.model import ModelPreset, count_params

REPLICATED_TENSORS = (
    "attention: RMSNorm",
    "MLP: RMSNorm",
    "two LayerNorm inputs",
    "attention: QKV input",
    "attention: dropout mask",
    "MLP: first linear input",
    "MLP: dropout mask",
)
"""Saved tensors (``memory.saved_tensors``' names) every rank of a TP group holds whole: in the
GPT block they sum to Korthikanti's 10 s b h; in the Llama block, the two RMSNorms'."""


def sharded_params(preset: ModelPreset) -> int:
    """Parameters AutoTP shards: q, k, v, o, gate, up, down in every layer, and the LM head."""
    h, f = preset.hidden_size, preset.intermediate_size
    q = preset.num_attention_heads * preset.head_dim
    kv = preset.num_key_value_heads * preset.head_dim
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * f
    return preset.num_hidden_layers * per_layer + preset.vocab_size * h


def params_per_gpu(preset: ModelPreset, tp: int) -> int:
    """Parameters on each rank of a TP group, before ZeRO: the replicated ones (embedding,
    norms) whole, the sharded ones divided by ``tp`` (rounded up, as uneven shards would be)."""
    p, sharded = count_params(preset), sharded_params(preset)
    if tp == 1:
        return p
    return p - sharded + -(-sharded // tp)


def largest_layer_params(preset: ModelPreset, tp: int = 1) -> int:
    """Parameters of the largest single module (DeepSpeed's ``largest_layer_params``): the
    embedding or LM head (V x h) or an MLP projection (h x f); under TP the embedding stays
    whole and the others divide by ``tp``."""
    vh, hf = preset.vocab_size * preset.hidden_size, preset.hidden_size * preset.intermediate_size
    return max(vh, hf // tp)


def divide_tensors(items: list[tuple[str, float]], tp: int) -> list[tuple[str, float]]:
    """``saved_tensors``' list on one rank of a TP group: the sharded matmuls' tensors / tp."""
    if tp == 1:
        return items
    return [(name, n if name in REPLICATED_TENSORS else n / tp) for name, n in items]
