"""Per-source validation: the held-out windows are chosen source by source, and a blend's row
reports each source's loss and bits per byte beside the total.

Proves: with one source the chosen windows are exactly the former choice (``t * n // k``, k =
min(val_samples, n)), so single-source validation figures are unchanged; source s of a blend
gets its size's share of ``val_samples`` (largest remainder, at least one window, at most all),
spread evenly over its own range, so the same source prepared alone and validated with
``val_samples`` = that share evaluates the same windows; the windows are dealt to ranks so each
is evaluated once, with equal batch counts; source names become clean metric keys, one per
source and never two equal. With the real DeepSpeed engine (one gloo rank in this process,
ZeRO-1 fp32 on CPU, two steps trained so the weights are off init): two text sources prepared as
a blend and each alone with the blend's tokenizer hold the same val windows, and the engine's
per-source ``val_loss/<source>`` and ``val_bpb/<source>`` on the blend equal ``validate`` on
each source alone within 1e-6 relative, while the total is the token-weighted mean of the
sources; two runs through the recipe, 1 rank and 2, agree on them (slow). A blend's figures
reach TensorBoard (read back with its own reader), ``anneal plot`` (val_sources.png), ``anneal
report`` (a source rising while the total falls is flagged as forgotten) and the console's
validation line.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from anneal.data.stream import heldout_counts, heldout_windows, validation_windows
from anneal.train.step import source_keys
from tests.conftest import SMALL


def _former(n_windows, *, n_samples, rank, world_size, micro_batch):
    """validation_windows as it was before per-source validation (one range for the split)."""
    n = min(n_samples, n_windows)
    chosen = [t * n_windows // n for t in range(n)]
    mine = chosen[rank::world_size]
    per_rank = -(-n // world_size)
    batches = -(-per_rank // micro_batch)
    mine += [-1] * (batches * micro_batch - len(mine))
    return [mine[b * micro_batch : (b + 1) * micro_batch] for b in range(batches)]


@pytest.mark.parametrize("n_windows", [1, 7, 100, 1000])
@pytest.mark.parametrize("n_samples", [0, 1, 5, 64, 2000])
def test_one_source_is_the_former_choice(n_windows, n_samples):
    for world, micro in [(1, 4), (2, 4), (3, 8)]:
        for rank in range(world):
            kw = dict(n_samples=n_samples, rank=rank, world_size=world, micro_batch=micro)
            former = _former(n_windows, **kw)
            assert validation_windows(n_windows, **kw) == former
            assert validation_windows(n_windows, sources=[(0, n_windows)], **kw) == former


@pytest.mark.parametrize(
    "sizes, n, counts",
    [
        ([387, 458], 64, [29, 35]),  # 29.3 and 34.7: the larger remainder gets the window
        ([500, 500], 7, [4, 3]),  # a tie goes to the earlier source
        ([1000, 1], 10, [10, 1]),  # a source with a window gets one even below its share
        ([100, 0, 50], 30, [20, 0, 10]),  # an empty source gets none
        ([3, 4], 100, [3, 4]),  # never more than a source has
        ([3, 4], 0, [0, 0]),  # val_samples=0: no validation
    ],
)
def test_counts_follow_size(sizes, n, counts):
    assert heldout_counts(sizes, n) == counts


def test_a_source_alone_with_its_count_gets_the_same_windows():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = [int(x) for x in rng.integers(0, 300, size=int(rng.integers(1, 5)))]
        if not sum(sizes):
            continue
        firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        sources = list(zip(firsts, sizes, strict=True))
        n = int(rng.integers(1, 400))
        chosen = heldout_windows(sources, n)
        counts = heldout_counts(sizes, n)
        assert len(chosen) == len(set(chosen)) == sum(counts)
        total = min(n, sum(sizes))
        share = [total * size / sum(sizes) for size in sizes]  # exact, in windows
        for k, size, exact in zip(counts, sizes, share, strict=True):
            assert k <= size and (k >= 1 or not size)
            assert abs(k - exact) < 1  # largest remainder: within one window of the share
        assert total <= sum(counts) <= total + sum(0 < x < 1 for x in share)
        for (first, size), k in zip(sources, counts, strict=True):
            mine = [j - first for j in chosen if first <= j < first + size]
            assert mine == heldout_windows([(0, size)], k)  # the source prepared alone


@pytest.mark.parametrize("world, micro", [(1, 4), (2, 4), (3, 2)])
def test_sources_are_dealt_once_with_equal_batch_counts(world, micro):
    sources = [(0, 400), (400, 0), (400, 37), (437, 600)]
    per_rank = [
        validation_windows(
            1037, n_samples=50, rank=r, world_size=world, micro_batch=micro, sources=sources
        )
        for r in range(world)
    ]
    assert len({len(b) for b in per_rank}) == 1  # ZeRO-3 forwards are collective
    seen = [j for batches in per_rank for batch in batches for j in batch if j >= 0]
    assert sorted(seen) == heldout_windows(sources, 50)


def test_source_keys():
    assert source_keys(["web.jsonl", "code/", "hf:wikitext?config=a b"]) == [
        "web.jsonl",
        "code_",
        "hf_wikitext_config_a_b",
    ]
    assert source_keys(["a/x", "a_x", ""]) == ["a_x_0", "a_x_1", "_"]


def test_source_keys_never_coincide():
    """Two names that clean to one key get their index appended, and that suffix never takes
    the key of a third source (``a_b.txt_1`` here), whose figures would otherwise vanish; the
    names that stay as they are keep their keys. Then every list of names drawn from an
    alphabet of cleaned-away, suffix and plain characters: one key per source, all distinct."""
    assert source_keys(["a b.txt", "a_b.txt", "a_b.txt_1"]) == [
        "a_b.txt_0",
        "a_b.txt_1_1",
        "a_b.txt_1",
    ]
    assert source_keys(["x", "x", "x_1", "x_1_1"]) == ["x_0", "x_1_1_1", "x_1", "x_1_1"]
    rng = np.random.default_rng(0)
    for _ in range(2000):
        names = ["".join(rng.choice(list("a _1/"), rng.integers(0, 5))) for _ in range(6)]
        keys = source_keys(names)
        assert len(set(keys)) == len(names), (names, keys)
        cleaned = ["".join(c if c in "a1_" else "_" for c in n) or "_" for n in names]
        kept = [k for k, c in zip(keys, cleaned, strict=True) if cleaned.count(c) == 1]
        assert kept == [c for c in cleaned if cleaned.count(c) == 1], (names, keys)


# --- the real engine ---------------------------------------------------------------------------

SEQ = 32
STEPS = 2
FAST = ["--set", "ds.zero_optimization.stage=1", "--set", "ds.gradient_accumulation_steps=1"]


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> dict:
    """Two text sources (prose, code) prepared as a blend, then each alone with the blend's
    tokenizer (``--tokenizer DIR/tokenizer.model``: nothing trained again), in shards of 1,024
    ids (several per source, as a large corpus has); about 1 s."""
    from anneal.data.prepare import prepare

    root = tmp_path_factory.mktemp("per_source")
    prose, code = root / "prose.txt", root / "code.txt"
    prose.write_text(
        "\n\n".join(
            f"doc {i}: " + "the quick brown fox jumps over the lazy dog " * (20 + i % 9)
            for i in range(120)
        )
    )
    code.write_text(
        "\n\n".join(
            f"def f{i}(x):\n" + f"    return x * {i} + {i * i}\n" * (15 + i % 5) for i in range(150)
        )
    )
    common = dict(val_fraction=0.2, shard_tokens=1024, progress=False, workers=1)  # shards
    prepare(inputs=[str(prose), str(code)], out=root / "blend", vocab_size=320, **common)
    tokenizer = root / "blend" / "tokenizer.model"
    for src in (prose, code):
        prepare(inputs=[str(src)], out=root / src.stem, tokenizer=tokenizer, **common)
    return {"blend": root / "blend", "prose.txt": root / "prose", "code.txt": root / "code"}


def test_a_blend_reports_each_source_as_validated_alone(blend, world_of_one, tmp_path):
    """Over 10 s alone, nearly all of it importing transformers' model code and DeepSpeed's
    optimizer, which the suite's other engine tests import anyway: after them, measured 9.5 s
    (and 2.6 s preparing the data) at a load average of 10 on 2 cores; a quiet machine takes
    a few seconds."""
    from anneal.cli.recipe import config_from_args
    from anneal.data.stream import PackedSplit, TokenStream
    from anneal.train import StepShape, TrainState, build_engine, resolve_run, train_step, validate

    argv = ["--data", str(blend["blend"]), "--out", str(tmp_path / "run"), *SMALL]
    argv += ["--set", f"model.seq_len={SEQ}", "--set", "train.val_samples=24", *FAST]
    cfg, overrides = config_from_args(
        argv, prog="recipes/pretrain_tiny.py", preset="tiny", ds_config="cpu.json", on_cpu=True
    )
    launch = resolve_run(cfg, overrides)
    engine = build_engine(launch)
    stream = TokenStream(
        PackedSplit(blend["blend"], "train", seq_len=SEQ),
        **dict(seed=0, rank=0, world_size=1, micro_batch=launch.micro_batch, prefetch=0),
    )
    for _ in range(STEPS):  # off the near-uniform init, so the sources' losses differ
        train_step(engine, stream, TrainState(), StepShape.of(launch))
    token_bytes = np.load(blend["blend"] / "token_bytes.npy")
    val = PackedSplit(blend["blend"], "val", seq_len=SEQ)
    assert val.source_names == ["prose.txt", "code.txt"]
    row = validate(
        engine,
        val,
        token_bytes,
        n_samples=launch.cfg.train.val_samples,
        micro_batch=launch.micro_batch,
    )
    counts = heldout_counts([n for _, n in val.source_windows], 24)
    assert sum(counts) == 24 and min(counts) > 1
    nats = tokens = 0.0
    for name, k in zip(val.source_names, counts, strict=True):
        alone_val = PackedSplit(blend[name], "val", seq_len=SEQ)
        first, n = val.source_windows[val.source_names.index(name)]
        assert alone_val.n_windows == n and alone_val.source_names == [name]
        assert len(alone_val._shards) > 3  # windows within shards cut alike
        assert all((alone_val.window(j) == val.window(first + j)).all() for j in range(n))
        alone_bytes = np.load(blend[name] / "token_bytes.npy")
        ref = validate(engine, alone_val, alone_bytes, n_samples=k, micro_batch=launch.micro_batch)
        assert set(ref) == {"kind", "step", "val_loss", "val_ppl", "val_bpb"}  # one source
        assert row[f"val_loss/{name}"] == pytest.approx(ref["val_loss"], rel=1e-6)
        assert row[f"val_bpb/{name}"] == pytest.approx(ref["val_bpb"], rel=1e-6)
        nats += ref["val_loss"] * k * SEQ
        tokens += k * SEQ
    assert row["val_loss"] == pytest.approx(nats / tokens, rel=1e-6)  # weighted by size
    assert row[f"val_loss/{val.source_names[0]}"] != pytest.approx(
        row[f"val_loss/{val.source_names[1]}"], rel=1e-3
    )  # the sources differ, so the checks above could fail


# --- what shows the figures --------------------------------------------------------------------


def _blend_run(run, *, forgotten: bool):
    """A run's metrics.jsonl through MetricsLogger, as a blend of prose and code.py writes it:
    both sources fall, or code.py rises (is forgotten) while the total still falls."""
    from anneal.observe.metrics import MetricsLogger

    run.mkdir()
    (run / "config.json").write_text('{"model": {"vocab_size": 320}}')
    logger = MetricsLogger(run)
    for step in range(1, 101):
        loss = 3 + 5 * math.exp(-step / 30)
        row = {"kind": "train", "step": step, "tokens": 512 * step, "loss": loss, "lr": 1e-3}
        logger.write({**row, "grad_norm": 1.0, "tokens_per_s": 5000.0, "data_wait_share": 0.0})
        if step % 25 == 0:
            code = 4 + 0.01 * step if forgotten else loss + 0.2
            prose = loss - 1
            logger.write(
                {
                    "kind": "val",
                    "step": step,
                    "val_loss": (prose + code) / 2,
                    "val_bpb": (prose + code) / 2 / math.log(2) / 3,
                    "val_loss/prose": prose,
                    "val_bpb/prose": prose / math.log(2) / 4,
                    "val_loss/code.py": code,
                    "val_bpb/code.py": code / math.log(2) / 2,
                }
            )
    logger.close()
    return run


def test_report_tensorboard_and_plot_show_each_source(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from anneal.observe.plots import plot_run
    from anneal.observe.report import HEALTHY, PROBLEM, health

    run = _blend_run(tmp_path / "forgets", forgotten=True)
    signals = {s.name: s for s in health(run)}
    assert signals["val loss"].status == HEALTHY  # the total falls...
    assert signals["val loss code.py"].status == PROBLEM  # ...while code.py is forgotten
    assert "this source is being forgotten" in signals["val loss code.py"].detail
    assert signals["val loss prose"].status == HEALTHY
    assert "bits/byte" in signals["val loss prose"].detail
    healthy = {s.name: s.status for s in health(_blend_run(tmp_path / "fine", forgotten=False))}
    assert healthy["val loss code.py"] == HEALTHY

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"val/val_loss/prose", "val/val_bpb/code.py", "val/val_loss"} <= tags
    assert [e.value for e in acc.Scalars("val/val_loss/code.py")] == pytest.approx(
        [r["val_loss/code.py"] for r in _val_rows(run)]
    )

    paths = plot_run(run)
    assert [p.name for p in paths][-1] == "val_sources.png"
    assert paths[-1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[-1].stat().st_size > 5000


def _val_rows(run):
    from anneal.rundir import read_metrics

    return read_metrics(run, "val")


@pytest.mark.slow
def test_one_and_two_ranks_agree_per_source(blend, tmp_path):
    """Two real runs through the recipe (1 rank, then 2 with the same global batch): the
    per-source figures in metrics.jsonl and the train losses agree (this replaces
    test_validation.py's 1-and-2-rank run on one source), with 25 windows dealt 13 + 12 so
    that rank 1 evaluates a padding window (weight 0) in its last micro-batch. Measured: 57 s
    of CPU, 169 s wall on 2 cores shared by five workers."""
    from tests.conftest import read_metrics, run_recipe

    common = ["--data", str(blend["blend"]), "--max-steps", "2", "--val-every", "2"]
    common += ["--save-every", "0", *SMALL, "--set", f"model.seq_len={SEQ}"]
    common += ["--set", "train.val_samples=25", "--set", "ds.train_micro_batch_size_per_gpu=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_recipe(["--out", str(one), *common, "--set", "ds.gradient_accumulation_steps=2"])
    run_recipe(["--out", str(two), *common, "--set", "ds.gradient_accumulation_steps=1"], ranks=2)
    a, b = read_metrics(one, "val")[-1], read_metrics(two, "val")[-1]
    keys = [f"{m}/{s}" for m in ("val_loss", "val_bpb") for s in ("prose.txt", "code.txt")]
    assert set(keys) <= set(a) and set(a) == set(b)
    for key in ["val_loss", "val_bpb", *keys]:
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    t1, t2 = read_metrics(one, "train"), read_metrics(two, "train")
    assert [r["loss"] for r in t1] == pytest.approx([r["loss"] for r in t2], rel=1e-5)
    assert a["val_ppl"] == pytest.approx(math.exp(a["val_loss"]))


def test_the_console_line_names_each_source(tmp_path, capsys):
    from anneal.observe.metrics import MetricsLogger
    from anneal.train.observers import Metrics

    row = {"kind": "val", "step": 7, "val_loss": 1.0, "val_ppl": math.e, "val_bpb": 1.5}
    row |= {
        "val_loss/prose": 0.5,
        "val_bpb/prose": 1.0,
        "val_loss/code.py": 2,
        "val_bpb/code.py": 2.0,
    }
    observer = Metrics(MetricsLogger(tmp_path, tensorboard=False))
    observer.on_val(row)
    observer.close()
    out = capsys.readouterr().out.strip()
    assert out.endswith("| bpb 1.5000 (prose 1.0000, code.py 2.0000)"), out
