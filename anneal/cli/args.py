"""The values every command line takes, checked where argparse reads them.

One pass over a finished parser (``checked``), shared by the recipe's command line
(``anneal.cli.recipe``), the ``anneal`` command (``anneal.cli``) and ``python -m launcher``:

- an empty value is refused for every flag and positional that takes one (``--out ''`` trained
  into the default directory, ``--hostfile ''`` ran on one node: an unset shell variable in a
  launch script must not continue another run);
- a value that is not UTF-8 (argv bytes that Python keeps as surrogates) is refused: Anneal
  writes its paths and values into JSON and its messages;
- a path (an argument declared ``type=path``) longer than the file system takes
  (``ENAMETOOLONG``) is refused (``anneal.files.check_path_length``, which ``--set data.path``
  and the other path keys go through as well).

Each refusal is a ``UserError`` naming the flag and the fix, raised on every rank alike, so the
entry points print it as one paragraph with exit status 2.
"""

from __future__ import annotations

import argparse

from anneal.errors import UserError
from anneal.files import check_path_length


def path(value: str) -> str:
    """``type=path``: the argument is a file or directory path (checked for length as well)."""
    return value


def _printable(value: str, limit: int = 60) -> str:
    """``value`` for a message: printable ASCII (escapes for the rest), cut to ``limit``."""
    text = ascii(value)[1:-1]
    return text if len(text) <= limit else text[:limit] + "..."


def check_value(value: str, *, flag: str, is_path: bool = False, optional: bool = True) -> str:
    """``value`` unchanged, or a UserError naming ``flag``: empty, not UTF-8, or (``is_path``)
    longer than a path or a name in it may be. ``optional``: the flag may be left out."""
    if value == "":
        fix = (
            f"an empty value is never taken for the default. Give a value, or drop {flag} to "
            f"use its default."
            if optional
            else "give a value."
        )
        raise UserError(f"{flag} is empty (an unset shell variable?): {fix}", every_rank=True)
    try:
        value.encode()
    except UnicodeEncodeError:
        raise UserError(
            f"{flag} {_printable(value)}: not UTF-8 (bytes that do not decode), and Anneal writes "
            f"its paths and values into JSON and messages as UTF-8. Rename it with UTF-8 "
            f"characters, or give another {flag}.",
            every_rank=True,
        ) from None
    if is_path:
        check_path_length(value, flag=flag)
    return value


class _Checked:
    """The ``type`` of one argument: ``check_value``, then the argument's own type."""

    def __init__(self, action: argparse.Action):
        self.inner = action.type
        self.flag = next(
            (s for s in action.option_strings if s.startswith("--")),
            action.metavar if isinstance(action.metavar, str) else action.dest.upper(),
        )
        self.is_path = action.type is path
        self.optional = bool(action.option_strings) and not action.required
        self.__name__ = getattr(self.inner, "__name__", "str")  # argparse's "invalid X value"

    def __call__(self, value: str):
        check_value(value, flag=self.flag, is_path=self.is_path, optional=self.optional)
        return value if self.inner in (None, path) else self.inner(value)


def checked(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` (and its subcommands' parsers) with every argument that takes a value checked
    by ``check_value`` before its own type sees it; returns ``parser``. Call it once the parser
    is complete."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                checked(sub)
        elif action.nargs != 0 and not isinstance(action.type, _Checked):
            action.type = _Checked(action)
    return parser
