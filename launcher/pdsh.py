"""What DeepSpeed's pdsh launch hands to a remote shell, and the checks that keep it inert.

For a launch over more than one node without ``--no-ssh``, DeepSpeed 0.19's runner builds one
command line and pdsh runs it through ssh in a shell on every node: ``export NAME=value; ...
cd CWD; PYTHON -u -m deepspeed.launcher.launch ... --master_addr=ADDR ... RECIPE ARGS``. The
working directory, the Python and the recipe go in unquoted; a recipe argument is wrapped in
double quotes only when it holds a space, and inside double quotes ``$( )``, backquotes and
``\\`` still work. So on such a launch every one of them must consist of characters no shell
reads as syntax. A local launch (one node, or ``--no-ssh`` on each node, as the sbatch script
does) starts its ranks without a shell, and nothing here applies.
"""

from __future__ import annotations

import ipaddress
import re

from anneal.errors import UserError
from launcher import hostfile

WORD = re.compile(r"[\w@+=:,./-]+")
"""Characters a shell passes through as they are (``\\w`` is letters, digits and ``_``)."""
_ALLOWED = "letters, digits and . _ - / + = : , @"
_NO_SSH = "or start each node with --no-ssh (docs/cluster.md; the sbatch script does that)"


def check_master_addr(addr: str) -> str:
    """``addr`` if it is a host name ``hostfile.check_host`` accepts or an IP address."""
    try:
        if "%" not in addr:  # an IPv6 scope (fe80::1%eth0): pdsh reads '%' itself
            ipaddress.ip_address(addr)
            return addr
    except ValueError:
        pass
    return hostfile.check_host(addr, where="--master-addr")


def is_remote(hosts: dict[str, int] | None, *, num_nodes: int | None, no_ssh: bool) -> bool:
    """Will DeepSpeed's runner start the ranks through pdsh (a remote shell)?"""
    if hosts is None or no_ssh:
        return False
    return len(list(hosts)[: num_nodes or len(hosts)]) > 1


def _bad_char(value: str, *, space_ok: bool) -> str | None:
    for ch in value:
        if not (WORD.fullmatch(ch) or (space_ok and ch == " ")):
            return ch
    return None


def check_remote_command(*, recipe: str, recipe_args: list[str], cwd: str, python: str) -> None:
    """UserError unless every part of the pdsh command line that comes from the user is inert
    in a remote shell (module docstring)."""
    why = (
        "this launch starts the other nodes through pdsh, and DeepSpeed's runner hands the "
        "command line to a shell on every node unquoted (it adds double quotes only around a "
        "space, and $( ) still runs inside them)"
    )
    for arg in recipe_args:
        if arg == "":
            raise UserError(
                f"recipe argument '' (empty): {why}, where an empty argument vanishes and the "
                f"flags after it shift. Give a value, {_NO_SSH}."
            )
        if (ch := _bad_char(arg, space_ok=True)) is not None:
            raise UserError(
                f"recipe argument {arg!r} holds {ch!r}: {why}. Use a value with {_ALLOWED} and "
                f"spaces only (e.g. a --set or a path without such characters), {_NO_SSH}."
            )
    for what, value, fix in (
        ("recipe", recipe, "copy or rename the recipe"),
        ("the working directory", cwd, "run from a directory without them (rename or move it)"),
        ("the Python", python, "use a virtual environment at a path without them"),
    ):
        if (ch := _bad_char(value, space_ok=False)) is not None:
            raise UserError(
                f"{what} {value!r} holds {ch!r}: {why}. A path there may hold {_ALLOWED} only: "
                f"{fix}, {_NO_SSH}."
            )
