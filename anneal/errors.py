"""The one exception for what the user can fix.

Library code raises ``UserError`` with one paragraph that names the file, line, flag or key and
says how to fix it. Only the entry points (``recipes/*`` through ``anneal.cli.recipe``, the
``anneal`` CLI and ``python -m launcher``) catch it: they print the paragraph and exit 2.
Every other exception is a bug or an environment failure and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in a config file, flag, override or input that the user can fix.

    ``every_rank`` is True when every rank of a distributed run raises the same error (the
    resolution of the launch, which is deterministic); the entry point then prints it once.
    Otherwise the rank that saw it prints it with its rank.
    """

    def __init__(self, message: str, *, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank
