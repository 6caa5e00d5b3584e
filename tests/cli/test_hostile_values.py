"""Every value a command line takes is checked where argparse reads it (issue 27), by one pass
over each finished parser (``anneal.cli.args.checked``): the recipe's flags, every ``anneal``
subcommand and every ``python -m launcher`` subcommand.

Proves, argument by argument (walked from the parsers, so a new flag is covered as it is
added): an empty value is a UserError naming the argument ("an unset shell variable?"), never
taken for the default; a value that is not UTF-8 is one too; and every argument declared as a
path refuses one longer than the file system takes (10,000 characters was an ENAMETOOLONG
traceback). Parsing only: well under a second.
"""

from __future__ import annotations

import argparse

import pytest

from anneal.cli import build_parser as anneal_parser
from anneal.cli.args import path
from anneal.cli.recipe import build_parser as recipe_parser
from anneal.errors import UserError
from launcher.__main__ import build_parser as launcher_parser


def arguments(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(argv before the argument, the argument's action) for every argument of ``parser`` and
    its subcommands that takes a value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from arguments(sub, (*prefix, name))
        elif action.nargs != 0:
            yield prefix, action


PARSERS = {
    "recipe": recipe_parser("recipes/pretrain_tiny.py", preset="tiny"),
    "anneal": anneal_parser(),
    "launcher": launcher_parser(),
}


def cases():
    """(id, parser, argv before the argument, action) for every argument of every parser."""
    for command, parser in PARSERS.items():
        for prefix, action in arguments(parser):
            flag = "/".join(action.option_strings) or action.dest
            yield " ".join([command, *prefix, flag]), parser, prefix, action


CASES = list(cases())


def parse(parser, prefix, action, value: str) -> str:
    """Parse ``value`` for ``action`` alone; the message of the UserError it must raise."""
    argv = [*prefix, *action.option_strings[:1], value]
    with pytest.raises(UserError) as info:
        parser.parse_args(argv)
    assert info.value.every_rank and "\n" not in str(info.value)
    return str(info.value)


def name_of(action) -> str:
    long = [s for s in action.option_strings if s.startswith("--")]
    return long[0] if long else (action.metavar or action.dest.upper())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_an_empty_or_non_utf8_value_is_refused_by_name(case):
    _, parser, prefix, action = case
    msg = parse(parser, prefix, action, "")
    assert msg.startswith(f"{name_of(action)} is empty (an unset shell variable?)"), msg
    msg = parse(parser, prefix, action, "caf\udce9")
    assert msg.startswith(f"{name_of(action)} caf\\udce9: not UTF-8"), msg


def test_every_path_argument_refuses_a_path_too_long():
    paths = [(n, p, pre, a) for n, p, pre, a in CASES if a.type.is_path]
    for _, parser, prefix, action in paths:
        for value in ("a" * 10_000, "/tmp/" + "b" * 256):
            assert "Give a shorter path" in parse(parser, prefix, action, value)
        argv = [*prefix, *action.option_strings[:1], "/tmp/" + "b" * 255]
        try:  # a name of 255 bytes is allowed: whatever the parser says next, not this
            parser.parse_args(argv)
        except (UserError, SystemExit) as e:
            assert "shorter path" not in str(e)
    names = {c[0] for c in paths}
    for expect in (
        "recipe --out",
        "recipe --data",
        "recipe --ds-config",
        "recipe --init-from",
        "anneal export --out",
        "anneal data prepare --out",
        "launcher run --hostfile",
        "launcher hostfile --out",
    ):
        assert expect in names, (expect, sorted(names))
    assert path("x") == "x"
