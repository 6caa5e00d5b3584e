"""The references for the training benchmark: the recipe's model, batches and optimizer trained
without Anneal's loop, on one of two engines (``--engine``).

``torch`` (the default): a plain PyTorch loop. No DeepSpeed in the loop; several ranks go
through torch's DistributedDataParallel with gloo (``no_sync`` on all micro-batches but the
last, as DeepSpeed reduces only at the boundary). Against it, the recipe's number is what
Anneal and DeepSpeed cost together.

``deepspeed``: a bare DeepSpeed engine, the baseline of what Anneal's loop costs on top of
DeepSpeed. ``deepspeed.initialize`` with the recipe's batch, ``gradient_clipping``,
``optimizer`` block (DeepSpeed's AdamW as the ds_config names it) and ZeRO stage, then forward,
``engine.backward``, ``engine.step`` in a loop: no Trainer, observers, guard, metrics, heartbeat
or per-step collective. A sparse preset's engine gets the ds_config's ``expert_parallel``
section as resolution filled it (AutoEP, under Anneal's transformers 5.24 repair of
``deepspeed.initialize``: ``anneal.train.experts.autoep_registry_fix``) and the recipe's
objective, the language-model loss plus the router's weighted aux and z losses
(``moe_objective``); the plain loop refuses a sparse preset. The rest of ``zero_optimization``
is DeepSpeed's defaults (``--shipped-zero``: the ds_config's whole section), so that a gap the
shipped settings make can be told from one the loop makes. The model is built whole and
partitioned by ``deepspeed.initialize``, as a bare script would; the batches are drawn before
the loop, so the timed loop holds nothing but the engine.

Common to both: the model and its init (``anneal.model``), the same batches in the same order
(the windows of Anneal's ``TokenStream``), micro-batch and accumulation, two AdamW groups (decay
on matrices only), the global L2 clip and the warmup-cosine formula (``lr_ratio`` as a torch
``LambdaLR``; DeepSpeed's ``WarmupCosineLR`` would start two steps late), all read from the
recipe's resolved launch, so that the only difference from the recipe is the loop around the
step. The run is ``train.stop_at_step`` steps if set, else ``--max-steps``, as in the recipe.

    python bench/reference.py recipes/pretrain_tiny.py --data data/stdlib --max-steps 20 \
        --rows steps.jsonl [--engine deepspeed] [--set KEY=VALUE ...]
    python -m torch.distributed.run --nproc_per_node 2 bench/reference.py ...   (DDP)
    deepspeed --num_gpus 2 --no_local_rank bench/reference.py ... --engine deepspeed

Writes one JSON line per optimizer step to ``--rows`` (rank 0): step, loss (mean over
micro-batches and ranks), grad_norm (before clipping), lr, time (wall clock after the step). The
loss and norm stay on the device until the end, so neither loop has a per-step host sync or a
collective beyond the gradients' own.
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


def resolve(args, world: int):
    """The recipe's RunConfig and resolved launch for these flags, as the recipe resolves them."""
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.resolution.resolve import resolve_launch

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
        plan = resolve_launch(cfg, overrides, world_size=world, device_type="cpu")
    if plan.bf16:
        raise SystemExit("the reference loops train in fp32; pass an fp32 ds_config")
    return cfg, plan


def build_model(plan, seed: int):
    import numpy as np
    import torch

    from anneal import model as modellib

    torch.manual_seed(seed)
    np.random.seed(seed)
    model = modellib.build_model(plan.preset)
    modellib.init_weights_(model, std=plan.preset.initializer_range, seed=seed)
    model.train()
    return model


def warmup_cosine(optimizer, sched: dict):
    """The recipe's warmup-cosine LR (``anneal.config.schedule``) as a torch scheduler."""
    import torch

    from anneal.config.schedule import lr_ratio

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda done: lr_ratio(
            done + 1,
            total_num_steps=sched["total_num_steps"],
            warmup_num_steps=sched["warmup_num_steps"],
            warmup_min_ratio=sched.get("warmup_min_ratio", 0.0),
            cos_min_ratio=sched.get("cos_min_ratio", 0.1),
        ),
    )


def open_stream(cfg, plan, rank: int, world: int):
    from anneal.data.stream import PackedSplit, TokenStream

    return TokenStream(
        PackedSplit(Path(cfg.data.path), "train", seq_len=plan.seq_len),
        seed=cfg.train.seed,
        rank=rank,
        world_size=world,
        micro_batch=plan.micro_batch,
        prefetch=cfg.data.prefetch_batches,
    )


def plain_loop(cfg, plan, *, steps: int, rank: int, world: int) -> dict:
    """Plain PyTorch (DDP with gloo when ``world`` > 1); returns the per-step record."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from anneal import model as modellib

    if plan.preset.moe is not None:
        raise SystemExit(
            f"reference.py: the plain loop has no expert layer for the sparse preset "
            f"{plan.preset.name}: use --engine deepspeed (AutoEP), as bench_train.py --bare does"
        )
    if world > 1:
        dist.init_process_group("gloo")
    ds = plan.ds_config
    opt = ds["optimizer"]["params"]
    model = build_model(plan, cfg.train.seed)
    groups = modellib.param_groups(model, weight_decay=opt["weight_decay"])
    params = [q for g in groups for q in g["params"]]
    optimizer = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k != "name"} for g in groups],
        lr=opt["lr"],
        betas=tuple(opt["betas"]),
        eps=opt["eps"],
    )
    schedule = warmup_cosine(optimizer, ds["scheduler"]["params"])
    net = DistributedDataParallel(model) if world > 1 else model
    stream = open_stream(cfg, plan, rank, world)
    accum, clip = plan.grad_accum, ds.get("gradient_clipping", 0.0)
    rec = {"loss": [], "grad_norm": [], "lr": [], "time": []}
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros(())
        rec["lr"].append(optimizer.param_groups[0]["lr"])
        for micro in range(accum):
            x, y = stream.next_batch()
            sync = micro == accum - 1 or world == 1
            with net.no_sync() if not sync else contextlib.nullcontext():
                logits = net(input_ids=x).logits
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                (loss / accum).backward()
            step_loss += loss.detach() / accum
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        optimizer.step()
        schedule.step()
        rec["loss"].append(step_loss)
        rec["grad_norm"].append(norm.detach())
        rec["time"].append(time.time())
    stream.close()
    return rec


def bare_config(ds: dict, *, shipped_zero: bool) -> dict:
    """The bare engine's config: the recipe's batch, clip, optimizer and ZeRO stage (the whole
    ``zero_optimization`` section with ``shipped_zero``), DeepSpeed's defaults for the rest."""
    zero = ds.get("zero_optimization", {})
    return {
        "train_batch_size": ds["train_batch_size"],
        "train_micro_batch_size_per_gpu": ds["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": ds["gradient_accumulation_steps"],
        "gradient_clipping": ds.get("gradient_clipping", 0.0),
        "optimizer": ds["optimizer"],
        "zero_optimization": dict(zero) if shipped_zero else {"stage": zero.get("stage", 0)},
        "steps_per_print": 10**9,
        # a sparse model's AutoEP section as resolution filled it (degree, preset, expert loop)
        **({"expert_parallel": ds["expert_parallel"]} if "expert_parallel" in ds else {}),
    }


def moe_objective(output, lm_loss, moe):
    """The objective of a micro-batch as the recipe's step computes it
    (``anneal.train.experts.RouterStats.objective``): the language-model loss, plus for a sparse
    model ``aux_loss_coef`` x the model's load-balancing loss and ``z_loss_coef`` x the router
    z-loss (the mean over layers of the mean squared log-sum-exp of the router logits). The
    recipe also records the router's entropy and counts for its train row; that is its loop's
    work, not the model's, and stays out of the bare loop."""
    import torch

    if moe is None:
        return lm_loss
    z = torch.stack(
        [torch.logsumexp(g.float(), dim=-1).square().mean() for g in output.router_logits]
    ).mean()
    return lm_loss + moe.aux_loss_coef * output.aux_loss + moe.z_loss_coef * z


def bare_loop(cfg, plan, *, steps: int, rank: int, world: int, shipped_zero: bool) -> dict:
    """A bare DeepSpeed engine; returns the per-step record."""
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.nn.functional as F

    from anneal import model as modellib
    from anneal.train import experts

    # No JIT build of DeepSpeed's CPU shared-memory op (anneal.dist says why: a process killed
    # in the build leaves a lock that hangs every later one); training's collectives are gloo's.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if "RANK" not in os.environ:  # plain python: a world of one (DeepSpeed would look for MPI)
        from anneal.dist import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ds = plan.ds_config
    stream = open_stream(cfg, plan, rank, world)
    batches = [[stream.next_batch() for _ in range(plan.grad_accum)] for _ in range(steps)]
    stream.close()
    model = build_model(plan, cfg.train.seed)
    moe = plan.preset.moe
    # AutoEP against transformers 5.24 needs the recipe's repair for the call (its docstring)
    with experts.autoep_registry_fix() if moe else contextlib.nullcontext():
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=modellib.param_groups(
                model, weight_decay=ds["optimizer"]["params"]["weight_decay"]
            ),
            config=bare_config(ds, shipped_zero=shipped_zero),
            lr_scheduler=lambda opt: warmup_cosine(opt, ds["scheduler"]["params"]),
        )
    rec = {"loss": [], "grad_norm": [], "lr": [], "time": []}
    for micro_batches in batches:
        rec["lr"].append(engine.get_lr()[0])
        step_loss = torch.zeros(())
        for x, y in micro_batches:
            output = engine(input_ids=x)
            logits = output.logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            engine.backward(moe_objective(output, loss, moe))
            engine.step()
            step_loss += loss.detach() / plan.grad_accum
        rec["loss"].append(step_loss)
        rec["grad_norm"].append(engine.get_global_grad_norm())
        rec["time"].append(time.time())
    return rec


def write_rows(path: str, rec: dict, *, rank: int, world: int) -> None:
    """Rank 0 writes the rows; the loss is averaged over ranks here, once, after the loop."""
    import torch
    import torch.distributed as dist

    loss_t = torch.stack(rec["loss"]).double()
    if world > 1:
        dist.all_reduce(loss_t)
        loss_t /= world
    norms = [float("nan") if n is None else float(n) for n in rec["grad_norm"]]
    if rank == 0:
        with open(path, "w") as f:
            for i, (lo, n, lr, t) in enumerate(
                zip(loss_t.tolist(), norms, rec["lr"], rec["time"], strict=True)
            ):
                row = {"step": i + 1, "loss": lo, "grad_norm": n, "lr": lr, "time": t}
                f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", help="whose defaults to take, e.g. recipes/pretrain_tiny.py")
    p.add_argument("--data", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--ds-config", default="cpu.json", help="read for the batch and optimizer")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--rows", required=True, help="JSON Lines file, one row per step")
    p.add_argument("--engine", choices=("torch", "deepspeed"), default="torch")
    p.add_argument(
        "--shipped-zero",
        action="store_true",
        help="deepspeed engine: the ds_config's whole zero_optimization section, not its stage",
    )
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if "OMP_NUM_THREADS" not in os.environ:  # as the recipe does: share the cores
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    cfg, plan = resolve(args, world)
    steps = cfg.train.stop_at_step or cfg.train.max_steps
    if args.engine == "torch":
        rec = plain_loop(cfg, plan, steps=steps, rank=rank, world=world)
    else:
        rec = bare_loop(
            cfg, plan, steps=steps, rank=rank, world=world, shipped_zero=args.shipped_zero
        )
    write_rows(args.rows, rec, rank=rank, world=world)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
