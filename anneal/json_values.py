"""What a JSON document read back from disk holds (a run's config.json, a metrics row, a
DeepSpeed config, an evals document): ``json`` gives ``True`` for ``true``, and ``bool`` is an
``int`` in Python, so "is this a number?" needs one definition that every reader shares."""

from __future__ import annotations

import json
import math

INT64_MAX = 2**63 - 1
"""The largest signed 64-bit integer: a number in a config past it (either sign) is refused,
as torch and DeepSpeed hold such values in int64."""


def is_number(value: object) -> bool:
    """An int or a float, never a bool (NaN and infinities included: ``json`` reads them)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """A number (``is_number``) that is neither NaN nor infinite: one a chart or a table can
    show."""
    return is_number(value) and math.isfinite(value)


def loads_bounded(data: bytes | str, *, max_depth: int) -> object:
    """``json.loads`` of a document from elsewhere, its arrays and objects nested at most
    ``max_depth`` deep (a planted ``[[[[...`` is a ValueError, not a RecursionError)."""
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    todo = [(doc, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, dict | list):
            if depth > max_depth:
                raise ValueError(f"nested deeper than {max_depth} levels")
            todo += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return doc


def is_printable_name(value: object, *, limit: int = 200) -> bool:
    """A non-empty string of at most ``limit`` printable characters: no newline, tab, escape
    (an ANSI colour sequence) or other control character that would reach a terminal."""
    return isinstance(value, str) and 0 < len(value) <= limit and value.isprintable()
