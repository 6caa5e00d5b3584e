"""Train a grid of small models (sizes x token budgets) and fit the Chinchilla law to them.

Every run goes through ``anneal.train.run`` (the same path as ``recipes/pretrain_*.py``) in this
process, one after another, each with its own run directory under ``--out``; a finished run is
skipped when the sweep is started again. Each run's cosine schedule ends at its own last step,
as in Hoffmann et al. Then ``anneal.planning.fit_points`` fits L(N, D) to the final validation
losses and writes ``fit.json`` and ``fit.png`` (the same files as ``anneal fit``).

    python recipes/scaling_sweep.py --out runs/scaling_sweep --data data/stdlib
    python recipes/scaling_sweep.py --grid test ...   # the small grid the tests run

The full grid (4 sizes x 3 budgets on the embedded corpus) takes about 25 minutes on 2 CPU
cores; on GPUs launch it with ``deepspeed --num_gpus N recipes/scaling_sweep.py ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import shutil
import sys
import time
from pathlib import Path

from anneal.config.run import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from anneal.config.run_checks import apply_overrides
from anneal.errors import UserError
from anneal.planning import fit_points
from anneal.rundir import config_path

# Every run of the sweep: 8 sequences of 256 tokens per step (divides across 1 or 2 CPU ranks at
# cpu.json's micro-batch of 4; on GPUs pass --set optim.global_batch_tokens=...), the tiny
# recipe's peak LR, warmup a tenth of each run.
OPTIM = OptimConfig(lr=3e-3, global_batch_tokens=8 * 256, warmup_tokens=0, warmup_max_share=0.1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """A model size: overrides of the tiny preset (vocabulary from the data)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int

    @property
    def name(self) -> str:
        return f"h{self.hidden_size}_l{self.num_hidden_layers}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Grid:
    shapes: tuple[Shape, ...]
    tokens: tuple[int, ...]
    """Training tokens per run; rounded up to whole optimizer steps."""


GRIDS = {
    "full": Grid(
        shapes=(
            Shape(
                hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=172
            ),
            Shape(
                hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=344
            ),
            Shape(
                hidden_size=192, num_hidden_layers=3, num_attention_heads=3, intermediate_size=512
            ),
            Shape(
                hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=688
            ),
        ),
        tokens=(2**17, 2**18, 2**19),
    ),
    "test": Grid(
        shapes=(
            Shape(hidden_size=32, num_hidden_layers=1, num_attention_heads=1, intermediate_size=96),
            Shape(
                hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=172
            ),
            Shape(
                hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=344
            ),
        ),
        tokens=(2**13, 2**14),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaling_sweep.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/scaling_sweep", help="sweep directory")
    p.add_argument("--data", default="data/stdlib", help="prepared data directory")
    p.add_argument("--ds-config", default="cpu.json", help="DeepSpeed JSON for every run")
    p.add_argument("--grid", choices=sorted(GRIDS), default="full")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--bootstrap",
        type=int,
        default=inspect.signature(fit_points).parameters["n_bootstrap"].default,
        help="bootstrap resamples of the fit (default %(default)s)",
    )
    p.add_argument("--starts", type=int, help="L-BFGS starts of the fit (default all 4500)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoint")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run"
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p


def _finished(run_dir: Path) -> bool:
    """A run counts as done once it validated after its last step."""
    from anneal.observe.metrics import read_metrics
    from anneal.rundir import read_record

    if not (run_dir / "metrics.jsonl").is_file():
        return False
    last = read_record(run_dir).train_settings["max_steps"]
    return any(r.get("step") == last for r in read_metrics(run_dir, "val"))


def _tokens_per_step(cfg: RunConfig, overrides: list[str], probe_dir: Path) -> int:
    """Tokens per optimizer step of ``cfg`` on this world, from the one batch resolution
    (``anneal.resolution.resolve.resolve_launch``), for a long run in a directory that holds no
    run."""
    import torch

    from anneal.dist import world_size
    from anneal.resolution.resolve import resolve_launch

    probe = dataclasses.replace(
        cfg, out=str(probe_dir), train=dataclasses.replace(cfg.train, max_steps=10**9)
    )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_launch(
        probe, overrides, world_size=world_size(), device_type=device_type
    ).tokens_per_step


def _train_point(shape: Shape, tokens: int, args: argparse.Namespace) -> dict | None:
    """Train one point of the grid in its own run directory under ``--out`` (its checkpoints
    removed after, unless ``--keep-checkpoints``): its summary and seconds taken, or None when
    that run finished before."""
    import torch

    from anneal.cli.recipe import print_once
    from anneal.dist import is_main_process
    from anneal.train import run

    out = Path(args.out)
    cfg = apply_overrides(
        RunConfig(
            out="",
            ds_config=args.ds_config,
            model=ModelConfig(preset="tiny", **dataclasses.asdict(shape)),
            optim=OPTIM,
            data=DataConfig(path=args.data),
            train=TrainConfig(val_every=0, save_every=0, seed=args.seed),
        ),
        args.set,
    )
    batch_tokens = _tokens_per_step(cfg, args.set, out / ".probe")
    steps = max(1, -(-tokens // batch_tokens))
    run_dir = out / f"{shape.name}_d{steps * batch_tokens}"
    if run_dir.is_dir() and config_path(run_dir).is_file() and _finished(run_dir):
        print_once(f"sweep: {run_dir} is finished; skipping")
        return None
    cfg = dataclasses.replace(
        cfg,
        out=str(run_dir),
        train=dataclasses.replace(cfg.train, max_steps=steps, log_every=max(1, steps // 4)),
    )
    overrides = [f"ds.scheduler.params.warmup_num_steps={max(1, steps // 10)}", *args.set]
    cfg = apply_overrides(cfg, overrides)
    start = time.perf_counter()
    summary = run(cfg, overrides)
    seconds = time.perf_counter() - start
    print_once(
        f"sweep: {run_dir.name}: {summary['params']:,} params, "
        f"{summary['tokens']:,} tokens, val loss {summary['val_loss']:.4f}, "
        f"{seconds:.0f} s"
    )
    if not args.keep_checkpoints and is_main_process():
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return {**summary, "seconds": round(seconds, 1)}


def _fit(out: Path, args: argparse.Namespace) -> None:
    """Fit the law to every finished run under ``out``: fit.json, fit.png (where the fit has a
    compute-optimal frontier), printed as ``anneal fit`` prints it."""
    from anneal import planning
    from anneal.observe.formula_plots import plot_fit

    run_dirs = sorted(p.parent for p in out.glob("*/metrics.jsonl"))
    points = [planning.read_run(d) for d in run_dirs]
    start = time.perf_counter()
    result = planning.fit_points(
        points,
        n_bootstrap=args.bootstrap,
        grid_starts=args.starts,
        progress=lambda line: print(f"sweep: fit: {line}", file=sys.stderr, flush=True),
    )
    fit_path = planning.write_fit(result, out / "fit.json")
    print(planning.format_fit(result))
    try:
        plot = plot_fit(result, out / "fit.png", title=f"scaling sweep ({args.grid} grid)")
        print(f"wrote {fit_path} and {plot} (fit took {time.perf_counter() - start:.0f} s)")
    except UserError as e:  # a fit without a compute-optimal frontier
        print(f"wrote {fit_path}; no plot: {e}")


def main(argv: list[str] | None = None) -> int:
    from anneal.cli.recipe import print_once
    from anneal.dist import is_main_process, single_process_env

    args = build_parser().parse_args(argv)
    grid = GRIDS[args.grid]
    out = Path(args.out)
    single_process_env()
    from anneal.dist import init_distributed

    init_distributed()
    rows = []
    try:
        for shape in grid.shapes:
            for tokens in grid.tokens:
                if (row := _train_point(shape, tokens, args)) is not None:
                    rows.append(row)
    except UserError as e:
        print_once(f"error: {e}", file=sys.stderr)
        return 2
    if not is_main_process():
        return 0
    _fit(out, args)
    (out / "sweep.json").write_text(json.dumps({"grid": args.grid, "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    code = main()
    from anneal.dist import shutdown

    shutdown()
    sys.exit(code)
