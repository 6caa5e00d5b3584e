"""Health report: the seed's "what to watch" table, each signal marked healthy or problem.

=================  ========================  ===============================
signal             healthy                   problem
=================  ========================  ===============================
train loss         falls steadily            flat near the random baseline
val loss           falls, then stabilizes    rises while train loss falls
grad norm          finite, bounded           NaN or repeated huge spikes
tokens/s           stable for a config       sudden drop or data stall
downstream <task>  holds or rises            fell by > 2 stderr, or failed
experts            each keeps a share        one's share stays near 0
expert balance     max/mean load near 1      max/mean stays above 2 at the end
=================  ========================  ===============================

The last two are a sparse model's (a run with ``moe`` rows; ``anneal.observe.moe``).

The random baseline is ``ln(V)`` nats per token: a model that has learned nothing spreads its
probability evenly over the V ids. Thresholds are in the constants below, with their reasons.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import sys
import textwrap
from pathlib import Path

from anneal import rundir
from anneal.files import write_atomic
from anneal.json_values import is_finite_number
from anneal.observe import moe
from anneal.observe.health_signal import HEALTHY, PROBLEM, UNKNOWN, Signal

log = logging.getLogger("anneal.observe.report")  # the same name when run as __main__

# Train loss counts as "near the baseline" above this share of ln(V): a model that has learned
# only unigram frequencies is already well below it (stdlib corpus: ~0.6 ln V).
NEAR_BASELINE = 0.9
# Val loss "rises" when its last value is this much (relative) above its best so far.
VAL_RISE = 0.02
# A grad-norm spike: this many times the median of the previous SPIKE_WINDOW steps; "repeated"
# means at least SPIKES_REPEATED of them.
SPIKE_FACTOR = 5.0
SPIKE_WINDOW = 20
SPIKES_REPEATED = 3
# Throughput "drops" when the last tenth's median is below this share of the run's median;
# the data loader "stalls" when it holds the step this share of the time (median).
TPUT_DROP = 0.5
DATA_STALL = 0.10
# The report's lines wrap at this many characters, between words: a long detail (a failed
# task's reason and its fix) goes on under its own column, never cut.
REPORT_WIDTH = 100


def _window(values: list[float], share: float = 0.1) -> int:
    return max(1, int(len(values) * share))


def train_loss_signal(train: list[dict], vocab_size: int | None) -> Signal:
    means = "falls steadily, away from ln(V)"
    losses = [r["loss"] for r in train if is_finite_number(r.get("loss"))]
    if len(losses) < 2:
        return Signal("train loss", UNKNOWN, f"{len(losses)} finite value(s)", means)
    k = _window(losses)
    first, last = statistics.fmean(losses[:k]), statistics.fmean(losses[-k:])
    detail = f"first {first:.3f} -> last {last:.3f} nats"
    problems = []
    if vocab_size:
        baseline = math.log(vocab_size)
        detail += (
            f"; ln(V) = {baseline:.3f} (V = {vocab_size}), last at {last / baseline:.0%} of it"
        )
        if last >= NEAR_BASELINE * baseline:
            problems.append(f"flat near the random baseline (>= {NEAR_BASELINE:.0%} of ln V)")
    if last >= first * 0.99:
        problems.append("not falling")
    if problems:
        return Signal("train loss", PROBLEM, f"{'; '.join(problems)}: {detail}", means)
    return Signal("train loss", HEALTHY, detail, means)


def val_loss_signal(
    val: list[dict], train: list[dict], *, why: str = "overfitting or a data leak"
) -> Signal:
    """``why``: what a validation loss that rises while the train loss falls suggests."""
    means = "falls, then stabilizes"
    points = [(r["step"], r["val_loss"]) for r in val if is_finite_number(r.get("val_loss"))]
    if len(points) < 2:
        return Signal("val loss", UNKNOWN, f"{len(points)} validation(s); need 2", means)
    best_step, best = min(points, key=lambda p: p[1])
    last_step, last = points[-1]
    detail = f"best {best:.3f} at step {best_step}, last {last:.3f} at step {last_step}"
    if last > best * (1 + VAL_RISE) and last_step > best_step:
        span = [
            r["loss"]
            for r in train
            if best_step <= r["step"] <= last_step and is_finite_number(r.get("loss"))
        ]
        k = _window(span) if span else 0
        falling = span and statistics.fmean(span[-k:]) < statistics.fmean(span[:k])
        if falling:
            return Signal(
                "val loss",
                PROBLEM,
                f"rises while train loss falls ({why}): {detail}",
                means,
            )
        return Signal("val loss", PROBLEM, f"rises (> {VAL_RISE:.0%} above best): {detail}", means)
    return Signal("val loss", HEALTHY, detail, means)


def source_signals(val: list[dict], train: list[dict]) -> list[Signal]:
    """The val-loss signal of each source of a blend (``val_loss/<source>``), with its last bits
    per byte: the total can fall while one source rises (is being forgotten)."""
    out = []
    for source in rundir.val_sources(val):
        rows = [{"step": r["step"], "val_loss": r.get(f"val_loss/{source}")} for r in val]
        signal = val_loss_signal(rows, train, why="this source is being forgotten")
        bpb = [r[f"val_bpb/{source}"] for r in val if is_finite_number(r.get(f"val_bpb/{source}"))]
        detail = signal.detail + (f"; last {bpb[-1]:.3f} bits/byte" if bpb else "")
        out.append(dataclasses.replace(signal, name=f"val loss {source}", detail=detail))
    return out


def grad_norm_signal(train: list[dict], events: list[dict], clip: float | None) -> Signal:
    means = "finite, bounded after clipping"
    nonfinite = [
        r["step"]
        for r in train
        if "grad_norm" in (r.get("nonfinite") or [])
        or ("grad_norm" in r and not is_finite_number(r["grad_norm"]))
    ]
    norms = [(r["step"], r["grad_norm"]) for r in train if is_finite_number(r.get("grad_norm"))]
    spikes = []
    for i in range(1, len(norms)):
        prev = [g for _, g in norms[max(0, i - SPIKE_WINDOW) : i]]
        base = statistics.median(prev)
        if base > 0 and norms[i][1] > SPIKE_FACTOR * base:
            spikes.append(norms[i][0])
    spike_events = [e["step"] for e in events if e.get("event") in ("spike", "rewind", "skip")]
    detail = (
        f"median {statistics.median([g for _, g in norms]):.3g}, max {max(g for _, g in norms):.3g}"
        if norms
        else "no finite values"
    )
    if clip:
        detail += f" (clip at {clip:g})"
    detail += f"; {len(spikes)} spike(s) > {SPIKE_FACTOR:g}x the running median"
    if spike_events:
        detail += f"; spike/rewind/skip events at steps {spike_events[:5]}"
    if nonfinite:
        return Signal(
            "grad norm",
            PROBLEM,
            f"non-finite at steps {nonfinite[:5]} ({len(nonfinite)}); {detail}",
            means,
        )
    if len(spikes) + len(spike_events) >= SPIKES_REPEATED:
        return Signal(
            "grad norm",
            PROBLEM,
            f"repeated spikes at {(spikes + spike_events)[:5]}; {detail}",
            means,
        )
    if not norms:
        return Signal("grad norm", UNKNOWN, detail, means)
    return Signal("grad norm", HEALTHY, detail, means)


def throughput_signal(train: list[dict]) -> Signal:
    means = "stable for the same config; the data loader never waits"
    rows = train[1:] if len(train) > 2 else train  # the first step compiles and warms caches
    tput = [r["tokens_per_s"] for r in rows if is_finite_number(r.get("tokens_per_s"))]
    if len(tput) < 2:
        return Signal("tokens/s", UNKNOWN, f"{len(tput)} value(s)", means)
    overall = statistics.median(tput)
    last = statistics.median(tput[-_window(tput) :])
    waits = [r["data_wait_share"] for r in rows if is_finite_number(r.get("data_wait_share"))]
    wait = statistics.median(waits) if waits else 0.0
    detail = (
        f"median {overall:,.0f}, last tenth {last:,.0f} tokens/s; data wait {wait:.1%} of step time"
    )
    problems = []
    if last < TPUT_DROP * overall:
        problems.append(f"dropped below {TPUT_DROP:.0%} of the run's median")
    if wait > DATA_STALL:
        problems.append(f"data loader stalls (> {DATA_STALL:.0%} of step time)")
    if problems:
        return Signal("tokens/s", PROBLEM, f"{'; '.join(problems)}: {detail}", means)
    return Signal("tokens/s", HEALTHY, detail, means)


def downstream_signals(run_dir: Path, rows: list[dict]) -> list[Signal]:
    """One signal per downstream task (``anneal.observe.downstream``): its latest score with
    its stderr and step, a problem when it fell (``downstream.RULE``) or the latest scoring
    did not score it. A damaged evals/ document is left out, with a warning that names it."""
    from anneal.observe import downstream

    means = f"holds or rises ({downstream.RULE})"
    out = []
    for t in downstream.read_scores(run_dir, rows):
        name = f"downstream {t.task}"
        if not t.scores:
            out.append(Signal(name, PROBLEM, f"never scored: {t.failed}", means))
            continue
        latest = t.scores[-1]
        chance = f" (chance {t.chance:.3g})" if t.chance is not None else ""
        detail = f"{t.metric} {downstream.show(latest)} at step {latest.step}{chance}"
        if t.failed:
            why = f"did not score at step {t.failed_step} ({t.failed}); last {detail}"
            out.append(Signal(name, PROBLEM, why, means))
        elif len(t.scores) < 2:
            out.append(Signal(name, UNKNOWN, f"{detail}; one scoring, none to compare", means))
        elif fell := t.fell():
            best = fell[0]
            side = "above" if t.lower_is_better else "below"
            why = f"{downstream.FELL_STDERR:g} x its stderr {side} its best earlier"
            fell_to = f"fell: {detail}, more than {why} {best.value:.4g} at step {best.step}"
            out.append(Signal(name, PROBLEM, fell_to, means))
        else:
            best = t.best(t.scores[:-1])
            tail = "" if latest.stderr is not None else "; no stderr, so a fall is not judged"
            earlier = f"best earlier {best.value:.4g} at step {best.step}{tail}"
            out.append(Signal(name, HEALTHY, f"{detail}; {earlier}", means))
    return out


SAVE_WAIT_S = 1.0
"""An asynchronous save that waited longer than this for the write before it is a problem of
the save interval (docs/resilience.md, "Asynchronous saves")."""


def saves_signal(events: list[dict]) -> list[Signal]:
    """What the checkpoints cost the training: the seconds the loop waited at each save
    (``blocking_s``) and, for asynchronous saves, those their files took behind it
    (``write_s``); a problem when an asynchronous save waited for the write before it (saves
    more often than a write takes). None for a run whose events carry no save times."""
    saves = [e for e in events if e.get("event") == "checkpoint" and "blocking_s" in e]
    if not saves:
        return []
    blocking = sorted(e["blocking_s"] for e in saves)
    detail = (
        f"{len(saves)} save(s); the loop waited {blocking[len(blocking) // 2]:.2f} s (median, "
        f"max {blocking[-1]:.2f} s)"
    )
    means = "no asynchronous save waits for the one before it"
    if not any(e.get("asynchronous") for e in saves):
        return [Signal("checkpoint saves", HEALTHY, detail + ", synchronous", means)]
    writes = sorted(e.get("write_s", 0.0) for e in saves)
    detail += f"; written behind the training in {writes[len(writes) // 2]:.2f} s (median)"
    waited = [e["step"] for e in saves if e.get("waited_s", 0.0) > SAVE_WAIT_S]
    if waited:
        why = f"; the saves of steps {waited[:5]} waited for the write before: save less often"
        return [Signal("checkpoint saves", PROBLEM, detail + why, means)]
    return [Signal("checkpoint saves", HEALTHY, detail, means)]


def health(run_dir: Path) -> list[Signal]:
    """The four signals of a run directory, one val-loss signal per source of a blend, one
    per downstream task and a sparse model's two (UserError if it has no train rows yet)."""
    rows = rundir.read_metrics(run_dir, trained=True)
    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val"]
    events = [r for r in rows if r.get("kind") == "event"]
    record = rundir.record_or_empty(run_dir)
    vocab, clip = record.vocab_size, record.gradient_clipping
    return [
        train_loss_signal(train, vocab),
        val_loss_signal(val, train),
        grad_norm_signal(train, events, clip),
        throughput_signal(train),
        *source_signals(val, train),
        *downstream_signals(run_dir, rows),
        *moe.signals(rows),
        *saves_signal(events),
    ]


def format_table(signals: list[Signal], *, run_dir: Path | None = None) -> str:
    marks = {HEALTHY: "healthy", PROBLEM: "PROBLEM", UNKNOWN: "n/a"}
    width = max(len(s.name) for s in signals)
    head = f"{rundir.REPORT_HEAD}{run_dir}" if run_dir else "health"
    lines = [head]
    if run_dir is not None:  # a cooldown branch names its parent (anneal.resolution.cooldown)
        from anneal.resolution.cooldown import lineage

        lines += [f"  {line}" for line in lineage(Path(run_dir))]
    for s in signals:
        head = f"  {s.name:<{width}}  {marks[s.status]:<7}  "
        lines += textwrap.wrap(
            s.detail or "-",
            width=max(REPORT_WIDTH, len(head) + 40),
            initial_indent=head,
            subsequent_indent=" " * len(head),
            break_long_words=False,
            break_on_hyphens=False,
        )
    n_bad = sum(s.status == PROBLEM for s in signals)
    lines.append(f"  {n_bad} problem(s)" if n_bad else "  no problems")
    return "\n".join(lines)


def write_report(run_dir: Path) -> str:
    """The table, also written to ``RUN/report.txt``; returns it. A ``report.txt`` there that
    Anneal did not write (``anneal.rundir.written_by_anneal``) is kept, and a warning says so."""
    text = format_table(health(run_dir), run_dir=run_dir)
    path = rundir.report_path(run_dir)
    if (path.exists() or path.is_symlink()) and not rundir.written_by_anneal(path):
        log.warning(
            "%s: not a report Anneal wrote, so it is kept and the report is not saved. Move it "
            "away, then run `anneal report %s` (which prints the report).",
            path,
            run_dir,
        )
    else:
        write_atomic(path, text + "\n")
    return text


def end_of_run(run_dir: Path) -> None:
    """What a run does after its last step (``anneal.observe.progress.finish_run`` runs it in a
    child process): its plots, then its health report, printed and saved. A file of someone
    else's where a chart or the report goes is kept (a warning says so), never replaced."""
    from anneal.observe import plots

    plots.plot_run(run_dir, keep_others=True)
    print(write_report(run_dir), flush=True)


def main(argv: list[str]) -> int:
    """``python -m anneal.observe.report RUN --end-of-run``: ``end_of_run``; a UserError (a
    damaged metrics.jsonl, say) is one paragraph on stderr and exit status 2."""
    from anneal.errors import UserError

    if len(argv) != 2 or argv[1] != "--end-of-run":
        print("usage: python -m anneal.observe.report RUN --end-of-run", file=sys.stderr)
        print("(or: anneal report RUN, anneal plot RUN)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        end_of_run(Path(argv[0]))
    except UserError as e:  # anything else is a bug or the environment: keep its traceback
        print(f"error: plots and report at the end of the run: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
