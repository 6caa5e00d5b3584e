"""``python -m launcher {hostfile,run,submit,submit-prepare}``: runs on the launch host.

One command line for every subcommand::

    python -m launcher SUBCOMMAND [launcher options] RECIPE [launcher options] [-- recipe flags]

Launcher options may come before or after RECIPE; everything after ``--`` goes to the recipe
unchanged (and is checked here with the recipe's own parser). ``--dry-run`` anywhere before
``--`` prints what would run and starts nothing.

``run`` pre-flights the launch (``launcher.preflight``), writes ``.deepspeed_env`` and the
forecast into the run directory, and runs DeepSpeed's own ``deepspeed`` runner, exiting with
its exit code. ``submit`` renders ``launcher/templates/multinode.sbatch`` into the run directory
and calls ``sbatch``. ``submit-prepare`` submits ``anneal data prepare`` as Slurm jobs
(``launcher.submit_prepare``; its flags after ``--``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from anneal.cli.args import checked, path
from anneal.errors import UserError
from anneal.files import make_dir, write_atomic
from anneal.hardware import DEFAULT_GPU
from launcher import dsenv, hostfile, pdsh, preflight, slurm, submit_prepare, venv, watch_job

"""Checkpoint write rate assumed for the grace time (docs/cluster.md has the measured one)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        hint = ""
        if "unrecognized arguments" in message:
            hint = (
                " Recipe flags go after '--', e.g. `python -m launcher run --num-gpus 2 "
                "recipes/pretrain_tiny.py -- --max-steps 20`."
            )
        raise UserError(f"{self.prog}: {message}.{hint}")


def deepspeed_args(
    *,
    recipe: str,
    recipe_args: list[str],
    hostfile_path: str | None = None,
    num_gpus: int | None = None,
    num_nodes: int | None = None,
    no_ssh: bool = False,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> list[str]:
    """The argument list for ``deepspeed`` (without the program name)."""
    args: list[str] = []
    if hostfile_path:
        args += ["--hostfile", hostfile_path]
    if num_nodes is not None:
        args += ["--num_nodes", str(num_nodes)]
    if num_gpus is not None:
        args += ["--num_gpus", str(num_gpus)]
    if no_ssh:
        args += ["--no_ssh"]
    if node_rank is not None:
        args += ["--node_rank", str(node_rank)]
    if master_addr:
        args += ["--master_addr", master_addr]
    if master_port is not None:
        args += ["--master_port", str(master_port)]
    return [*args, recipe, *recipe_args]


def deepspeed_program() -> str:
    """The ``deepspeed`` runner next to this Python (the venv's), else the one on PATH."""
    here = Path(sys.executable).parent / "deepspeed"
    return str(here) if here.is_file() else "deepspeed"


def _common(p: argparse.ArgumentParser, *, this_host: bool) -> None:
    """The options of ``run`` and ``submit``. ``this_host``: the ranks start from this host
    (``run``), so its GPU is the default; a batch job's (``submit``) are the ones it asks for."""
    p.add_argument("recipe", type=path, help="recipes/pretrain_*.py")
    p.add_argument("--dry-run", action="store_true", help="print what would run; start nothing")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="device of the ranks (default: "
        + ("cuda if this host has a GPU)" if this_host else "cuda, the job's --gpus-per-node)"),
    )
    p.add_argument("--mfu", type=float, help="assumed MFU for the forecast (default: 0.40 GPU)")
    p.add_argument(
        "--gpu",
        help="GPU for the forecast: h100, h200, a100 (default: "
        + (f"this one, else {DEFAULT_GPU})" if this_host else f"{DEFAULT_GPU})"),
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME",
        help="also pass this variable through .deepspeed_env",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m launcher",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    hf = sub.add_parser("hostfile", help="write a hostfile", allow_abbrev=False)
    src = hf.add_mutually_exclusive_group(required=True)
    src.add_argument("--hosts", help="comma-separated host names")
    src.add_argument(
        "--from-slurm",
        action="store_true",
        help="the hosts of this Slurm allocation (SLURM_JOB_NODELIST)",
    )
    hf.add_argument("--slots", type=int, help="GPUs per host (default: SLURM_GPUS_ON_NODE, or 8)")
    hf.add_argument("--nodes", type=int, help="only the first N hosts")
    hf.add_argument("--out", type=path, required=True)
    hf.add_argument(
        "--force",
        action="store_true",
        help="replace an existing hostfile at --out (only a hostfile)",
    )
    hf.add_argument("--dry-run", action="store_true", help="print the hostfile; write nothing")

    run = sub.add_parser(
        "run", help="pre-flight, then start the recipe with deepspeed", allow_abbrev=False
    )
    _common(run, this_host=True)
    run.add_argument("--hostfile", type=path)
    run.add_argument("--num-gpus", type=int)
    run.add_argument("--num-nodes", type=int)
    run.add_argument("--no-ssh", action="store_true", help="start this node only (see docs)")
    run.add_argument("--node-rank", type=int)
    run.add_argument("--master-addr")
    run.add_argument("--master-port", type=int)
    run.add_argument("--no-ssh-check", action="store_true", help="skip the ssh reachability check")

    sb = sub.add_parser("submit", help="render the sbatch script and submit it", allow_abbrev=False)
    _common(sb, this_host=False)
    sb.add_argument("--nodes", type=int, required=True)
    sb.add_argument("--gpus-per-node", type=int, required=True)
    sb.add_argument("--partition", required=True)
    sb.add_argument("--time", required=True, help="HH:MM:SS")
    sb.add_argument("--account")
    sb.add_argument(
        "--grace-s",
        type=int,
        help="seconds between the preemption signal and the end (default: from the "
        "forecast step time and checkpoint size, at least 120, at most half of --time)",
    )
    sb.add_argument("--master-port", type=int, default=29500)
    watch_job.add_options(sb)
    submit_prepare.add_parser(sub)
    return checked(parser)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher part, recipe flags): the recipe flags are everything after the first ``--``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _device(ns) -> str:
    if ns.device:
        return ns.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_hostfile(ns) -> int:
    """Everything is checked before anything is written; hostfile.write checks --out."""
    if ns.from_slurm:
        hosts = hostfile.from_slurm(slots=ns.slots)
    else:
        slots = hostfile.check_slots(8 if ns.slots is None else ns.slots, where="--slots")
        hosts = {}
        for name in (h.strip() for h in ns.hosts.split(",")):
            if name in hosts:
                raise UserError(f"--hosts: {name!r} is given twice. Name each host once.")
            if name:
                hosts[hostfile.check_host(name, where="--hosts")] = slots
        if not hosts:
            raise UserError("--hosts: no host names given (e.g. --hosts gpu001,gpu002).")
    if ns.nodes is not None:
        if not 1 <= ns.nodes <= len(hosts):
            raise UserError(
                f"--nodes {ns.nodes}: the allocation has {len(hosts)} hosts, so it must be "
                f"1..{len(hosts)}."
            )
        hosts = dict(list(hosts.items())[: ns.nodes])
    if ns.dry_run:
        print(hostfile.render(hosts), end="")
        return 0
    hostfile.write(ns.out, hosts, force=ns.force)
    slots = sorted(set(hosts.values()))
    print(f"wrote {ns.out}: {len(hosts)} hosts x {'/'.join(map(str, slots))} slots")
    return 0


def cmd_run(ns, recipe_args: list[str]) -> int:
    hosts = hostfile.parse(ns.hostfile) if ns.hostfile else None
    env_values = dsenv.select(dict(os.environ), ns.env)
    if ns.master_addr is not None:
        pdsh.check_master_addr(ns.master_addr)
    if ns.master_port is not None and not 1 <= ns.master_port <= 65535:
        raise UserError(f"--master-port {ns.master_port}: a TCP port is 1..65535, e.g. 29500.")
    if ns.no_ssh and (ns.node_rank is None or not ns.master_addr or not hosts):
        raise UserError(
            "--no-ssh starts this node only: give --hostfile, --node-rank and --master-addr "
            "too, and start the same command once on every node."
        )
    if ns.node_rank is not None and hosts and not 0 <= ns.node_rank < len(hosts):
        raise UserError(
            f"--node-rank {ns.node_rank}: {ns.hostfile} has {len(hosts)} hosts, so it must be "
            f"0..{len(hosts) - 1}."
        )
    world = preflight.world_size(
        hosts, num_gpus=ns.num_gpus, num_nodes=ns.num_nodes, source=ns.hostfile or ""
    )
    remote = pdsh.is_remote(hosts, num_nodes=ns.num_nodes, no_ssh=ns.no_ssh)
    if remote:
        pdsh.check_remote_command(
            recipe=ns.recipe, recipe_args=recipe_args, cwd=os.getcwd(), python=sys.executable
        )
    local = max(hosts.values()) if hosts else world
    launch = preflight.preflight(
        recipe=ns.recipe,
        recipe_args=recipe_args,
        world_size=world,
        device_type=_device(ns),
        mfu=ns.mfu,
        gpu=ns.gpu,
        ranks_per_host=min(local, ns.num_gpus or local),
    )
    active = list(hosts)[: ns.num_nodes or len(hosts)] if hosts else []
    if len(active) > 1 and not ns.no_ssh and not ns.no_ssh_check:
        preflight.check_ssh(active)
    args = deepspeed_args(
        recipe=ns.recipe,
        recipe_args=recipe_args,
        hostfile_path=ns.hostfile,
        num_gpus=ns.num_gpus,
        num_nodes=ns.num_nodes,
        no_ssh=ns.no_ssh,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
    )
    out = Path(launch.launch.out)
    left_out = dsenv.left_out(dict(os.environ), ns.env, hand_written=dsenv.hand_written(out))
    env = {**os.environ}
    if remote:  # DeepSpeed's runner exports some of its own environment through pdsh too
        env, runner_left_out = dsenv.runner_environ(env)
        left_out = {**left_out, **runner_left_out}
    else:
        from anneal.dist import accelerator_env  # imports torch: not at the top (venv.NEEDS)

        env.update(accelerator_env(env))
    print(preflight.forecast.describe(launch.forecast))
    for note in preflight.resume_notes(launch):
        print(note)
    if note := dsenv.describe_left_out(left_out):
        print(note)
    command = [deepspeed_program(), *args]
    ds_env_file = (out / dsenv.RUNNER_FILE).resolve()
    print(f"DS_ENV_FILE={shlex.quote(str(ds_env_file))} {shlex.join(command)}", flush=True)
    if ns.dry_run:
        print(f"# {out / dsenv.FILE} would hold (mode 0600):")
        print(dsenv.contents(out, env_values), end="", flush=True)
        return 0
    dsenv.write(out, env_values)
    write_atomic(out / preflight.forecast.FILE, json.dumps(launch.forecast.to_dict(), indent=2))
    done = subprocess.run(command, env={**env, "DS_ENV_FILE": str(ds_env_file)})
    return done.returncode if done.returncode >= 0 else 128 - done.returncode


def cmd_submit(ns, recipe_args: list[str]) -> int:
    env_values = dsenv.select(dict(os.environ), ns.env)
    device = ns.device or "cuda"  # the job's GPUs, not this host's
    world = ns.nodes * ns.gpus_per_node
    if ns.nodes < 1 or ns.gpus_per_node < 1:
        raise UserError("--nodes and --gpus-per-node must be at least 1.")
    launch = preflight.preflight(
        recipe=ns.recipe,
        recipe_args=recipe_args,
        world_size=world,
        device_type=device,
        mfu=ns.mfu,
        gpu=ns.gpu or DEFAULT_GPU,
        ranks_per_host=ns.gpus_per_node,
    )
    out = Path(launch.launch.out).resolve()
    grace, grace_note = ns.grace_s, ""
    if grace is None:  # --grace-s 0 is refused by render_sbatch, not taken for the default
        grace, grace_note = slurm.default_grace_s(
            step_s=launch.forecast.step_s,
            checkpoint_bytes=launch.checkpoint_bytes,
            time=ns.time,
        )
    watch_job.check(ns)
    text = slurm.render_sbatch(
        job_name=f"anneal-{out.name}",
        nodes=ns.nodes,
        gpus_per_node=ns.gpus_per_node,
        gpus=device == "cuda",
        partition=ns.partition,
        time=ns.time,
        account=ns.account,
        grace_s=grace,
        run_dir=out,
        workdir=Path.cwd().resolve(),
        python=sys.executable,
        recipe=ns.recipe,
        recipe_args=recipe_args,
        master_port=ns.master_port,
    )
    scripts = {out / "submit.sbatch": text}
    if ns.watch_tasks is not None:
        scripts[out / watch_job.WATCH_SCRIPT] = watch_job.script(
            ns, out=out, device=device, grace=grace
        )
    print(preflight.forecast.describe(launch.forecast))
    for note in preflight.resume_notes(launch):
        print(note)
    if grace_note:
        print(grace_note)
    if note := dsenv.describe_left_out(
        dsenv.left_out(dict(os.environ), ns.env, hand_written=dsenv.hand_written(out))
    ):
        print(note)
    if ns.dry_run:
        for script, text in scripts.items():
            print(f"# {script} would hold:")
            print(text, end="", flush=True)
        return 0
    (make_dir(out) / "logs").mkdir(exist_ok=True)  # slurmd opens --output before the script
    dsenv.write(out, env_values)
    write_atomic(out / preflight.forecast.FILE, json.dumps(launch.forecast.to_dict(), indent=2))
    for script, text in scripts.items():
        write_atomic(script, text)
        print(f"wrote {script}")
    for script in scripts:  # training first: the watcher waits for its checkpoints
        print(slurm.sbatch(script), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    launcher_argv, recipe_args = split_argv(argv)
    try:
        ns = build_parser().parse_args(launcher_argv)
        if ns.command == "hostfile":
            if recipe_args:
                raise UserError("hostfile takes no recipe flags ('--' and what follows it).")
            return cmd_hostfile(ns)
        if ns.command == "run":
            return cmd_run(ns, recipe_args)
        if ns.command == "submit-prepare":
            return submit_prepare.cmd_submit_prepare(ns, recipe_args)
        return cmd_submit(ns, recipe_args)
    except UserError as e:
        print(f"launcher: error: {e}", file=sys.stderr, flush=True)
        return 2
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in venv.NEEDS:
            raise
        print(f"launcher: error: {venv.missing_package(e.name)}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
