"""The model a launch trains: the preset named by the run's ``model`` section with its shape
overrides and the data's vocabulary, or, with ``--init-from``, the Hugging Face checkpoint's
own architecture (``anneal.hf.load.pretrained_preset``); and its attention
(``launch_attention``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from anneal.config.run import ModelConfig, RunConfig
from anneal.data.prepared_dir import PreparedDir
from anneal.errors import UserError
from anneal.model import ModelPreset, get_preset
from anneal.model.attention import Attention, choose_attention, flash_attn_installed
from anneal.resolution.parallel import Layout


def model_preset(model: ModelConfig, vocab_size: int) -> ModelPreset:
    """The preset with this config's overrides and the data's vocabulary (or, with
    ``init_from``, the checkpoint's model: ``anneal.hf.load.pretrained_preset``)."""
    if model.init_from:
        if model.rope_theta:
            raise UserError(
                f"model.rope_theta {model.rope_theta:g} with --init-from {model.init_from}: "
                f"a pretrained model's RoPE is its config.json's. Drop --set "
                f"model.rope_theta, or set rope_theta (or rope scaling) in that config.json."
            )
        from anneal.hf.load import pretrained_preset  # only with --init-from: not in the loop

        return pretrained_preset(Path(model.init_from), data_vocab=vocab_size, model=model)
    preset = get_preset(model.preset).with_vocab(vocab_size)
    shape = {
        k: getattr(model, k)
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        if getattr(model, k)
    }
    if "num_attention_heads" in shape:
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    if model.seq_len:
        shape["seq_len"] = model.seq_len
    if model.rope_theta:
        shape["rope_theta"] = float(model.rope_theta)
    preset = dataclasses.replace(preset, **shape, moe=_overridden_moe(model, preset))
    heads, hidden = preset.num_attention_heads, preset.hidden_size
    if hidden % heads or (hidden // heads) % 2:
        fits = [h for h in range(1, 129) if hidden % h == 0 and hidden // h % 2 == 0]
        other = f"--set model.num_attention_heads to one of {fits[-4:]}, or " if fits else ""
        near = 2 * heads * max(1, round(hidden / heads / 2))
        raise UserError(
            f"model.hidden_size ({hidden}) must be model.num_attention_heads ({heads}) "
            f"times an even head size (rotary embeddings turn pairs of channels), but "
            f"{hidden} / {heads} = {hidden / heads:g}. Set {other}--set model.hidden_size "
            f"to a multiple of {2 * heads} (e.g. {near})."
        )
    return preset


def launch_attention(
    cfg: RunConfig, ds: dict, *, meta: dict, device_type: str, layout: Layout
) -> Attention:
    """The attention this launch trains with (``anneal.model.attention.choose_attention``):
    with ``data.document_mask``, the data's end-of-text id and the fastest kernel that masks
    on ``device_type`` with what is installed here."""
    mask = cfg.data.document_mask
    return choose_attention(
        document_mask=mask,
        eos_id=PreparedDir(cfg.data.path).eos_id(meta) if mask else None,
        device_type=device_type,
        half_precision=any(ds.get(k, {}).get("enabled", False) for k in ("bf16", "fp16")),
        flash_attn_installed=device_type == "cuda" and flash_attn_installed(),
        sequence_parallel=layout.sequence_parallel,
        micro_batch=ds["train_micro_batch_size_per_gpu"],
    )


MOE_KEYS = {
    "num_experts": "num_experts",
    "experts_per_token": "top_k",
    "expert_intermediate_size": "expert_intermediate_size",
    "moe_aux_loss_coef": "aux_loss_coef",
    "moe_z_loss_coef": "z_loss_coef",
}
"""The ``model`` keys that override a sparse preset's ``MoeShape``, and the field each sets."""


def _overridden_moe(model: ModelConfig, preset: ModelPreset):
    """The preset's sparse shape with this config's overrides (0 and None keep the preset's);
    UserError for an override on a dense preset, or top-k above the experts."""
    given = {
        field: getattr(model, key)
        for key, field in MOE_KEYS.items()
        if getattr(model, key) not in (0, None)
        or (key.endswith("_coef") and getattr(model, key) == 0)
    }
    if preset.moe is None:
        if given:
            keys = ", ".join(f"model.{k}" for k, f in MOE_KEYS.items() if f in given)
            raise UserError(
                f"{keys}: preset {preset.name!r} is dense (one feed-forward per layer, no "
                f"experts). Choose a sparse preset (--set model.preset=tiny-moe, olmoe-1b-7b or "
                f"qwen3-30b-a3b; recipes/pretrain_moe_*.py), or drop the setting."
            )
        return None
    moe = dataclasses.replace(preset.moe, **given)
    if moe.top_k > moe.num_experts:
        raise UserError(
            f"model.experts_per_token {moe.top_k} is more than model.num_experts "
            f"{moe.num_experts}: each token is routed to top-k of the layer's experts. Set "
            f"--set model.experts_per_token to at most {moe.num_experts}."
        )
    return moe
