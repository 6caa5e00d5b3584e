"""Launched by tests/train/test_compile.py on 2 ranks (tests/scripts/ranks.py).

    compile_runs.py RUNS_DIR STAGE... -- RECIPE_ARGS...

For each ZeRO STAGE, one after the other in this process, three runs of the tiny recipe with
RECIPE_ARGS through Anneal's own entry (``anneal.train.run``: the real engine, the Trainer,
its checkpoints): ``RUNS_DIR/eager{STAGE}`` with ``train.compile=off``,
``RUNS_DIR/compiled{STAGE}`` with ``train.compile=torch`` (the same steps, saving a
checkpoint every ``--save-every`` of RECIPE_ARGS), and ``RUNS_DIR/resumed{STAGE}``, compiled
too, resumed from the compiled run's first checkpoint (``--resume`` its tag directory) to the
same last step. The test reads their metrics.jsonl.

One process builds every engine, so that inductor's caches (in memory and on disk) serve the
compilations after the first: a stage's compiled graph is compiled once, not once a launch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def one_run(recipe_args: list[str], out: Path, *extra: str) -> float:
    """The tiny recipe's run into ``out`` with ``extra`` after RECIPE_ARGS; its seconds."""
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.train import run

    tiny = "recipes/pretrain_tiny.py"
    argv = [*recipe_args, "--out", str(out), *extra]
    t0 = time.perf_counter()
    run(*config_from_args(argv, prog=tiny, on_cpu=True, **load_recipe(tiny)))
    return time.perf_counter() - t0


def first_checkpoint(run_dir: Path) -> Path:
    """The tag directory of ``run_dir``'s earliest intact checkpoint."""
    from anneal.resilience.checkpoint import intact_checkpoints

    return intact_checkpoints(run_dir / "checkpoints")[0]


def main() -> None:
    from anneal.dist import init_distributed, print0

    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    cut = argv.index("--")
    (runs_dir, *stages), recipe_args = argv[:cut], argv[cut + 1 :]
    runs = Path(runs_dir)
    init_distributed(600)
    for stage in stages:
        at_stage = ["--set", f"ds.zero_optimization.stage={stage}"]
        compiled = ["--set", "train.compile=torch"]
        took = {"eager": one_run(recipe_args, runs / f"eager{stage}", *at_stage)}
        took["compiled"] = one_run(recipe_args, runs / f"compiled{stage}", *at_stage, *compiled)
        tag = first_checkpoint(runs / f"compiled{stage}")
        took["resumed"] = one_run(
            recipe_args, runs / f"resumed{stage}", *at_stage, *compiled, "--resume", str(tag)
        )
        print0(f"TOOK stage {stage}: " + ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))


if __name__ == "__main__":
    from anneal.dist import shutdown

    main()
    shutdown()
