"""Ulysses sequence parallelism (``--set ds.sequence_parallel_size=N``; docs/parallelism.md).

DeepSpeed 0.19.8's ``UlyssesSPAttentionHF`` takes the place of transformers' SDPA attention
function: each of the N consecutive ranks of a group holds 1/N of every sequence, and around
the attention an all-to-all trades sequence for heads, so that each rank attends over the whole
sequence for 1/N of the heads and then takes its own slice back. Everything else in the model
(embeddings, norms, MLP, the head and the loss, chunked or plain) runs on the rank's slice.

How Anneal drives it, as DeepSpeed's own test and ALST tutorial do, with one difference in how
a micro-batch reaches the ranks: every rank of a group reads the same samples from the token
stream (the group is one data-parallel replica, ``anneal.train.engine.data_replica``) and
keeps its own slice of each (``shard``), where DeepSpeed's data-loader adapter reads on each
rank and exchanges the samples. The slice comes with its ``position_ids``, which the Ulysses
attention gathers so that the causal mask and RoPE see global positions.

With ``data.document_mask`` the positions are those of the documents (they restart after each
end-of-text token), each rank's slice keeps its own, and the mask stays whole across the
exchange: Ulysses drops the mask transformers built for the slice and gathers the positions of
the whole sequence, from which the core attention it wraps (``documents_sdpa``) builds the
documents' block-causal mask again, for the whole sequence and this rank's heads; flash-attn's
varlen kernel reads the gathered positions itself.

The loss: each rank's loss is the mean over its slice. The group's loss is the token-weighted
mean of those, and the slices hold equal token counts (the sequence divides by N and Anneal's
packed windows ignore no token), so it is their plain mean; every rank's mean enters the step's
one collective (``anneal.train.step``), whose mean over all ranks is therefore the mean over
data-parallel replicas of each group's loss.

The gradients must equal those without sequence parallelism, and DeepSpeed 0.19.8 reduces
them differently by ZeRO stage: ZeRO-2 sums over the ranks of a group and averages over
replicas (``stage_1_and_2`` divides the world's sum by world / N), so each rank
back-propagates its share of the group's mean, its own mean / N; ZeRO-3's reduce-scatter
(``reduce_scatter_coalesced``) averages over all ranks, N per replica, so each rank
back-propagates its own mean (``loss_share``). (DeepSpeed's own recipe, a differentiable
all-gather of the per-rank losses, back-propagates N x the share and so suits ZeRO-3 only; its
ZeRO-2 test compares gradients at a tolerance wide enough to hide it.) ZeRO-3 without
``reduce_scatter`` mixes both reductions bucket by bucket, and is refused
(``anneal.resolution.parallel``). The tests compare the gradient norm of every step, as well as
the losses, with the run without sequence parallelism.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from anneal.model import hf_model_config
from anneal.model.attention import SDPA
from anneal.resolution.resolve import Launch


def register(launch: Launch):
    """Install DeepSpeed's Ulysses attention in place of SDPA and build its sequence-parallel
    process groups (blocks of N consecutive ranks); returns them as the ``mpu`` for
    ``deepspeed.initialize`` (which then counts world / N data-parallel replicas), or None
    without sequence parallelism. Collective: every rank calls it, before the model is built."""
    sp = launch.layout.sequence_parallel
    if sp == 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = launch.attention.implementation
    config = hf_model_config(launch.preset)
    config._attn_implementation = attention  # as anneal.train.engine builds the model
    if launch.attention.document_mask and attention == SDPA:
        # Ulysses drops the mask transformers built for the slice; the core it wraps builds
        # the documents' mask again from the whole sequence's positions
        ALL_ATTENTION_FUNCTIONS[SDPA] = documents_sdpa
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=types.SimpleNamespace(config=config),  # a model's config suffices
        core_attn_implementation=attention,
        sequence_parallel_size=sp,
        micro_batch_size=launch.micro_batch,
        seq_length=launch.seq_len,
        seq_length_is_variable=False,  # every batch, validation's too, is micro x seq_len
    )


def documents_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with the documents' block-causal mask built from the
    position ids of the whole sequence (Ulysses gathers them before the core attention runs):
    the same boolean mask transformers builds without Ulysses (``masking_utils``: a token
    attends to the tokens before it, itself included, in its own document), here for this
    rank's heads over the whole sequence. Without a restart of the positions: SDPA's causal
    flag, as transformers leaves it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import find_packed_sequence_indices

    positions = kwargs.get("position_ids")
    if attention_mask is None and positions is not None:
        documents = find_packed_sequence_indices(positions)  # (B, T) or None
        if documents is not None:
            t = torch.arange(positions.size(-1), device=query.device)
            causal = t[:, None] >= t[None, :]  # (T, T)
            same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
            attention_mask = (same & causal)[:, None]  # (B, 1, T, T)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def check_model(model, attention: str) -> None:
    """The model must run the attention that ``register`` replaced (an internal invariant:
    ``anneal.train.engine`` builds it with the launch's)."""
    impl = getattr(model.config, "_attn_implementation", None)
    assert impl == attention, f"sequence parallelism needs {attention} attention, got {impl}"


def shard(
    engine, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None
) -> tuple[dict, torch.Tensor]:
    """(the engine's keyword inputs, the targets) of this rank's part of a micro-batch x, y
    (B, T) and its ``positions`` (B, T; None: 0 .. T-1 in each row, and without sequence
    parallelism no position ids at all, as Anneal always ran): without sequence parallelism
    all of it; with N ranks a group, slice r of N along the sequence, (B, T / N), with its
    positions in the whole sequence."""
    sp = engine.sequence_parallel_size
    if sp == 1:
        inputs = (
            {"input_ids": x} if positions is None else {"input_ids": x, "position_ids": positions}
        )
        return inputs, y
    r = dist.get_rank(group=engine.seq_parallel_group)
    n = x.size(1) // sp
    cut = slice(r * n, (r + 1) * n)
    if positions is None:
        positions = torch.arange(x.size(1), device=x.device).repeat(x.size(0), 1)
    inputs = {"input_ids": x[:, cut].contiguous(), "position_ids": positions[:, cut].contiguous()}
    return inputs, y[:, cut].contiguous()


def loss_share(engine) -> float:
    """What this rank back-propagates of its slice's mean loss: 1 / N under ZeRO-2, 1 under
    ZeRO-3 (module docstring), 1 without sequence parallelism."""
    if engine.zero_optimization_stage() == 3:
        return 1.0
    return 1.0 / engine.sequence_parallel_size


def sp_data_replica(engine) -> tuple[int, int] | None:
    """(replica index, replicas) under sequence parallelism, None without. DeepSpeed's
    sequence-parallel mpu has no data-parallel group (the engine's ``data_parallel_group`` is
    None): its groups are blocks of N consecutive ranks (``parallel_state_sp``), the index of
    the block is the replica's, and DeepSpeed's config counts world / N replicas."""
    sp = engine.sequence_parallel_size
    if sp == 1:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dist.get_rank(group=engine.seq_parallel_group) == rank % sp, "SP groups not blocks"
    return rank // sp, world // sp
