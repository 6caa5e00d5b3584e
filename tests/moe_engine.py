"""A bare DeepSpeed AutoEP engine over a tiny Qwen3-MoE model, in this process, and its
checkpoint saved as a run directory that ``anneal export`` reads (tests/hf/test_moe_hf.py).

Bare: ``deepspeed.initialize`` on a plain transformers model with an ``"expert_parallel"``
section, as DeepSpeed's own AutoEP tests do, nothing of Anneal's training in between, so the
export is checked against DeepSpeed's layout and not against Anneal's reading of it.
DeepSpeed 0.19.8's AutoEP treats transformers 5.24's ``_CanRecordRegistry`` as a plain dict;
the call runs under the core's repair (``anneal.train.experts.autoep_registry_fix``), the one
thing of Anneal's it shares.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from anneal import rundir
from anneal.model import ModelPreset, MoeShape, build_model
from anneal.resilience.manifest import write_manifest

VOCAB = 300  # tiny_data's byte-level vocabulary
SEQ = 64


def tiny_preset(vocab: int = VOCAB) -> ModelPreset:
    """A two-layer Qwen3-MoE of 4 experts, top-2, heads of width 32 (not hidden / heads)."""
    return ModelPreset(
        name="micro-moe",
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_size=32,
        seq_len=SEQ,
        nominal_params=None,
        vocab_size=vocab,
        moe=MoeShape(num_experts=4, top_k=2, expert_intermediate_size=32, aux_loss_coef=0.01),
    )


def hf_model(preset: ModelPreset, seed: int = 0) -> torch.nn.Module:
    """The preset's transformers model, its weights at transformers' init (seeded), with the
    router's and the experts' rows made distinct enough that a mix-up of gate and up, of two
    experts or of the router's rows changes the logits."""
    torch.manual_seed(seed)
    model = build_model(preset)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "mlp.gate" in name:
                p.normal_(0.0, 0.1)
    return model.eval()


def bare_engine(model: torch.nn.Module, *, stage: int, ep: int = 1):
    """``deepspeed.initialize`` with AutoEP (``autoep_size`` ``ep``, the qwen3_moe preset, the
    plain expert loop), ZeRO ``stage``, AdamW, fp32; on the current process group."""
    import deepspeed
    import deepspeed.comm as dist

    from anneal.train.experts import autoep_registry_fix

    world = dist.get_world_size()
    config = {
        "train_batch_size": 2 * world,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "expert_parallel": {
            "enabled": True,
            "autoep_size": ep,
            "preset_model": "qwen3_moe",
            "use_grouped_mm": False,
        },
    }
    model.config.output_router_logits = True
    with autoep_registry_fix():
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    return engine


def train_steps(engine, steps: int, *, seed: int = 1) -> None:
    """``steps`` optimizer steps on random ids (each rank its own rows)."""
    g = torch.Generator().manual_seed(seed + engine.global_rank)
    engine.train()
    for _ in range(steps):
        x = torch.randint(0, engine.module.config.vocab_size, (2, SEQ + 1), generator=g)
        out = engine(input_ids=x[:, :-1], labels=x[:, 1:].contiguous())
        engine.backward(out.loss)
        engine.step()
    engine.eval()


def save_as_run(engine, preset: ModelPreset, run_dir: Path, data_dir: Path, tag: str) -> Path:
    """The engine's checkpoint as a run directory holds it (``checkpoints/TAG`` with Anneal's
    manifest, every file listed and hashed) and the run's config.json (its model and data).
    Collective. Returns the tag directory."""
    ckpt_dir = rundir.checkpoints_dir(run_dir)
    engine.save_checkpoint(str(ckpt_dir), tag=tag)
    tag_dir = ckpt_dir / tag
    write_manifest(tag_dir, step=engine.global_steps, client_state={})
    if engine.global_rank == 0:
        doc = {"model": dataclasses.asdict(preset), "run": {"data": {"path": str(data_dir)}}}
        rundir.write_config(run_dir, doc)
    return tag_dir
