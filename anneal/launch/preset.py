"""The model a launch trains: the preset named by the run's ``model`` section with its shape
overrides and the data's vocabulary, or, with ``--init-from``, the Hugging Face checkpoint's
own architecture (``anneal.hf.load.pretrained_preset``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from anneal.config.run import ModelConfig
from anneal.errors import UserError
from anneal.model import ModelPreset, get_preset


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
    preset = dataclasses.replace(preset, **shape)
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
