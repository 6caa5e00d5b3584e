"""``python -m launcher submit --watch-tasks``: the downstream-evaluation watcher of the run as
a Slurm job of its own beside the training job (``anneal eval RUN --watch``, nanotron's
pattern: the training job never waits for evaluation). Its options, their checks, and its batch
script (``launcher/templates/eval_watch.sbatch``, rendered by ``launcher.slurm.render_watch``
with the training script's checks and quoting). docs/evaluation.md, "Beside the run on Slurm".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from anneal.errors import UserError
from launcher import slurm


def add_options(sb: argparse.ArgumentParser) -> None:
    """The ``--watch-*`` options of ``submit``."""
    sb.add_argument(
        "--watch-tasks",
        metavar="TASKS",
        help="also submit a job beside the training job that scores each checkpoint on these "
        "tasks as it appears (anneal eval RUN --watch --tasks TASKS; docs/evaluation.md)",
    )
    sb.add_argument("--watch-limit", type=int, help="the watcher's --limit (examples per task)")
    sb.add_argument("--watch-poll-s", type=float, help="the watcher's --poll-s (default 60)")
    sb.add_argument("--watch-nodes", type=int, help="the watch job's nodes (default 1)")
    sb.add_argument("--watch-gpus-per-node", type=int, help="its GPUs per node (default 1)")


def check(ns: argparse.Namespace) -> None:
    """A watch setting without ``--watch-tasks`` is refused (it would do nothing)."""
    for flag in ("--watch-limit", "--watch-poll-s", "--watch-nodes", "--watch-gpus-per-node"):
        if getattr(ns, flag[2:].replace("-", "_")) is not None and ns.watch_tasks is None:
            raise UserError(f"{flag}: a setting of the watch job; give --watch-tasks too.")


def script(ns, *, out: Path, device: str, grace: int) -> str:
    """The batch script of the watch job (``slurm.render_watch``), on the training job's
    partition, account, time limit and grace time, with a rendezvous port of its own."""
    nodes = 1 if ns.watch_nodes is None else ns.watch_nodes
    gpus = 1 if ns.watch_gpus_per_node is None else ns.watch_gpus_per_node
    for flag, value in (("--watch-nodes", nodes), ("--watch-gpus-per-node", gpus)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be at least 1.")
    return slurm.render_watch(
        job_name=f"anneal-eval-{out.name}",
        nodes=nodes,
        gpus_per_node=gpus,
        gpus=device == "cuda",
        partition=ns.partition,
        time=ns.time,
        account=ns.account,
        grace_s=grace,
        run_dir=out,
        workdir=Path.cwd().resolve(),
        python=sys.executable,
        tasks=ns.watch_tasks,
        limit=ns.watch_limit,
        poll_s=ns.watch_poll_s,
        master_port=ns.master_port + 1 if ns.master_port < 65535 else ns.master_port - 1,
    )
