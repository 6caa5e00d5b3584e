"""The reference for the training benchmark: a plain PyTorch loop of the same model.

Same ``transformers`` LlamaForCausalLM with the same init, the same batches in the same order
(Anneal's ``TokenStream``), the same micro-batch, accumulation, AdamW (torch's, two groups: decay
on matrices only), global L2 clip and warmup-cosine schedule, all read from the recipe's resolved
plan, so that the only difference from the recipe is the framework around the step. No DeepSpeed
in the loop; several ranks go through torch's DistributedDataParallel with gloo (``no_sync`` on
all micro-batches but the last, as DeepSpeed reduces only at the boundary).

    python bench/reference.py recipes/pretrain_tiny.py --data data/stdlib --max-steps 20 \
        --rows steps.jsonl [--set KEY=VALUE ...]
    python -m torch.distributed.run --nproc_per_node 2 bench/reference.py ...   (DDP)

Writes one JSON line per optimizer step to ``--rows`` (rank 0): step, loss (mean over
micro-batches and ranks), grad_norm (before clipping), lr, time (wall clock after the step). The
loss and norm stay on the device until the end, so the loop has no per-step host sync or
collective beyond DDP's gradient all-reduce.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", help="whose defaults to take, e.g. recipes/pretrain_tiny.py")
    p.add_argument("--data", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--ds-config", default="cpu.json", help="read for the batch and optimizer")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--rows", required=True, help="JSON Lines file, one row per step")
    args = p.parse_args(argv)

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from anneal import model as modellib
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.config.schedule import lr_ratio
    from anneal.data.stream import PackedSplit, TokenStream

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if "OMP_NUM_THREADS" not in os.environ:  # as the recipe does: share the cores
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    if world > 1:
        dist.init_process_group("gloo")

    recipe = load_recipe(args.recipe)
    defaults = {k: v for k, v in recipe.items() if k not in ("preset", "ds_config")}
    cli = ["--data", args.data, "--max-steps", str(args.max_steps), "--ds-config", args.ds_config]
    cli += [f"--set={s}" for s in args.set]
    with tempfile.TemporaryDirectory() as scratch:
        cfg, overrides = config_from_args(
            cli + ["--out", scratch, "--resume", "none"],
            prog=args.recipe,
            preset=recipe["preset"],
            ds_config=recipe["ds_config"],
            on_cpu=True,
            **defaults,
        )
        from anneal.config.launch import resolve_launch

        plan = resolve_launch(cfg, overrides, world_size=world, device_type="cpu")
    if plan.bf16:
        raise SystemExit("the reference loop trains in fp32; pass an fp32 ds_config")
    ds = plan.ds_config
    opt = ds["optimizer"]["params"]
    sched = ds["scheduler"]["params"]

    torch.manual_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    model = modellib.build_model(plan.preset)
    modellib.init_weights_(model, std=plan.preset.initializer_range, seed=cfg.train.seed)
    model.train()
    groups = modellib.param_groups(model, weight_decay=opt["weight_decay"])
    params = [q for g in groups for q in g["params"]]
    optimizer = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k != "name"} for g in groups],
        lr=opt["lr"],
        betas=tuple(opt["betas"]),
        eps=opt["eps"],
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda done: lr_ratio(
            done + 1,
            total_num_steps=sched["total_num_steps"],
            warmup_num_steps=sched["warmup_num_steps"],
            warmup_min_ratio=sched.get("warmup_min_ratio", 0.0),
            cos_min_ratio=sched.get("cos_min_ratio", 0.1),
        ),
    )
    net = DistributedDataParallel(model) if world > 1 else model
    stream = TokenStream(
        PackedSplit(Path(cfg.data.path), "train", seq_len=plan.seq_len),
        seed=cfg.train.seed,
        rank=rank,
        world_size=world,
        micro_batch=plan.micro_batch,
        prefetch=cfg.data.prefetch_batches,
    )
    accum, clip = plan.grad_accum, ds.get("gradient_clipping", 0.0)
    losses, norms, lrs, times = [], [], [], []
    for _ in range(args.max_steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros(())
        lrs.append(optimizer.param_groups[0]["lr"])
        for micro in range(accum):
            x, y = stream.next_batch()
            sync = micro == accum - 1 or world == 1
            ctx = net.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                logits = net(input_ids=x).logits
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                (loss / accum).backward()
            step_loss += loss.detach() / accum
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        optimizer.step()
        schedule.step()
        losses.append(step_loss)
        norms.append(norm.detach())
        times.append(time.time())
    stream.close()
    loss_t = torch.stack(losses).double()
    if world > 1:
        dist.all_reduce(loss_t)
        loss_t /= world
    if rank == 0:
        with open(args.rows, "w") as f:
            for i, (lo, n, lr, t) in enumerate(
                zip(loss_t.tolist(), torch.stack(norms).tolist(), lrs, times, strict=True)
            ):
                row = {"step": i + 1, "loss": lo, "grad_norm": n, "lr": lr, "time": t}
                f.write(json.dumps(row) + "\n")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
