"""A new command-line flag is a deliberate change: the recipe's flags (`anneal.cli.recipe.
build_parser`, shared by every recipes/pretrain_*.py) and the options of `python -m launcher`
(each subcommand's) are frozen here as literal lists, as torchtitan's test_no_new_cli_options.py
freezes its own. Adding, renaming or removing one fails this test until the list below is
edited in the same change, where review sees it (and the docs and golden command lines with it).
"""

import argparse

from anneal.cli.recipe import build_parser as recipe_parser
from launcher.__main__ import build_parser as launcher_parser

RECIPE_FLAGS = [
    "-h/--help",
    "--out",
    "--data",
    "--ds-config",
    "--max-steps",
    "--resume",
    "--restart",
    # Issue 27: an --out that holds files but no run is refused unless --force (never replacing
    # a file of those); the flag the other writing commands (data prepare, export, fit) use.
    "--force",
    "--init-from",
    "--cooldown-from/--branch-from",
    # Issue 40: validation is "val"; --eval-every, its old name, still taken with a warning.
    "--val-every",
    "--eval-every",
    "--save-every",
    "--seed",
    "--set",
    "--local_rank/--local-rank",
]

COMMON = ["recipe", "--dry-run", "--device", "--mfu", "--gpu", "--env"]
LAUNCHER_OPTIONS = {
    "": ["-h/--help"],
    "hostfile": [
        "-h/--help",
        "--hosts",
        "--from-slurm",
        "--slots",
        "--nodes",
        "--out",
        "--force",
        "--dry-run",
    ],
    "run": [
        "-h/--help",
        *COMMON,
        "--hostfile",
        "--num-gpus",
        "--num-nodes",
        "--no-ssh",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--no-ssh-check",
    ],
    "submit": [
        "-h/--help",
        *COMMON,
        "--nodes",
        "--gpus-per-node",
        "--partition",
        "--time",
        "--account",
        "--grace-s",
        "--master-port",
        # Issue 29: a job beside the training job that scores each checkpoint (the watcher).
        "--watch-tasks",
        "--watch-limit",
        "--watch-poll-s",
        "--watch-nodes",
        "--watch-gpus-per-node",
    ],
    # Issue 32: `anneal data prepare` as Slurm jobs (plan, array of tasks, merge); its own
    # flags go after '--'.
    "submit-prepare": [
        "-h/--help",
        "--tasks",
        "--nodes",
        "--partition",
        "--time",
        "--account",
        "--dry-run",
    ],
}


def options(parser: argparse.ArgumentParser, command: str = "") -> dict[str, list[str]]:
    """Each (sub)command's options in declaration order; a positional by its name."""
    found = {command: []}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(options(sub, name))
        else:
            found[command].append("/".join(action.option_strings) or action.dest)
    return found


def test_no_new_recipe_flags():
    assert options(recipe_parser("recipes/pretrain_tiny.py", preset="tiny")) == {"": RECIPE_FLAGS}


def test_no_new_launcher_options():
    assert options(launcher_parser()) == LAUNCHER_OPTIONS
