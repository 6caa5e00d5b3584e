"""The ``anneal`` command: ``build_parser()`` and the dispatcher ``main()``.

Each command group lives in its own module, which adds its subcommands and their handlers:
``data`` (``anneal data prepare | synth | verify``), ``planning`` (``plan``, ``fit``,
``estimate``), ``runs`` (``export``, ``plot``, ``report``, ``compare``, ``generate``) and
``evaluate`` (``eval``). The recipes' own command line is ``recipe``. ``main()`` is the one
place where a ``UserError`` becomes a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from anneal.cli import data, evaluate, planning, runs
from anneal.cli.args import checked
from anneal.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anneal",
        description="Anneal: LLM pretraining on "
        "DeepSpeed. Training runs through recipes/pretrain_*.py.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    data.add_commands(sub)
    planning.add_commands(sub)
    runs.add_commands(sub)
    evaluate.add_commands(sub)
    return checked(parser)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = None
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UserError as e:  # anything else is a bug or the environment: keep its traceback
        command = f"anneal {args.command}" if args else "anneal"
        if not (e.every_rank and os.environ.get("RANK", "0") != "0"):  # once, not per rank
            print(f"{command}: error: {e}", file=sys.stderr)
        return 2
