"""The recipe command line, shared by every ``recipes/pretrain_*.py`` (flags in README.md).

Recipes are thin: a preset, a ds_config name and defaults. This module turns their argv into a
RunConfig and calls ``anneal.train.run``; it is the only place that exits the process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import socket
import sys
from typing import NoReturn

from anneal.cli.args import checked, path
from anneal.config.run import (
    AUTO,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    warn_renamed,
)
from anneal.config.run_checks import apply_overrides
from anneal.errors import UserError
from anneal.model.presets import PRETRAINED


def build_parser(prog: str, *, preset: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Continue pretraining the Hugging Face model of --init-from DIR"
            if preset == PRETRAINED
            else f"Pretrain the {preset} preset"
        )
        + " with "
        "DeepSpeed. Run with `deepspeed [--num_gpus N | --hostfile F] "
        f"{prog} ...` or plain `python {prog}` (one process).",
    )
    p.add_argument("--out", type=path, help="run directory (default runs/<recipe>)")
    p.add_argument("--data", type=path, help="prepared data directory")
    p.add_argument("--ds-config", type=path, help="DeepSpeed JSON: a path or a name in ds_configs/")
    p.add_argument("--max-steps", type=int, help="optimizer steps in the whole run")
    p.add_argument(
        "--resume",
        type=path,
        help="auto (default): newest intact checkpoint in --out; none (a new run: --out must "
        "not hold one); or a checkpoint path",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="start over in an --out that holds a run: its config, checkpoints, metrics, "
        "plots and report are moved to OUT/previous-<time>/ first (nothing is deleted)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="train in an --out that holds files but no run: the run's files go beside them, "
        "and none of them is replaced",
    )
    p.add_argument(
        "--init-from",
        metavar="DIR",
        type=path,
        help="continue pretraining a Hugging Face model: a local directory as save_pretrained "
        "writes it (config.json, safetensors or .bin weights, tokenizer); its architecture "
        "replaces the preset's (model.init_from)",
    )
    p.add_argument(
        "--cooldown-from",
        "--branch-from",  # its name before issue 28, kept for scripts that use it
        dest="cooldown_from",
        metavar="CKPT",
        type=path,
        help="start a cooldown branch of a WSD run in a new --out: from this checkpoint (a tag "
        "directory, or a run directory: its newest), the LR decays to the floor over --set "
        "optim.cooldown_tokens=N (train.cooldown_from; docs/training.md)",
    )
    p.add_argument("--val-every", type=int, help="validate every N steps")
    p.add_argument(  # its name before issue 40: still taken, with a warning
        "--eval-every", dest="eval_every", type=int, help=argparse.SUPPRESS
    )
    p.add_argument("--save-every", type=int, help="checkpoint every N steps")
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value: model.*, data.*, train.* or ds.* (the "
        "ds_config, e.g. ds.gradient_accumulation_steps=4)",
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return checked(p)


def config_from_args(
    argv: list[str],
    *,
    prog: str,
    preset: str,
    ds_config: str,
    cpu_ds_config: str = "cpu.json",
    on_cpu: bool = False,
    train: TrainConfig = TrainConfig(),
    model: ModelConfig | None = None,
    optim: OptimConfig = OptimConfig(),
    data: DataConfig = DataConfig(),
) -> tuple[RunConfig, list[str]]:
    """RunConfig from recipe defaults + flags + ``--set`` overrides, and the raw overrides.

    Without ``--ds-config`` a CPU-only machine gets ``cpu_ds_config`` (fp32 ZeRO-3 with torch's
    AdamW); GPUs get the recipe's bf16 config.
    """
    args = build_parser(prog, preset=preset).parse_args(argv)
    if args.resume is not None and not args.resume.strip():
        raise UserError(
            "--resume is empty: give auto (the newest intact checkpoint in --out), none (a new "
            "run) or the path of a checkpoint (RUN/checkpoints/stepNNNNNNNN)."
        )
    name = os.path.splitext(os.path.basename(prog))[0]
    model = dataclasses.replace(model or ModelConfig(), preset=preset)
    if args.init_from is not None:
        if not args.init_from.strip():
            raise UserError(
                "--init-from is empty: give the directory of a Hugging Face model (config.json "
                "and its weights, as save_pretrained writes them)."
            )
        model = dataclasses.replace(model, init_from=args.init_from)
    if args.cooldown_from is not None and not args.cooldown_from.strip():
        raise UserError(
            "--cooldown-from is empty: give a checkpoint of a WSD run "
            "(RUN/checkpoints/stepNNNNNNNN) or its run directory."
        )
    if args.eval_every is not None:
        warn_renamed("--eval-every", "--val-every")
        if args.val_every is None:
            args.val_every = args.eval_every
    train = dataclasses.replace(
        train,
        **{
            k: v
            for k, v in (
                ("max_steps", args.max_steps),
                ("val_every", args.val_every),
                ("save_every", args.save_every),
                ("seed", args.seed),
                ("cooldown_from", args.cooldown_from),
            )
            if v is not None
        },
    )
    if args.data:
        data = dataclasses.replace(data, path=args.data)
    cfg = RunConfig(
        out=args.out or f"runs/{name}",
        ds_config=args.ds_config or (cpu_ds_config if on_cpu else ds_config),
        resume=args.resume or ("none" if args.restart else AUTO),
        resume_explicit=args.resume is not None,
        restart=args.restart,
        force=args.force,
        model=model,
        optim=optim,
        data=data,
        train=train,
    )
    return apply_overrides(cfg, args.set), args.set


def load_recipe(path: str | os.PathLike) -> dict:
    """The ``RECIPE`` dict of a recipe file (its defaults, the arguments it passes to
    ``main``), without running its main."""
    if not os.path.isfile(path):
        raise UserError(f"recipe {path}: no such file (the recipes are in recipes/).")
    namespace = runpy.run_path(str(path), run_name="anneal_recipe")
    if not isinstance(namespace.get("RECIPE"), dict):
        raise UserError(
            f"recipe {path}: defines no RECIPE dict, so it is not an Anneal recipe (see "
            f"recipes/pretrain_tiny.py for the shape)."
        )
    return namespace["RECIPE"]


def main(*, preset: str, ds_config: str, argv: list[str] | None = None, **defaults) -> None:
    """Entry point of a recipe: parse, train, print the summary.

    A UserError becomes one paragraph on stderr and exit 2: printed once when every rank saw
    it (the launch resolution), else by the rank that saw it, with its rank and host. Any other
    exception keeps its traceback.
    """
    import torch

    from anneal.resilience.preempt import Preempted

    argv = sys.argv[1:] if argv is None else argv
    prog = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "recipe"
    on_cpu = not torch.cuda.is_available()
    try:
        cfg, overrides = config_from_args(
            argv, prog=prog, preset=preset, ds_config=ds_config, on_cpu=on_cpu, **defaults
        )
        if on_cpu and cfg.ds_config != ds_config and not _flag_given(argv, "--ds-config"):
            print_once(f"no GPU found: using ds_configs/{cfg.ds_config} (fp32 for CPUs)")
        from anneal.dist import single_process_env
        from anneal.train import run

        single_process_env()
        summary = run(cfg, overrides)
    except UserError as e:
        if e.every_rank:
            print_once(f"error: {e}", file=sys.stderr)
        else:
            where = f"rank {os.environ.get('RANK', '0')} on {socket.gethostname()}"
            print(f"error ({where}): {e}", file=sys.stderr, flush=True)
        leave_promptly()  # a refusing rank is in no collective
        sys.exit(2)
    except Preempted as stop:  # its checkpoint committed on every rank: 75, for the requeue
        leave_promptly()
        exit_preempted(stop.code)
    print_once(format_summary(summary))
    leave_promptly()


def leave_promptly() -> None:
    """The last call of a rank that finished, refused or stopped: its process group destroyed
    (``anneal.dist.shutdown``; every rank is past its last collective), then every object put
    out of the garbage collector's reach (``gc.freeze``). The interpreter's own shutdown runs
    the collector over the whole heap of torch, DeepSpeed and transformers objects several
    times: 2.3-2.4 s of a preempted tiny run's exit here (perf: ``gc_collect_main``), after its
    checkpoint was committed, out of the scheduler's grace time (docs/cluster.md). Frozen,
    those passes find nothing to do; atexit handlers, the flushes of files and logs, and the
    destructors that reference counting runs are unchanged, and everything the run writes is
    closed by then (``anneal.train.Trainer.train``). Every process that imports Anneal also
    freezes at exit (``anneal/__init__.py``); a rank does it here already, before the atexit
    handlers that ``exit_preempted`` runs."""
    import gc

    from anneal.dist import shutdown

    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()


def exit_preempted(status: int) -> NoReturn:
    """A preempted rank's end, after ``leave_promptly``: the atexit handlers (logging's flush
    among them), the standard streams flushed, then ``os._exit(status)``. What the interpreter's
    shutdown would still do frees memory and runs C++ static destructors (perf: torch's
    dispatcher deregistering its operators, module dicts torn down): 0.3 s of a preempted tiny
    run's exit unloaded, 0.5-0.9 s more at load 8 on 2 cores here, out of the grace time, for
    nothing a requeue needs: the checkpoint is committed, metrics.jsonl and the other files of
    the run are closed (``anneal.train.Trainer.train``), the process group destroyed."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _flag_given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def print_once(msg: str, file=sys.stdout) -> None:
    """Print from the first rank only (before or after torch.distributed is set up)."""
    if os.environ.get("RANK", "0") == "0":
        print(msg, file=file, flush=True)


def format_summary(s: dict) -> str:
    def f(v, fmt):
        return format(v, fmt) if v is not None else "n/a"

    last = s.get("max_steps")
    steps = f"steps {s['step']}" + (
        f" of {last} (stopped early: the same command resumes)" if last and s["step"] < last else ""
    )
    if s["val_loss"] is not None:
        val = f"val loss {s['val_loss']:.4f}, val bpb {f(s['val_bpb'], '.4f')}"
        val += f" (at step {s['val_step']})" if s.get("val_step") not in (None, s["step"]) else ""
    elif s.get("val_every") is not None:
        every = f"every {s['val_every']} steps and " if s["val_every"] else ""
        val = f"val loss not measured yet ({every}after the last step)"
    else:
        val = "val loss n/a (no val split)"
    return (
        f"\n== summary ==\n{steps}, tokens {s['tokens']:,}\n"
        f"final train loss {f(s['train_loss'], '.4f')}, {val}\n"
        f"throughput {f(s['tokens_per_s'], ',.0f')} tokens/s\nrun directory {s['run_dir']}"
    )
