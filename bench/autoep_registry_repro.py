"""Minimal reproduction, for DeepSpeed's maintainers, of AutoEP failing on transformers >= 5.24:
``deepspeed.initialize`` of a tiny Qwen3-MoE with ``"expert_parallel": {"enabled": true}``.

AutoEP's ``_install_instance_transformers_output_recorders``
(deepspeed/module_inject/auto_ep_presets/base.py) treats
``transformers.utils.output_capturing._CAN_RECORD_REGISTRY`` as a plain dict:
``registry.get(registry_key, _MISSING_REGISTRY_ENTRY)`` and ``registry[registry_key] = entry`` with
a class-name string as the key. transformers 5.24 made it a ``_CanRecordRegistry`` whose
``get(model)`` takes one argument (and keys by ``str(model.__class__)``), so the call fails with
``TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given``. Anneal
runs the call under ``anneal.train.experts.autoep_registry_fix``; ``--repaired`` shows that run.

    python bench/autoep_registry_repro.py [--repaired]      (one process, CPU, gloo; a few s)

Seen with DeepSpeed 0.19.8, transformers 5.24.0, torch 2.13.0 (CPU).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    import deepspeed
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29512", RANK="0", WORLD_SIZE="1")
    os.environ.update(LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
    )
    model = Qwen3MoeForCausalLM(config)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "expert_parallel": {
            "enabled": True,
            "autoep_size": 1,
            "preset_model": "qwen3_moe",
            "use_grouped_mm": False,
        },
    }
    repair = contextlib.nullcontext()
    if "--repaired" in sys.argv:
        from anneal.train.experts import autoep_registry_fix

        repair = autoep_registry_fix()
    try:
        with repair:
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=ds
            )
    except TypeError as e:
        print(f"AutoEP failed: TypeError: {e}")
        return 1
    out = engine(input_ids=torch.randint(0, 128, (1, 8)))
    print(
        f"AutoEP ran: aux_loss {out.aux_loss.item():.4f} "
        f"({type(engine.module.model.layers[0].mlp).__name__})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
