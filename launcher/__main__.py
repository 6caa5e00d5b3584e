"""``python -m launcher {hostfile,run}``: runs on the launch host.

``run`` pre-flights what can be checked here (the hostfile, the recipe, the ds_config) and then
hands the exact argument list to DeepSpeed's own runner (``deepspeed.launcher.runner.main``), so
multi-node behaviour is DeepSpeed's, not a re-implementation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launcher import hostfile


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


def preflight(ns: argparse.Namespace) -> None:
    if not Path(ns.recipe).is_file():
        raise ValueError(f"recipe {ns.recipe}: no such file (see recipes/).")
    if ns.hostfile:
        hosts = hostfile.parse(ns.hostfile)
        if ns.node_rank is not None and not 0 <= ns.node_rank < len(hosts):
            raise ValueError(
                f"--node-rank {ns.node_rank}: {ns.hostfile} has {len(hosts)} "
                f"hosts, so it must be 0..{len(hosts) - 1}."
            )
    if ns.no_ssh and (ns.node_rank is None or not ns.master_addr):
        raise ValueError(
            "--no-ssh starts this node only: give --node-rank and --master-addr "
            "too, and start the same command once on every node."
        )
    if "--ds-config" in ns.recipe_args:
        from anneal.ds_config import find_ds_config, load_ds_config

        load_ds_config(find_ds_config(ns.recipe_args[ns.recipe_args.index("--ds-config") + 1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    hf = sub.add_parser("hostfile", help="write a hostfile")
    hf.add_argument("--hosts", required=True, help="comma-separated host names")
    hf.add_argument("--slots", type=int, default=8, help="GPUs per host")
    hf.add_argument("--out", required=True)
    run = sub.add_parser("run", help="pre-flight, then start the recipe with deepspeed")
    run.add_argument("--hostfile")
    run.add_argument("--num-gpus", type=int)
    run.add_argument("--num-nodes", type=int)
    run.add_argument("--no-ssh", action="store_true")
    run.add_argument("--node-rank", type=int)
    run.add_argument("--master-addr")
    run.add_argument("--master-port", type=int)
    run.add_argument("--dry-run", action="store_true", help="print the deepspeed command only")
    run.add_argument("recipe")
    run.add_argument("recipe_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    try:
        if ns.command == "hostfile":
            hosts = {h: ns.slots for h in ns.hosts.split(",") if h}
            hostfile.write(ns.out, hosts)
            hostfile.parse(ns.out)
            print(f"wrote {ns.out}: {len(hosts)} hosts x {ns.slots} slots")
            return 0
        preflight(ns)
    except ValueError as e:
        print(f"launcher: error: {e}", file=sys.stderr)
        return 2
    args = deepspeed_args(
        recipe=ns.recipe,
        recipe_args=ns.recipe_args,
        hostfile_path=ns.hostfile,
        num_gpus=ns.num_gpus,
        num_nodes=ns.num_nodes,
        no_ssh=ns.no_ssh,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
    )
    print("deepspeed " + " ".join(args), flush=True)
    if ns.dry_run:
        return 0
    from deepspeed.launcher.runner import main as deepspeed_main

    deepspeed_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
