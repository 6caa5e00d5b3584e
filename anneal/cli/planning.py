"""``anneal plan``, ``anneal fit``, ``anneal estimate``: what to train for a budget, the scaling
law fitted to finished runs, and the per-GPU memory of a run (anneal/planning/; docs/planning.md).

Every default below is read from the library (a signature or a module constant), never typed
again here; tests/cli/test_cli.py checks that.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import sys
from pathlib import Path

from anneal.cli.args import path
from anneal.errors import UserError
from anneal.hardware import DEFAULT_MFU, GiB


def _default(fn, name: str):
    """The default of parameter ``name`` of ``fn``, for argparse."""
    return inspect.signature(fn).parameters[name].default


def _plan(args: argparse.Namespace) -> int:
    import json

    from anneal import planning

    mfu, mfu_source = args.mfu, None
    if mfu is None and args.mfu_from:
        mfu, mfu_source = planning.mfu_from_run(args.mfu_from)
    result = planning.plan(
        flops=args.flops,
        params=args.params,
        tokens=args.tokens,
        target_loss=args.target_loss,
        gpus=args.gpus,
        hours=args.hours,
        gpu=args.gpu,
        mfu=mfu,
        mfu_source=mfu_source,
        fit=planning.load_fit(args.fit),
        tokens_per_param=planning.parse_rule(args.rule) if args.rule else None,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        model=args.model,
    )
    print(json.dumps(result.to_dict()) if args.json else planning.format_plan(result))
    return 0


def _fit(args: argparse.Namespace) -> int:
    import json

    from anneal import planning
    from anneal.planning.fit import claim_fit_outputs

    if bool(args.runs) == bool(args.csv):
        raise UserError("anneal fit: give run directories or --csv FILE (one of the two).")

    def say(line: str) -> None:  # progress and notes: stderr, so that --json stays clean
        print(f"anneal fit: {line}", file=sys.stderr, flush=True)

    if args.csv:
        points = planning.read_csv(args.csv)
    else:
        points, skipped = planning.read_runs(args.runs)
        if skipped:
            say(f"skipped {len(skipped)} paths that are not run directories: {', '.join(skipped)}")
    out = Path(args.out)
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    claim_fit_outputs(out, plot, force=args.force)  # before the fit, which takes time
    result = planning.fit_points(
        points, n_bootstrap=args.bootstrap, grid_starts=args.starts, seed=args.seed, progress=say
    )
    out = planning.write_fit(result, out)
    try:
        result.to_fit()
        from anneal.observe.formula_plots import plot_fit

        plot_fit(result, plot)
    except UserError as e:  # no compute-optimal frontier to draw
        plot = None
        logging.warning("no plot: %s", e)
    if args.json:
        print(json.dumps({**result.to_json(), "fit_file": str(out), "plot": plot and str(plot)}))
    else:
        print(planning.format_fit(result))
        print(f"wrote {out}" + (f" and {plot}" if plot else ""))
    return 0


def _estimate(args: argparse.Namespace) -> int:
    import json

    from anneal.hardware import get_gpu
    from anneal.model.float8_rule import sparse_refusal
    from anneal.planning import memory, memory_io, memory_levers
    from anneal.resolution.ds import find_ds_config, load_ds_config

    preset, record = memory_io.load_model(args.model)  # record: when --model is a run's
    if args.vocab_size:
        preset = preset.with_vocab(args.vocab_size)
    if record is not None and record.ds_config and not args.ds_config:
        ds = record.ds_config
    else:
        default = memory.DEFAULT_SPARSE_DS_CONFIG if preset.is_moe else memory.DEFAULT_DS_CONFIG
        ds = load_ds_config(find_ds_config(args.ds_config or default))
    zero = memory.ZeroSetup.from_ds_config(ds)
    if args.gpu_mem_gib is not None:
        if not args.gpu_mem_gib > 0:
            raise UserError(f"--gpu-mem-gib {args.gpu_mem_gib}: must be positive.")
        capacity, capacity_name = int(args.gpu_mem_gib * GiB), f"{args.gpu_mem_gib:g} GiB"
    else:
        spec = get_gpu(args.gpu)
        capacity, capacity_name = spec.memory_bytes, spec.name
    work = _workload(args, preset, ds, record)
    if work.float8.on and (reason := sparse_refusal(preset)):
        raise UserError(
            f"--float8 {work.float8.recipe} with the sparse model {preset.name}: {reason}, so "
            f"the launch refuses it. Estimate this model with --float8 off, or float8 on a "
            f"dense preset."
        )
    est = memory.estimate(preset, zero, work, capacity=capacity)
    lever_list = []
    if not est.fits:
        lever_list = memory_levers.levers(
            preset, zero, work, capacity=capacity, runtime_bytes=est.runtime
        )
    if args.json:
        doc = {
            **est.to_dict(),
            "model": preset.name,
            **memory_io.compute_figures(preset, work, gpu=args.gpu),
            "zero_stage": zero.stage,
            "n_gpus": work.n_gpus,
            "tp": work.tp,
            "sp": work.sp,
            "ep": work.ep,
            "micro_batch": work.micro_batch,
            "seq_len": work.seq_len,
            "loss": work.loss,
            "loss_chunk_tokens": work.loss_chunk_tokens,
            "levers": [dataclasses.asdict(lever) for lever in lever_list],
            "float8": memory_io.float8_figures(preset, zero, work, gpu=args.gpu),
        }
        print(json.dumps(doc))
    else:
        print(
            memory_io.format_estimate(
                est,
                preset=preset,
                zero=zero,
                work=work,
                capacity_name=capacity_name,
                lever_list=lever_list,
                gpu=args.gpu,
            )
        )
    return 0


def _workload(args: argparse.Namespace, preset, ds: dict, record):
    """The estimate's ``memory.Workload``: each flag given, else the run's setting when
    ``--model`` is a run's config.json (``record``), else the ds_config's or the default."""
    from anneal.config.ds_schema import degrees
    from anneal.planning import memory
    from anneal.planning.float8_costs import Float8Setting

    loss = record.loss_settings if record is not None else {}
    if args.loss is not None:
        loss["loss"] = args.loss
    train = record.train_settings if record is not None else {}

    def setting(flag, key: str, default: str) -> str:
        return flag if flag is not None else str(train.get(key, default))

    d = degrees(ds)
    return memory.Workload(
        micro_batch=ds["train_micro_batch_size_per_gpu"]
        if args.micro_batch is None
        else args.micro_batch,
        seq_len=preset.seq_len if args.seq is None else args.seq,
        n_gpus=args.nodes * args.gpus_per_node,
        activation_checkpointing=args.activation_checkpointing,
        eager_attention=args.eager_attention,
        tp=d.tp if args.tp is None else args.tp,
        sp=d.sp if args.sp is None else args.sp,
        ep=d.ep if args.ep is None else args.ep,
        float8=Float8Setting(
            recipe=setting(args.float8, "float8", "off"),
            layers=setting(args.float8_layers, "float8_layers", "auto"),
            compiled=setting(args.compile, "compile", "off") != "off",
        ),
        **loss,
    )


def add_commands(sub) -> None:
    """``plan``, ``fit`` and ``estimate``, on the top-level subparsers ``sub``."""
    _add_plan(sub)
    _add_fit(sub)
    _add_estimate(sub)


def _gpu_names() -> str:
    from anneal.hardware import GPUS

    return " | ".join(GPUS)


def _add_plan(sub) -> None:
    from anneal import planning

    plan = sub.add_parser(
        "plan",
        help="what to train for a budget: compute-optimal N and D, loss, steps, GPU-hours",
        description="Give exactly one budget: --flops, --gpus with --hours, --params, --tokens, "
        "--target-loss or --model. FLOPs are 6ND (N: a sparse model's active parameters). See "
        "docs/planning.md.",
    )
    plan.add_argument("--flops", type=float, help="training compute C in FLOPs")
    plan.add_argument("--gpus", type=int, help="GPUs (with --hours: the budget; else wall-clock)")
    plan.add_argument("--hours", type=float, help="wall-clock hours on --gpus")
    plan.add_argument(
        "--gpu",
        default=_default(planning.plan, "gpu"),
        help=f"{_gpu_names()} (default %(default)s)",
    )
    plan.add_argument(
        "--mfu",
        type=float,
        help=f"model FLOPs utilisation in (0, 1] (default {DEFAULT_MFU['cuda']})",
    )
    plan.add_argument(
        "--mfu-from", metavar="RUN_DIR", type=path, help="use the MFU measured in a run"
    )
    plan.add_argument("--params", type=float, help="model size N in parameters")
    plan.add_argument("--tokens", type=float, help="training tokens D")
    plan.add_argument(
        "--model",
        help="a preset: N is its parameters, a sparse one's active parameters (docs/planning.md)",
    )
    plan.add_argument("--target-loss", type=float, help="final loss in nats/token")
    plan.add_argument(
        "--fit",
        type=path,
        default=planning.DEFAULT_FIT,
        help=f"{' | '.join(planning.FITS)} | a file from `anneal fit` (default %(default)s)",
    )
    plan.add_argument("--rule", help="tokens-per-param=R instead of the fit's frontier")
    plan.add_argument(
        "--global-batch",
        type=int,
        default=_default(planning.plan, "global_batch"),
        help="sequences per optimizer step (default %(default)s)",
    )
    plan.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=_plan)


def _add_fit(sub) -> None:
    import math

    from anneal import planning

    fit = sub.add_parser(
        "fit",
        help="fit L(N, D) = E + A/N^alpha + B/D^beta to finished runs",
        description=f"Hoffmann et al. 2022 approach 3: Huber loss (delta {planning.HUBER_DELTA:g}) "
        "on log-loss, L-BFGS from a grid of starts, bootstrap 95% intervals. "
        "See docs/planning.md.",
    )
    fit.add_argument(
        "runs", nargs="*", metavar="RUN_DIR", type=path, help="finished run directories"
    )
    fit.add_argument("--csv", type=path, help="CSV with columns params,tokens,loss instead of runs")
    fit.add_argument("--out", type=path, default="scaling_fit.json", help="fit file to write")
    fit.add_argument("--plot", type=path, help="PNG to write (default: --out with .png)")
    fit.add_argument(
        "--force",
        action="store_true",
        help="replace an --out (and its plot) that an earlier `anneal fit` wrote",
    )
    fit.add_argument(
        "--bootstrap",
        type=int,
        default=_default(planning.fit_points, "n_bootstrap"),
        help="bootstrap resamples (default %(default)s)",
    )
    grid_size = math.prod(len(v) for v in planning.INIT_GRID.values())
    fit.add_argument(
        "--starts",
        type=int,
        default=_default(planning.fit_points, "grid_starts"),
        help=f"L-BFGS from this many best grid points (default all {grid_size})",
    )
    fit.add_argument(
        "--seed",
        type=int,
        default=_default(planning.fit_points, "seed"),
        help="seed of the bootstrap resamples (default %(default)s)",
    )
    fit.add_argument("--json", action="store_true", help="print one JSON object")
    fit.set_defaults(func=_fit)


def _add_estimate(sub) -> None:
    from anneal.config.run import TrainConfig
    from anneal.config.run_checks import setting_choices
    from anneal.hardware import DEFAULT_GPU
    from anneal.model import NOMINAL_VOCAB
    from anneal.planning import memory

    est = sub.add_parser(
        "estimate",
        help="per-GPU memory of a run: ZeRO model states, activations, buffers; levers",
        description="See docs/planning.md.",
    )
    est.add_argument("--model", type=path, required=True, help="preset name or a config.json")
    est.add_argument(
        "--ds-config",
        type=path,
        help="DeepSpeed JSON (default: the run's when --model is a run's config.json, else "
        f"{memory.DEFAULT_DS_CONFIG}; {memory.DEFAULT_SPARSE_DS_CONFIG} for a sparse model)",
    )
    est.add_argument(
        "--nodes", type=int, default=memory.DEFAULT_NODES, help="(default %(default)s)"
    )
    est.add_argument(
        "--gpus-per-node",
        type=int,
        default=memory.DEFAULT_GPUS_PER_NODE,
        help="(default %(default)s)",
    )
    est.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel degree (default: the ds_config's tensor_parallel.autotp_size, 1)",
    )
    est.add_argument(
        "--sp",
        type=int,
        help="Ulysses sequence-parallel degree (default: the ds_config's sequence_parallel_size)",
    )
    est.add_argument(
        "--ep",
        type=int,
        help="expert-parallel degree of a sparse model (default: the ds_config's "
        "expert_parallel.autoep_size, 1)",
    )
    est.add_argument("--seq", type=int, help="tokens per sequence (default: the model's)")
    est.add_argument("--micro-batch", type=int, help="default: the ds_config's")
    est.add_argument("--activation-checkpointing", action="store_true")
    est.add_argument(
        "--loss",
        choices=("chunked", "plain"),
        help="train.loss (default: the run's when --model is a run's config.json, else chunked)",
    )
    est.add_argument(
        "--eager-attention",
        action="store_true",
        help="count stored attention scores (Anneal's SDPA attention stores none)",
    )
    est.add_argument(
        "--vocab-size", type=int, help=f"default: the model's (presets: {NOMINAL_VOCAB})"
    )
    for flag, key in (("--float8", "float8"), ("--float8-layers", "float8_layers")):
        est.add_argument(
            flag,
            choices=setting_choices("train", key),
            help=f"train.{key} (default: the run's when --model is a run's config.json, else "
            f"{TrainConfig.__dataclass_fields__[key].default}; docs/throughput.md)",
        )
    est.add_argument(
        "--compile",
        choices=setting_choices("train", "compile"),
        help="train.compile: whether float8's casts are fused (default: the run's, else off)",
    )
    est.add_argument("--gpu", default=DEFAULT_GPU, help=f"{_gpu_names()} (default %(default)s)")
    est.add_argument("--gpu-mem-gib", type=float, help="device memory instead of --gpu")
    est.add_argument("--json", action="store_true", help="print one JSON object")
    est.set_defaults(func=_estimate)
