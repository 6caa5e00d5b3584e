"""A sparse model's balance, seen (docs/observability.md, "A sparse model's balance"), on
synthetic rows in the core's contract, no engine: the Metrics observer turns each train row's
``moe_counts`` into moe rows whose counts are the sum of their steps (every ``log_every``
steps, at a checkpoint, at the end), and a resume or a rewind counts no step twice and loses
none; TensorBoard and W&B get the moe/ tags (a dense run's tags are unchanged); the console
shows the aux loss beside the loss (a dense line is unchanged); ``anneal plot`` draws the
expert-load heat map and the balance chart for a sparse run only; ``anneal report`` flags a
collapsed expert and a sustained imbalance by layer and expert, and passes a balanced run."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

LAYERS, EXPERTS, TOP_K = 2, 4, 2


def counts_of(rng, probs) -> list[list[int]]:
    """A step's counts: 64 tokens per layer, each assigned TOP_K times, by ``probs`` [L][E]."""
    return [rng.multinomial(64 * TOP_K, p).tolist() for p in probs]


def sparse_row(step: int, counts: list[list[int]], aux: float = 2.01) -> dict:
    """A train row of a sparse model as the core writes it (its contract)."""
    ratios = [max(c) / (sum(c) / len(c)) for c in counts]
    return {
        "kind": "train",
        "step": step,
        "tokens": 128 * step,
        "loss": 5.0 - 0.01 * step,
        "lr": 1e-3,
        "aux_loss": aux,
        "z_loss": 0.5,
        "moe_max_mean": ratios,
        "moe_entropy": [math.log(EXPERTS) - 0.1] * len(counts),
        "moe_counts": counts,
    }


def observed(run: Path, rows_and_events, *, log_every: int, end: bool = True) -> None:
    """The rows and events (``("event", step, name, fields)``) through the real Metrics
    observer into ``run``'s metrics.jsonl, as the loop sends them; ``end``: the run's last
    step was reached (``on_end``); ``close`` in any case."""
    from anneal.observe.metrics import MetricsLogger
    from anneal.train.observers import Metrics

    run.mkdir(parents=True, exist_ok=True)
    metrics = Metrics(MetricsLogger(run, tensorboard=False), run_dir=run, log_every=log_every)
    for item in rows_and_events:
        if isinstance(item, tuple):
            _, step, name, fields = item
            metrics.on_event(step, name, **fields)
        else:
            metrics.on_step(item)
    if end:
        metrics.on_end()
    metrics.close()


def total(rows: list[dict]) -> np.ndarray:
    return np.sum([np.asarray(r["moe_counts"]) for r in rows], axis=0)


def test_moe_rows_sum_their_steps_and_train_rows_keep_the_rest(tmp_path):
    """log_every 4 over 10 steps with a checkpoint at step 6: moe rows at steps 4, 6, 8 and 10
    (the checkpoint's and the last step's), each holding exactly the sum of its steps' counts
    (numpy's sum of the rows given), with its step count and tokens; the train rows lose only
    ``moe_counts``. A dense run's rows go through unchanged, with no moe row."""
    from anneal.rundir import read_metrics

    rng = np.random.default_rng(0)
    rows = [sparse_row(s, counts_of(rng, [[0.25] * EXPERTS] * LAYERS)) for s in range(1, 11)]
    checkpoint = ("event", 6, "checkpoint", {"path": "x"})
    observed(tmp_path / "sparse", [*rows[:6], checkpoint, *rows[6:]], log_every=4)
    got = read_metrics(tmp_path / "sparse", "moe")
    assert [(r["step"], r["steps"], r["tokens"]) for r in got] == [
        (4, 4, 512),
        (6, 2, 768),
        (8, 2, 1024),
        (10, 2, 1280),
    ]
    spans = [rows[0:4], rows[4:6], rows[6:8], rows[8:10]]
    for row, span in zip(got, spans, strict=True):
        assert np.array_equal(np.asarray(row["counts"]), total(span))
    train = read_metrics(tmp_path / "sparse", "train")
    assert train == [{k: v for k, v in r.items() if k != "moe_counts"} for r in rows]

    dense = [{"kind": "train", "step": s, "tokens": 128 * s, "loss": 4.0} for s in (1, 2, 3)]
    observed(tmp_path / "dense", dense, log_every=1)
    assert read_metrics(tmp_path / "dense") == dense


def test_a_resume_or_a_rewind_counts_each_step_once(tmp_path):
    """A run killed after step 6 (checkpoint at 5; its close writes step 6's counts), resumed
    at step 5 and run to step 8: the moe rows read back (``moe.moe_rows``) sum to steps 1-5 of
    the first process and 6-8 of the second. A rewind from a spike at step 4 to the checkpoint
    at step 2 drops the moe row of steps 3-3 and the unwritten sum of step 4: the total is
    steps 1-2 and the replayed 3-4."""
    from anneal.observe.moe import moe_rows
    from anneal.rundir import read_metrics

    rng = np.random.default_rng(1)

    def row(s):
        return sparse_row(s, counts_of(rng, [[0.4, 0.3, 0.2, 0.1]] * LAYERS))

    first, second = [row(s) for s in range(1, 7)], [row(s) for s in range(6, 9)]
    run = tmp_path / "resumed"
    ckpt = ("event", 5, "checkpoint", {"path": "x"})
    observed(run, [*first[:5], ckpt, first[5]], log_every=4, end=False)
    observed(run, [("event", 5, "resume", {"position": 0}), *second], log_every=4)
    rows = read_metrics(run)
    assert sum(r["steps"] for r in rows if r["kind"] == "moe") == 9  # 1-4, 5, 6 | 6-8
    kept = moe_rows(rows)
    assert [r["step"] for r in kept] == [4, 5, 8] and sum(r["steps"] for r in kept) == 8
    summed = np.sum([r["counts"] for r in kept], axis=0)
    assert np.array_equal(summed, total(first[:5] + second))

    replay = [row(s) for s in (1, 2, 3, 4, 3, 4)]
    run = tmp_path / "rewound"
    stream = [*replay[:2], ("event", 2, "checkpoint", {"path": "x"}), replay[2], replay[3]]
    stream += [("event", 4, "rewind", {"to_step": 2}), replay[4], replay[5]]
    observed(run, stream, log_every=3)
    kept = moe_rows(read_metrics(run))
    assert [(r["step"], r["steps"]) for r in kept] == [(2, 2), (3, 1), (4, 1)]
    summed = np.sum([r["counts"] for r in kept], axis=0)
    assert np.array_equal(summed, total(replay[:2] + replay[4:]))


def test_tensorboard_gets_the_moe_tags_and_a_dense_run_its_own(tmp_path):
    """TensorBoard's reader finds ``moe/aux_loss``, ``moe/z_loss``, ``moe/max_mean/layer_<i>``,
    ``moe/max_mean/worst`` (the larger) and ``moe/entropy/layer_<i>`` for a sparse row and no
    ``train/`` tag of those fields; a dense row's tags are the ones it had (``train/<field>``,
    ``train/mem_gib/rank<N>``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from anneal.observe.metrics import MetricsLogger
    from anneal.rundir import tb_dir

    def tags(run: Path, row: dict) -> dict:
        run.mkdir()
        logger = MetricsLogger(run)
        logger.write(row)
        logger.close()
        events = EventAccumulator(str(tb_dir(run)))
        events.Reload()
        return {t: events.Scalars(t)[0].value for t in events.Tags()["scalars"]}

    row = sparse_row(3, [[10, 30, 40, 48], [32, 32, 32, 32]], aux=2.25)
    row = {k: row[k] for k in ("kind", "step", "loss", "aux_loss", "z_loss")} | {
        "moe_max_mean": [1.5, 1.0],
        "moe_entropy": [1.2, 1.375],
        "moe_counts": row["moe_counts"],
    }
    assert tags(tmp_path / "sparse", row) == {
        "train/loss": pytest.approx(4.97),
        "moe/aux_loss": 2.25,
        "moe/z_loss": 0.5,
        "moe/max_mean/layer_0": 1.5,
        "moe/max_mean/layer_1": 1.0,
        "moe/max_mean/worst": 1.5,
        "moe/entropy/layer_0": pytest.approx(1.2),
        "moe/entropy/layer_1": 1.375,
    }
    dense = {"kind": "train", "step": 3, "loss": 4.0, "mem_gib": [1.5, 2.5]}
    assert tags(tmp_path / "dense", dense) == {
        "train/loss": 4.0,
        "train/mem_gib/rank0": 1.5,
        "train/mem_gib/rank1": 2.5,
    }


def test_wandb_gets_the_same_moe_scalars(tmp_path):
    """W&B (a recorded run; wandb is not installed here) gets a sparse row's moe/ scalars as
    TensorBoard does, never the counts; a dense row's fields as before."""
    from anneal.observe.progress import WandbSink

    class WandbRun:  # what WandbSink asks of a wandb run for train rows, recorded
        logged = []

        def log(self, data, step):
            self.logged.append((step, data))

    sink = WandbSink(tmp_path, config={}, enabled=False)
    sink._run = run = WandbRun()
    row = sparse_row(2, [[1, 2, 3, 2], [2, 2, 2, 2]])
    sink.log(row)
    sink.log({"kind": "train", "step": 3, "loss": 4.0, "mem_gib": [1.5]})
    assert run.logged[0] == (
        2,
        {
            "train/tokens": 256,
            "train/loss": 4.98,
            "train/lr": 1e-3,
            "moe/aux_loss": 2.01,
            "moe/z_loss": 0.5,
            "moe/max_mean/layer_0": 1.5,
            "moe/max_mean/layer_1": 1.0,
            "moe/max_mean/worst": 1.5,
            "moe/entropy/layer_0": math.log(EXPERTS) - 0.1,
            "moe/entropy/layer_1": math.log(EXPERTS) - 0.1,
        },
    )
    assert run.logged[1] == (3, {"train/loss": 4.0, "train/mem_gib/rank0": 1.5})


def test_the_console_shows_the_aux_loss_beside_the_loss():
    """A sparse row's line reads ``loss 3.2140 aux 2.0030 | lr ...``; a dense row's line has no
    aux and is what it was."""
    from anneal.observe.progress import ProgressBar

    bar = ProgressBar(max_steps=10, stream=io.StringIO(), interactive=False, enabled=False)
    dense = {"step": 5, "loss": 3.214, "lr": 1e-3, "tokens_per_s": 1000.0}
    line = bar.line(dense)
    assert line.startswith("step  5/10 | loss 3.2140 | lr 1.00e-03 | 1,000 tok/s | ETA ")
    sparse = bar.line({**dense, "aux_loss": 2.003, "moe_max_mean": [1.2]})
    assert sparse == line.replace("loss 3.2140", "loss 3.2140 aux 2.0030")


def write_sparse_run(run: Path, probs_at, *, steps: int = 40, log_every: int = 4) -> Path:
    """A sparse run's config.json and metrics.jsonl (through the Metrics observer): step s
    routes by ``probs_at(s)`` ([L][E] probabilities)."""
    rng = np.random.default_rng(2)
    rows = [sparse_row(s, counts_of(rng, probs_at(s))) for s in range(1, steps + 1)]
    observed(run, rows, log_every=log_every)
    model = {"vocab_size": 512, "moe": {"num_experts": EXPERTS, "top_k": TOP_K}}
    (run / "config.json").write_text(json.dumps({"model": model}))
    return run


BALANCED = [[0.25] * EXPERTS] * LAYERS


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and data[-8:-4] == b"IEND"


def test_plot_draws_the_expert_load_heat_map_for_a_sparse_run_only(tmp_path):
    """``anneal plot`` of a sparse run draws expert_load.png and moe_balance.png (valid PNGs);
    of the same run's train rows without moe fields (a dense run), neither. The heat map's
    cells are each expert's share times E (``load_grid``, checked against hand-worked
    counts)."""
    from anneal.observe import plots
    from anneal.observe.moe_plots import load_grid

    run = write_sparse_run(tmp_path / "sparse", lambda s: BALANCED)
    drawn = {p.name for p in plots.plot_run(run)}
    assert {"expert_load.png", "moe_balance.png"} <= drawn
    assert is_png(run / "plots" / "expert_load.png") and is_png(run / "plots" / "moe_balance.png")

    dense = tmp_path / "dense"
    dense.mkdir()
    train = [r for r in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in r]
    fields = ("aux_loss", "z_loss", "moe_max_mean", "moe_entropy")
    rows = [{k: v for k, v in json.loads(r).items() if k not in fields} for r in train]
    (dense / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = {p.name for p in plots.plot_run(dense)}
    assert drawn == {"loss.png", "lr.png", "grad_norm.png", "throughput.png"}

    moe = [
        {"step": 4, "steps": 4, "counts": [[6, 2], [4, 4]]},
        {"step": 6, "steps": 2, "counts": [[0, 8], [1, 3]]},
    ]
    edges, load = load_grid(moe)
    assert edges.tolist() == [0, 4, 6]
    assert load.tolist() == [[[1.5, 0.0], [0.5, 2.0]], [[1.0, 0.5], [1.0, 1.5]]]


def signals_of(run: Path) -> dict:
    from anneal.observe.report import health

    return {s.name: s for s in health(run) if s.name in ("experts", "expert balance")}


def test_report_flags_a_collapsed_expert_and_a_sustained_imbalance(tmp_path):
    """Made-up runs of 40 steps (10 moe rows; the last quarter, 3 rows, is judged): expert 3 of
    layer 1 at 1% of its layer's tokens (under a tenth of uniform) is named as collapsed; layer
    0 with expert 2 at 70% (max/mean 2.8) is named as imbalanced, with Megatron-Core's
    warning; a balanced run passes both, as does one imbalanced only early (steps 1-28); a
    dense run has neither signal."""
    from anneal.observe.report import HEALTHY, PROBLEM

    collapsed = [[0.25] * 4, [0.33, 0.33, 0.33, 0.01]]
    got = signals_of(write_sparse_run(tmp_path / "collapsed", lambda s: collapsed))
    assert got["experts"].status == PROBLEM
    assert "1 collapsed over steps 29-40 (3 moe row(s)): layer 1 expert 3" in got["experts"].detail
    assert "Megatron-Core" in got["experts"].detail
    assert got["expert balance"].status == HEALTHY

    hot = [[0.1, 0.1, 0.7, 0.1], [0.25] * 4]
    got = signals_of(write_sparse_run(tmp_path / "imbalanced", lambda s: hot))
    assert got["expert balance"].status == PROBLEM
    detail = got["expert balance"].detail
    assert "max/mean above 2 throughout steps 29-40" in detail
    assert "layer 0 (>= " in detail and "busiest expert 2)" in detail and "layer 1" not in detail
    assert "under-trained" in detail
    assert got["experts"].status == HEALTHY

    got = signals_of(write_sparse_run(tmp_path / "balanced", lambda s: BALANCED))
    assert {n: s.status for n, s in got.items()} == {"experts": HEALTHY, "expert balance": HEALTHY}
    early = [[0.02, 0.02, 0.94, 0.02]] * LAYERS
    got = signals_of(write_sparse_run(tmp_path / "early", lambda s: early if s <= 28 else BALANCED))
    assert {n: s.status for n, s in got.items()} == {"experts": HEALTHY, "expert balance": HEALTHY}

    dense = tmp_path / "dense"
    observed(dense, [{"kind": "train", "step": s, "loss": 4.0} for s in (1, 2)], log_every=1)
    assert signals_of(dense) == {}


def test_a_short_runs_balance_waits_for_evidence(tmp_path):
    """Issue 46, point 5: docs/observability.md's own 20-step run (log_every 5: 4 moe rows, one
    in the last quarter) had 2 PROBLEMs from one row of an untrained router's counts. A verdict
    needs 2 moe rows in the last quarter (5 in all), as the validation loss waits for 2
    validations: n/a with what it waits for; 5 rows of the same routing are judged."""
    early = [[0.02, 0.02, 0.94, 0.02]] * LAYERS
    got = signals_of(write_sparse_run(tmp_path / "short", lambda s: early, steps=20, log_every=5))
    assert {n: s.status for n, s in got.items()} == {"experts": "n/a", "expert balance": "n/a"}
    assert "steps 1-20 (4 moe row(s)): too few to judge; a verdict needs 2" in got["experts"].detail
    got = signals_of(write_sparse_run(tmp_path / "five", lambda s: early, steps=25, log_every=5))
    assert {n: s.status for n, s in got.items()} == {
        "experts": "problem",
        "expert balance": "problem",
    }
