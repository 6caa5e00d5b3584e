"""One line of the health report (``anneal.observe.report``): a signal, marked healthy, problem
or n/a, with what healthy means. Its own module so that the signals of a sparse model's
balance (``anneal.observe.moe``) and the report's own share it."""

from __future__ import annotations

import dataclasses

HEALTHY, PROBLEM, UNKNOWN = "healthy", "problem", "n/a"


@dataclasses.dataclass
class Signal:
    name: str
    status: str
    detail: str
    healthy_means: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
