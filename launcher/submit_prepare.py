"""``python -m launcher submit-prepare``: ``anneal data prepare`` as three Slurm jobs chained by
Slurm's own dependencies (docs/data.md, "Preparing tens of terabytes").

::

    python -m launcher submit-prepare --tasks N --partition P --time T [--nodes K] [--account A]
        [--dry-run] -- --input ... --out OUT [every other flag of anneal data prepare]

Everything after ``--`` is ``anneal data prepare``'s, checked here with its own parser and its
own checks (the inputs exist, ``--out`` may be written) before anything is submitted. The three
scripts (``launcher/templates/prepare.sbatch``) go to ``OUT.parts/slurm/`` and their logs to
``OUT.parts/slurm/logs/``: the plan and the tokenizer (one node), an array of N tasks, one node
each with all its cores (at most K at once with ``--nodes K``), ``afterok`` on the plan, and the
merge, ``afterok`` on the array.

Submitted again with the same flags, it submits only what is left: no plan job when
``plan.json`` is there with these flags, an array of only the tasks without a completion
marker, and the merge. With other flags it refuses as the steps themselves would (or, with
``--force``, starts over: the plan job replaces the parts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from anneal.errors import UserError
from launcher import slurm

TASK_FLAGS = ("--tasks", "--task", "--merge")


def add_parser(sub) -> None:
    sp = sub.add_parser(
        "submit-prepare",
        help="submit `anneal data prepare` as Slurm jobs: plan, array of tasks, merge",
        allow_abbrev=False,
    )
    sp.add_argument("--tasks", type=int, required=True, help="tasks of the array (N)")
    sp.add_argument("--nodes", type=int, help="at most this many tasks at once (default: all)")
    sp.add_argument("--partition", required=True)
    sp.add_argument("--time", required=True, help="each job's limit, HH:MM:SS")
    sp.add_argument("--account")
    sp.add_argument("--dry-run", action="store_true", help="print the scripts; submit nothing")


class _PrepareParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(f"the `anneal data prepare` flags after '--': {message}.")


def prepare_namespace(prepare_args: list[str]) -> argparse.Namespace:
    """The flags after ``--`` parsed by ``anneal data prepare``'s own parser."""
    from anneal.cli import data
    from anneal.cli.args import checked

    given = [a for a in prepare_args if a.split("=")[0] in TASK_FLAGS]
    if given:
        raise UserError(
            f"{given[0]} after '--': submit-prepare adds --tasks, --task and --merge to each "
            f"step itself. Give the task count as `submit-prepare --tasks N`."
        )
    if not prepare_args:
        raise UserError(
            "give `anneal data prepare`'s flags after '--', e.g. `python -m launcher "
            "submit-prepare --tasks 8 --partition cpu --time 04:00:00 -- --input corpus/ "
            "--out data/corpus`."
        )
    parser = _PrepareParser(prog="anneal", add_help=False)
    data.add_commands(parser.add_subparsers(dest="command", required=True))
    return checked(parser).parse_args(["data", "prepare", *prepare_args])


def plan_left(cfg, tasks: int) -> tuple[bool, list[int]]:
    """(whether the plan job is needed, the tasks without a completion marker under the plan
    that is there): all of them when there is no plan yet."""
    from anneal.data import task_split
    from anneal.data.part import read_done

    parts = task_split.parts_dir(cfg.out)
    if not (parts / task_split.SPLIT_FILE).is_file():
        return True, list(range(tasks))
    recorded, sha = task_split.read_split(parts)
    try:
        task_split.check_same(recorded, cfg, tasks, parts=parts)
    except UserError:
        if not cfg.force:
            raise
        return True, list(range(tasks))  # the plan job replaces the parts (--force)
    left = [t for t in range(tasks) if (read_done(parts, t) or {}).get("plan_sha256") != sha]
    return False, left


def cmd_submit_prepare(ns, prepare_args: list[str]) -> int:
    from anneal.cli.data import prepare_options
    from anneal.data import task_split, units
    from anneal.data.prepare import check_config, claim_out, config
    from anneal.data.sources import parse_inputs

    task_split.check_tasks(ns.tasks)
    if ns.nodes is not None and ns.nodes < 1:
        raise UserError(f"--nodes {ns.nodes}: must be at least 1.")
    cfg = config(**prepare_options(prepare_namespace(prepare_args)))
    check_config(cfg)
    sources = parse_inputs(list(cfg.inputs))
    for s in sources:
        units.input_files(s, cfg.read)  # refuses what cannot be split (a hub dataset)
    claim_out(cfg, sources)
    need_plan, left = plan_left(cfg, ns.tasks)
    parts = task_split.parts_dir(cfg.out).resolve()
    logs = parts / task_split.SLURM / "logs"
    scripts = {
        step: slurm.render_prepare(
            step=step,
            job_name=f"prep-{cfg.out.name}-{step}",
            tasks=ns.tasks,
            partition=ns.partition,
            time=ns.time,
            account=ns.account,
            logs=logs,
            workdir=Path.cwd().resolve(),
            python=sys.executable,
            prepare_args=prepare_args,
        )
        for step in slurm.PREPARE_STEPS
    }
    array = slurm.array_spec(left) + (f"%{ns.nodes}" if ns.nodes else "")
    steps = (["plan"] if need_plan else []) + (["tasks"] if left else []) + ["merge"]
    print(
        f"{len(left)} of {ns.tasks} tasks to run"
        + ("" if need_plan else f" (the plan in {parts} is kept)")
        + f": {', '.join(steps)}"
    )
    if ns.dry_run:
        for step in steps:
            print(f"# {parts / 'slurm' / f'{step}.sbatch'} would hold:")
            print(scripts[step], end="")
        print(f"# the array: --array={array}", flush=True)
        return 0
    _make_parts(parts, logs)
    job = None
    for step in steps:
        script = parts / "slurm" / f"{step}.sbatch"
        script.write_text(scripts[step])
        options = [f"--dependency=afterok:{job}"] if job else []
        if step == "tasks":
            options.append(f"--array={array}")
        job = slurm.sbatch_parsable(script, *options)
        print(f"submitted {step}: job {job}" + (f" (--array={array})" if step == "tasks" else ""))
    return 0


def _make_parts(parts: Path, logs: Path) -> None:
    """``OUT.parts`` with its marker (made by this command), and the logs' directory, which
    Slurm opens before a script runs."""
    from anneal.data import task_split
    from anneal.files import make_dir

    task_split.claim_parts(parts, out=parts.with_name(parts.name.removesuffix(".parts")))
    make_dir(parts, flag="--out")
    (parts / task_split.PARTS_MARKER).write_text("made by anneal data prepare --tasks\n")
    make_dir(logs, flag="--out")
