"""``python -m launcher submit --watch-tasks``: the downstream-evaluation watcher of the run as
a Slurm job of its own beside the training job (``anneal eval RUN --watch``, nanotron's
pattern: the training job never waits for evaluation). Its options, their checks, and its batch
script (``launcher/templates/eval_watch.sbatch``, rendered by ``render_watch``
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
    partition, account, time limit and grace time, with a rendezvous port of its own; its
    tasks checked (``check_tasks``)."""
    nodes = 1 if ns.watch_nodes is None else ns.watch_nodes
    gpus = 1 if ns.watch_gpus_per_node is None else ns.watch_gpus_per_node
    for flag, value in (("--watch-nodes", nodes), ("--watch-gpus-per-node", gpus)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be at least 1.")
    text = render_watch(
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
    check_tasks(ns.watch_tasks)
    return text


def check_tasks(tasks: str) -> None:
    """The watch job's tasks checked as ``anneal eval`` checks them when the job starts
    (``anneal.eval.tasks.check_specs``: a generation task, a missing YAML, a template that
    reaches into Python are refused here, before anything is written); each task YAML that
    runs Python is said. Relative paths are from this directory, the job's working directory."""
    from anneal.eval.tasks import check_specs

    specs = [s.strip() for s in tasks.split(",") if s.strip()]
    try:
        notes = check_specs(specs)
    except UserError as e:
        raise UserError(f"--watch-tasks: {e}") from None
    for note in notes:
        print(f"--watch-tasks: {note}")


WATCH_SCRIPT = "eval-watch.sbatch"
"""The watch job's batch script in the run directory, beside the training job's submit.sbatch."""


def watch_command(
    *, run_dir: Path, tasks: str, limit: int | None, poll_s: float | None = None
) -> list[str]:
    """The arguments of ``python -m anneal.cli`` in the watch job: ``eval RUN --watch`` on
    ``tasks`` (each value joined to its flag, so that none is read as a flag of its own)."""
    slurm.check_plain(
        tasks,
        what=f"--watch-tasks {tasks!r}",
        why="the script carries the eval command on one line. Give task names or YAML paths "
        "separated by commas",
    )
    if not tasks.strip():
        raise UserError("--watch-tasks: no task given. Name lm-eval tasks or task YAML files.")
    if limit is not None and limit < 1:
        raise UserError(
            f"--watch-limit {limit}: give at least 1 example per task, or leave it out."
        )
    if poll_s is not None and not 0 < poll_s <= 86400:
        raise UserError(f"--watch-poll-s {poll_s}: give seconds between 0 and 86400, e.g. 60.")
    command = ["eval", str(run_dir), "--watch", f"--tasks={tasks}"]
    command += [f"--limit={limit}"] if limit is not None else []
    return command + ([f"--poll-s={poll_s:g}"] if poll_s is not None else [])


def render_watch(
    *, tasks: str, limit: int | None, run_dir: Path, poll_s: float | None = None, **job
) -> str:
    """The watch job's batch script (``templates/eval_watch.sbatch``): ``anneal eval RUN
    --watch`` on ``job``'s allocation, every value checked and quoted as ``render_sbatch``
    does for training."""
    command = watch_command(run_dir=run_dir, tasks=tasks, limit=limit, poll_s=poll_s)
    return slurm.render_sbatch(
        template="eval_watch.sbatch",
        run_dir=run_dir,
        recipe="anneal.cli",
        recipe_args=command,
        log_name="eval-watch",
        **job,
    )
