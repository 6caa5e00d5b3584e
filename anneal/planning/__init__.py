"""Chinchilla scaling laws: the law and its published fits (``law``), the compute-optimal
planner behind ``anneal plan`` (``planner``), and fitting the law to a user's own runs
(``runs`` reads them, ``fit`` fits them) behind ``anneal fit``. Beside the law: the per-GPU
memory of a run behind ``anneal estimate`` (``memory`` the estimate, ``memory_activations`` what
a layer keeps for backward, ``memory_tp``, ``memory_sp`` and ``memory_ep`` the tensor, sequence
and expert parallelism, ``memory_levers`` what to change when it does not fit, ``memory_io``
what the command reads and prints, ``float8_costs`` what float8 training changes), how a
sparse model is planned (``sparse``) and the forecast a run checks itself against
(``forecast``).

The names below are the public interface; ``from anneal import planning`` and
``planning.plan(...)`` keep working whichever module a name lives in. docs/planning.md has the
formulas, the fits and the checks.
"""

from anneal.planning.fit import (
    HUBER_DELTA,
    INIT_GRID,
    FitResult,
    fit_points,
    format_fit,
    huber_objective,
    write_fit,
)
from anneal.planning.law import (
    DEFAULT_FIT,
    FIT_FORMAT,
    FIT_VERSION,
    FITS,
    PARAM_NAMES,
    ChinchillaFit,
    load_fit,
)
from anneal.planning.planner import (
    DEFAULT_GLOBAL_BATCH,
    ComputePlan,
    format_plan,
    nearest_preset,
    parse_rule,
    plan,
)
from anneal.planning.run_points import RunPoint, mfu_from_run, read_csv, read_run, read_runs

__all__ = [
    "DEFAULT_FIT",
    "DEFAULT_GLOBAL_BATCH",
    "FITS",
    "FIT_FORMAT",
    "FIT_VERSION",
    "HUBER_DELTA",
    "INIT_GRID",
    "PARAM_NAMES",
    "ChinchillaFit",
    "ComputePlan",
    "FitResult",
    "RunPoint",
    "fit_points",
    "format_fit",
    "format_plan",
    "huber_objective",
    "load_fit",
    "mfu_from_run",
    "nearest_preset",
    "parse_rule",
    "plan",
    "read_csv",
    "read_run",
    "read_runs",
    "write_fit",
]
