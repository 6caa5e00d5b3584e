"""``anneal eval RUN --watch``: score each checkpoint of a run once, as it appears, beside the
training job (``anneal.eval.watch`` decides which and when; ``anneal.cli.evaluate`` scores one).

Started as ``anneal eval`` is (one process, or ``deepspeed --module anneal.cli eval ...`` on
several ranks; ``python -m launcher submit --watch-tasks`` renders such a Slurm job). It exits 0
once the run's last checkpoint (or ``--until-step``'s) is scored, and 75 after a SIGUSR1 or
SIGTERM, once the scoring in progress is written, so that its batch script requeues it.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

from anneal.errors import UserError


def add_options(p: argparse.ArgumentParser) -> None:
    """``--watch`` and its settings, on ``anneal eval``'s parser (torch is not imported to
    build it: the default poll is ``anneal.eval.watch.DEFAULT_POLL_S``, said here as written
    there; tests/eval/test_eval_watch.py holds them equal)."""
    p.add_argument(
        "--watch",
        action="store_true",
        help="score each new checkpoint of RUN that verifies, as it appears, until the run's "
        "last step (docs/evaluation.md, 'Beside the run on Slurm')",
    )
    p.add_argument(
        "--poll-s",
        type=float,
        help="with --watch: seconds between looks for new checkpoints (default 60)",
    )
    p.add_argument(
        "--until-step",
        type=int,
        help="with --watch: end once the checkpoint at this step or later is scored (default: "
        "the run's max_steps)",
    )


def check(args: argparse.Namespace) -> None:
    """The watch options, before any process group or engine: one paragraph each."""
    if not args.watch:
        for flag, value in (("--poll-s", args.poll_s), ("--until-step", args.until_step)):
            if value is not None:
                raise UserError(f"{flag}: a setting of --watch; give --watch too, or drop it.")
        return
    given = {"--step": args.step, "--out": args.out, "--force": args.force}
    given["--samples"] = getattr(args, "samples", None)
    for flag, value in given.items():
        if value:
            raise UserError(
                f"--watch with {flag}: the watcher scores every checkpoint of the run, each "
                f"once, into the run's own evals/; drop {flag} (or --watch, to score one step)."
            )
    if args.poll_s is not None and not 0 < args.poll_s <= 86400:
        raise UserError(f"--poll-s {args.poll_s}: give seconds between 0 and 86400, e.g. 60.")
    if args.until_step is not None and args.until_step < 0:
        raise UserError(f"--until-step {args.until_step}: give a step of at least 0.")
    target = Path(args.target)
    if target.exists() and not target.is_dir() or (target / "manifest.json").exists():
        raise UserError(
            f"anneal eval {target} --watch: give the run directory (the recipe's --out), not a "
            f"checkpoint or a file; the watcher scores each of its checkpoints as it appears."
        )


def watch(
    args: argparse.Namespace, specs: list[str], overrides: list[str], *, target_engine
) -> int:
    """Collective: the watcher over ``args.target`` until its end
    (``anneal.eval.watch.watch_run``); 0, or 75 after a preemption signal. ``target_engine``:
    ``anneal.cli.evaluate``'s, passed in (this module is imported by that one)."""
    from anneal.eval.watch import watch_run

    return watch_run(
        Path(args.target),
        _scorer(args, specs, overrides, target_engine),
        tasks=specs,
        until_step=args.until_step,
        poll_s=args.poll_s,
    )


def _scorer(args, specs, overrides, target_engine):
    """``score(tag_dir)`` for the watcher: one checkpoint (pinned, verified) scored as
    ``anneal eval RUN --step N`` scores it, its document naming the run's own tag directory."""
    from anneal import rundir
    from anneal.cli.eval_target import checkpoint_target
    from anneal.dist import is_main_process
    from anneal.eval.results import write_results
    from anneal.eval.score import score_target
    from anneal.train.engine import data_replica

    run_dir = Path(args.target)

    def score(tag_dir: Path) -> None:
        target = checkpoint_target(
            run_dir,
            tag_dir,
            out=None,
            ds_config=args.ds_config,
            tokenizer=Path(args.tokenizer) if args.tokenizer else None,
            data=Path(args.data) if args.data else None,
        )
        engine = target_engine(target, overrides)
        try:
            doc = score_target(
                engine,
                target,
                specs,
                replica=data_replica(engine),
                limit=args.limit,
                num_fewshot=args.num_fewshot,
                batch_size=args.batch_size,
            )
        finally:
            del engine
            gc.collect()
        doc["checkpoint"] = str(rundir.checkpoints_dir(run_dir) / tag_dir.name)
        if is_main_process():
            write_results(target, doc)

    return score
