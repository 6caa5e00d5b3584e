"""What a JSON document read back from disk holds (a run's config.json, a metrics row, a
DeepSpeed config, an evals document): ``json`` gives ``True`` for ``true``, and ``bool`` is an
``int`` in Python, so "is this a number?" needs one definition that every reader shares."""

from __future__ import annotations

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
