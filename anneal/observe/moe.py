"""A sparse model's balance: its rows in metrics.jsonl, its TensorBoard/W&B scalars and its two
report signals (the charts are ``moe_plots``).

Every train row of a sparse model carries (the core's contract, docs/observability.md):
``aux_loss`` (the router's load-balancing loss, unscaled: top_k when balanced), ``z_loss``,
``moe_max_mean`` (per layer: the busiest expert's load over the mean load, 1 = uniform),
``moe_entropy`` (per layer: the router's mean entropy in nats, ln E = uniform) and
``moe_counts`` (per layer, per expert: the step's token-to-expert assignments). The counts are
too large for a row per step at scale (a 48-layer, 128-expert model: 6,144 integers), so
``MoeCounts`` sums them and the metrics file gets a ``moe`` row ``{"kind": "moe", "step",
"tokens", "steps": n, "counts": [[...]]}`` every ``log_every`` steps, at each checkpoint, at
the run's last step and when the loop stops; the train rows keep the rest.

Megatron-Core's README warns that dropless MoE "suffers from a severe load imbalance issue
when the router is under-trained" (out-of-memory errors, typically in the first 100-300 steps
from scratch); DeepSpeed AutoEP, which Anneal trains sparse models with, is dropless. The
report flags the two ways a router fails, with the thresholds below.
"""

from __future__ import annotations

import math

from anneal.json_values import is_number
from anneal.observe.health_signal import HEALTHY, PROBLEM, UNKNOWN, Signal

# The train row's fields of a sparse model: each goes to TensorBoard/W&B under moe/ (never as a
# train/ field), and moe_counts not at all (it goes to the moe rows).
MOE_FIELDS = ("aux_loss", "z_loss", "moe_max_mean", "moe_entropy", "moe_counts")

# An expert is collapsed when its share of its layer's assignments stays below this fraction of
# the uniform share (1/E) in every moe row of the judged stretch: a tenth of its share means the
# router has all but stopped sending it tokens, and its parameters stop learning.
COLLAPSED_SHARE = 0.1
# Sustained imbalance: a layer whose busiest expert carries more than this many times the mean
# load in every moe row of the judged stretch. Twice the mean is GShard's capacity factor of 2:
# beyond it a capacity-limited MoE would drop tokens, and a dropless one (AutoEP) runs that
# expert on over twice the tokens (activation memory and time) the layout was planned for.
IMBALANCE_MAX_MEAN = 2.0
# The judged stretch: the last quarter of the moe rows (at least one), the end of the run, once
# the router has had time to learn; an imbalance early in a run from scratch is expected.
JUDGED_SHARE = 0.25
# A verdict waits for evidence, as the validation loss's does (2 validations): the judged
# stretch must hold this many moe rows (a run of at least 5), else the signal is n/a. One row
# of a short run's untrained router said "PROBLEM" where docs/moe.md calls it expected.
MIN_JUDGED_ROWS = 2
MEGATRON = (
    "Megatron-Core's README: dropless MoE 'suffers from a severe load imbalance issue when the "
    "router is under-trained'"
)


# --- writing: the moe rows and the scalars ----------------------------------------------------


class MoeCounts:
    """The token-to-expert counts of the steps since the last moe row, summed."""

    def __init__(self):
        self.counts: list[list[int]] | None = None
        self.steps, self.step, self.tokens = 0, None, None

    def add(self, row: dict) -> None:
        """A train row's ``moe_counts`` (if it has them) added to the sum."""
        counts = row.get("moe_counts")
        if not isinstance(counts, list):
            return
        if self.counts is None:
            self.counts = [list(layer) for layer in counts]
        else:
            assert [len(x) for x in counts] == [len(x) for x in self.counts], "moe_counts shape"
            for total, layer in zip(self.counts, counts, strict=True):
                for e, n in enumerate(layer):
                    total[e] += n
        self.steps, self.step, self.tokens = self.steps + 1, row["step"], row.get("tokens")

    def take(self) -> dict | None:
        """The moe row of the steps summed so far (None if there are none); the sum restarts."""
        if self.counts is None:
            return None
        row = {"kind": "moe", "step": self.step, "tokens": self.tokens, "steps": self.steps}
        row["counts"] = self.counts
        self.__init__()
        return row

    def drop(self) -> None:
        """Forget the steps summed so far (a rewind: they are trained again)."""
        self.__init__()


def without_counts(row: dict) -> dict:
    """The train row as metrics.jsonl gets it: without ``moe_counts``."""
    return {k: v for k, v in row.items() if k != "moe_counts"} if "moe_counts" in row else row


def scalars(row: dict) -> dict[str, float]:
    """A sparse train row's TensorBoard/W&B scalars: ``moe/aux_loss``, ``moe/z_loss``,
    ``moe/max_mean/layer_<i>``, ``moe/max_mean/worst`` (the largest layer's),
    ``moe/entropy/layer_<i>``; a dense row's: none."""
    out = {f"moe/{k}": row[k] for k in ("aux_loss", "z_loss") if is_number(row.get(k))}
    for key, name in (("moe_max_mean", "max_mean"), ("moe_entropy", "entropy")):
        values = row.get(key)
        if isinstance(values, list):
            out |= {f"moe/{name}/layer_{i}": v for i, v in enumerate(values) if is_number(v)}
    worst = [v for v in row.get("moe_max_mean") or [] if is_number(v) and math.isfinite(v)]
    if worst:
        out["moe/max_mean/worst"] = max(worst)
    return out


# --- reading: the moe rows of a run, and the report's two signals -----------------------------


def moe_rows(rows: list[dict]) -> list[dict]:
    """The run's moe rows, in order, as the steps that stuck trained: a resume at step S, or a
    rewind to step S, drops the moe rows written before it whose last step is after S (those
    steps are trained again and written again), so no step counts twice."""
    kept: list[dict] = []
    for row in rows:
        kind = row.get("kind")
        back_to = None
        if kind == "event" and row.get("event") == "resume":
            back_to = row.get("step")
        elif kind == "event" and row.get("event") == "rewind":
            back_to = row.get("to_step")
        if isinstance(back_to, int):
            kept = [r for r in kept if r["step"] <= back_to]
        elif kind == "moe" and isinstance(row.get("step"), int) and _counts(row) is not None:
            kept.append(row)
    shape = [len(layer) for layer in kept[-1]["counts"]] if kept else None
    return [r for r in kept if [len(layer) for layer in r["counts"]] == shape]


def _counts(row: dict) -> list[list[int]] | None:
    counts = row.get("counts")
    ok = isinstance(counts, list) and all(
        isinstance(layer, list) and layer and all(is_number(n) for n in layer) for layer in counts
    )
    return counts if ok and counts else None


def steps(row: dict) -> int:
    """How many steps a moe row sums (1 if it does not say)."""
    steps = row.get("steps")
    return steps if isinstance(steps, int) and steps >= 1 else 1


def shares(counts: list[list[int]]) -> list[list[float]]:
    """Each expert's share of its layer's assignments (0 where a layer has none)."""
    out = []
    for layer in counts:
        total = sum(layer)
        out.append([n / total if total else 0.0 for n in layer])
    return out


def judged(moe: list[dict]) -> list[dict]:
    """The stretch the signals judge: the last ``JUDGED_SHARE`` of the moe rows, at least one."""
    return moe[-max(1, math.ceil(len(moe) * JUDGED_SHARE)) :]


def _too_few(name: str, moe: list[dict], means: str) -> Signal | None:
    """n/a, saying what it waits for, while the judged stretch holds under ``MIN_JUDGED_ROWS``."""
    if not moe:
        return Signal(name, UNKNOWN, "no moe rows", means)
    rows = judged(moe)
    if len(rows) >= MIN_JUDGED_ROWS:
        return None
    wait = (
        f"{_stretch(moe)}: too few to judge; a verdict needs "
        f"{MIN_JUDGED_ROWS} in the last quarter of the run (an untrained router's imbalance "
        f"is expected early)"
    )
    return Signal(name, UNKNOWN, wait, means)


def _stretch(rows: list[dict]) -> str:
    first = rows[0]["step"] - steps(rows[0]) + 1
    return f"steps {first}-{rows[-1]['step']} ({len(rows)} moe row(s))"


def collapse_signal(moe: list[dict]) -> Signal:
    """A problem when an expert's share stays below ``COLLAPSED_SHARE`` of uniform in every
    judged moe row; it names each such layer and expert."""
    means = f"every expert keeps >= {COLLAPSED_SHARE:.0%} of its uniform share"
    if waiting := _too_few("experts", moe, means):
        return waiting
    rows = judged(moe)
    per_row = [shares(r["counts"]) for r in rows]
    collapsed = []
    for layer, layer_shares in enumerate(per_row[-1]):
        uniform = 1 / len(layer_shares)
        for expert in range(len(layer_shares)):
            if all(s[layer][expert] < COLLAPSED_SHARE * uniform for s in per_row):
                most = max(s[layer][expert] for s in per_row)
                collapsed.append(f"layer {layer} expert {expert} (<= {most:.2%} of {uniform:.2%})")
    where = _stretch(rows)
    if collapsed:
        detail = f"{len(collapsed)} collapsed over {where}: {_listed(collapsed)}; {MEGATRON}"
        return Signal("experts", PROBLEM, detail, means)
    n = sum(len(layer) for layer in per_row[-1])
    return Signal("experts", HEALTHY, f"none of {n} collapsed over {where}", means)


def imbalance_signal(moe: list[dict]) -> Signal:
    """A problem when a layer's max/mean load stays above ``IMBALANCE_MAX_MEAN`` in every
    judged moe row; it names each such layer and its busiest expert over the stretch."""
    means = f"max/mean load near 1, not above {IMBALANCE_MAX_MEAN:g} for long"
    if waiting := _too_few("expert balance", moe, means):
        return waiting
    rows = judged(moe)
    ratios = [[_max_mean(layer) for layer in r["counts"]] for r in rows]
    worst_layer = max(range(len(ratios[-1])), key=lambda i: ratios[-1][i])
    where = _stretch(rows)
    detail = f"last max/mean {ratios[-1][worst_layer]:.2f} (layer {worst_layer}) over {where}"
    hot = []
    for layer in range(len(ratios[-1])):
        if all(r[layer] > IMBALANCE_MAX_MEAN for r in ratios):
            summed = [sum(n) for n in zip(*(r["counts"][layer] for r in rows), strict=True)]
            expert = max(range(len(summed)), key=summed.__getitem__)
            low = min(r[layer] for r in ratios)
            hot.append(f"layer {layer} (>= {low:.2f}, busiest expert {expert})")
    if hot:
        why = f"max/mean above {IMBALANCE_MAX_MEAN:g} throughout {where}: {_listed(hot)}"
        why += f"; {MEGATRON}"
        return Signal("expert balance", PROBLEM, why, means)
    return Signal("expert balance", HEALTHY, detail, means)


def _listed(items: list[str], at_most: int = 8) -> str:
    more = len(items) - at_most
    return ", ".join(items[:at_most]) + (f" and {more} more" if more > 0 else "")


def _max_mean(layer: list[int]) -> float:
    mean = sum(layer) / len(layer)
    return max(layer) / mean if mean else 1.0


def signals(rows: list[dict]) -> list[Signal]:
    """The report's signals of a sparse run (one with moe rows); none for a dense run."""
    moe = moe_rows(rows)
    return [collapse_signal(moe), imbalance_signal(moe)] if moe else []
