"""Launched by tests/train/test_engine_reference.py under `deepspeed --num_gpus 2`.

Takes one optimizer step through Anneal's real engine and step function (ZeRO-3, 2 ranks,
gradient accumulation 2), and the same step in plain torch on rank 0 (no DeepSpeed): same
weights, same global batch, torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW. Writes
what the test compares to the JSON file named by argv[1].
"""

import copy
import json
import sys

import deepspeed
import torch

from anneal import model as modellib
from anneal.config.run import ModelConfig, RunConfig, TrainConfig
from anneal.config.run_checks import apply_overrides
from anneal.data.stream import PackedSplit, TokenStream
from anneal.dist import init_distributed, rank, shutdown, world_size
from anneal.train import (
    StepShape,
    TrainState,
    build_engine,
    next_token_loss,
    resolve_run,
    train_step,
)


def gathered_state(module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone().float()
    return out


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out_json, data_dir, run_dir, *overrides = argv
    init_distributed()
    cfg = RunConfig(
        out=run_dir,
        ds_config="cpu.json",
        model=ModelConfig(preset="tiny"),
        train=TrainConfig(max_steps=10, seed=7),
    )
    cfg = apply_overrides(dataclasses_replace_data(cfg, data_dir), overrides)
    plan = resolve_run(cfg, overrides)
    engine = build_engine(plan)
    before = gathered_state(engine.module)
    decayed = sorted(n for n, p in engine.module.named_parameters() if modellib.is_decayed(p))
    split = PackedSplit(data_dir, "train", seq_len=plan.seq_len)
    stream = TokenStream(
        split,
        seed=cfg.train.seed,
        rank=rank(),
        world_size=world_size(),
        micro_batch=plan.micro_batch,
        prefetch=0,
    )
    row = train_step(engine, stream, TrainState(), StepShape.of(plan))
    after = gathered_state(engine.module)
    if rank() != 0:
        return

    # The same step without DeepSpeed.
    ref = modellib.build_model(plan.preset)
    modellib.init_weights_(ref, std=plan.preset.initializer_range, seed=cfg.train.seed)
    init_diff = max((before[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    ref.train()
    w, accum = world_size(), plan.grad_accum
    losses = []
    for r in range(w):
        s = TokenStream(
            split,
            seed=cfg.train.seed,
            rank=r,
            world_size=w,
            micro_batch=plan.micro_batch,
            prefetch=0,
        )
        for _ in range(accum):
            x, y = s.next_batch()
            loss = next_token_loss(ref(input_ids=x).logits, y)
            (loss / (accum * w)).backward()
            losses.append(loss.item())
    opt = plan.ds_config["optimizer"]["params"]
    max_norm = plan.ds_config["gradient_clipping"]

    def reference_update(*, clip: bool, decay_all: bool) -> tuple[float, dict]:
        """Clip in float64 with torch's clip_grad_norm_, then torch's AdamW in fp32."""
        model = copy.deepcopy(ref)
        for p, src in zip(model.parameters(), ref.parameters(), strict=True):
            p.grad = src.grad.clone()
        exact = [torch.nn.Parameter(p.detach().double()) for p in model.parameters()]
        for e, p in zip(exact, model.parameters(), strict=True):
            e.grad = p.grad.double()
        norm = torch.nn.utils.clip_grad_norm_(exact, max_norm=max_norm if clip else 1e30)
        for e, p in zip(exact, model.parameters(), strict=True):
            p.grad = e.grad.float()
        if decay_all:
            groups = [{"params": list(model.parameters()), "weight_decay": opt["weight_decay"]}]
        else:
            groups = modellib.param_groups(model, weight_decay=opt["weight_decay"])
        torch.optim.AdamW(groups, lr=row["lr"], betas=tuple(opt["betas"]), eps=opt["eps"]).step()
        return norm.item(), {n: p.detach() for n, p in model.named_parameters()}

    def max_diff(weights: dict) -> float:
        return max((after[n] - weights[n]).abs().max().item() for n in after)

    ref_norm, clipped = reference_update(clip=True, decay_all=False)
    _, unclipped = reference_update(clip=False, decay_all=False)
    _, decay_all = reference_update(clip=True, decay_all=True)
    result = {
        "engine_grad_norm": row["grad_norm"],
        "ref_grad_norm": ref_norm,
        "max_norm": max_norm,
        "diff_vs_clipped": max_diff(clipped),
        "diff_vs_unclipped": max_diff(unclipped),
        "diff_vs_decay_all": max_diff(decay_all),
        "engine_loss": row["loss"],
        "ref_loss": sum(losses) / len(losses),
        "lr": row["lr"],
        "init_max_abs_diff": init_diff,
        "update_max_abs": max((after[n] - before[n]).abs().max().item() for n in after),
        "decayed": decayed,
        "two_d": sorted(n for n, p in ref.named_parameters() if p.dim() >= 2),
        "embed_std": before["model.embed_tokens.weight"].std().item(),
        "lm_head_std": before["lm_head.weight"].std().item(),
        "norm_mean": before["model.norm.weight"].mean().item(),
        "world_size": w,
        "grad_accum": accum,
    }
    with open(out_json, "w") as f:
        json.dump(result, f)


def dataclasses_replace_data(cfg, data_dir):
    import dataclasses

    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=data_dir))


if __name__ == "__main__":
    main()
    shutdown()
