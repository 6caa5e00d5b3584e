"""A compiled model (``train.compile``; docs/throughput.md): ``engine.compile()`` once per
process, and the time it takes kept apart from the steps'.

torch.compile compiles lazily: the first forward and backward of a step trace and compile the
model (inductor; on a CPU that takes tens of seconds even for a tiny model), and a guard that
fails later (a new shape, a changed attribute) compiles it again. ``CompileClock`` reads
torch's own count of the seconds spent compiling (``torch._dynamo.utils``) around each step:
what a step spent compiling is its row's ``compile_s``, its ``tokens_per_s`` is the rate
without it, and a compilation after the first step is a recompilation, warned about with the
count so far."""

from __future__ import annotations

import logging

from anneal.dist import rank

log = logging.getLogger(__name__)


def compile_engine(engine) -> None:
    """``engine.compile()`` once per process: DeepSpeed compiles its module in place (the
    parameters and their names are the module's own: checkpoints and exports are unchanged);
    with a ``compile`` section in its config, through DeepCompile's passes."""
    if not engine.is_compiled:
        engine.compile()


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far, forward and backward graphs (torch's
    own count)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


class CompileClock:
    """Takes each step's compile time out of its rate (``account``), and counts compilations."""

    def __init__(self) -> None:
        self.seen_s = compile_seconds()
        self.compiled_steps: list[int] = []

    def start(self) -> None:
        """Before a step: what compiles from here on is the step's (a validation's first pass
        compiles too, between steps, and is no step's)."""
        self.seen_s = compile_seconds()

    def account(self, row: dict, *, tokens_per_step: int) -> None:
        """Add ``compile_s`` to a step's ``row`` that compiled, and set its ``tokens_per_s``
        to the rate of the step's time less that; warn from the second compiling step on."""
        now = compile_seconds()
        spent, self.seen_s = now - self.seen_s, now
        if spent <= 0:
            return
        row["compile_s"] = round(spent, 3)
        step_s = tokens_per_step / row["tokens_per_s"]
        row["tokens_per_s"] = tokens_per_step / max(step_s - spent, 1e-9)
        self.compiled_steps.append(row["step"])
        if len(self.compiled_steps) > 1 and rank() == 0:
            log.warning(
                "train.compile: step %d compiled the model again (%.1f s; compilations at steps "
                "%s): a guard of the compiled graph failed, e.g. a new input shape",
                row["step"],
                spent,
                ", ".join(map(str, self.compiled_steps)),
            )
