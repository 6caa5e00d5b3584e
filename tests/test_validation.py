"""Validation uses one fixed held-out set whatever the number of ranks (windows spread evenly
over the val split): the windows are dealt so that each is evaluated exactly once, and 1 rank
and 2 ranks that trained on the same global batches report the same val loss and bits per
byte. bpb is nats / ln 2 / UTF-8 bytes."""

import json
import math

import pytest

from anneal.data.stream import validation_windows
from tests.conftest import SMALL, read_metrics, run_recipe


@pytest.mark.parametrize("n,world,micro", [(64, 1, 4), (64, 2, 4), (10, 3, 4), (5, 2, 8)])
def test_windows_cover_the_set_once_with_equal_batch_counts(n, world, micro):
    per_rank = [
        validation_windows(1000, n_samples=n, rank=r, world_size=world, micro_batch=micro)
        for r in range(world)
    ]
    assert len({len(b) for b in per_rank}) == 1  # ZeRO-3 forwards are collective
    seen = [j for batches in per_rank for batch in batches for j in batch if j >= 0]
    spread = [t * 1000 // n for t in range(n)]  # evenly over the split, the same at any world
    assert sorted(seen) == spread
    assert all(len(batch) == micro for batches in per_rank for batch in batches)


@pytest.mark.slow
def test_one_and_two_ranks_agree(stdlib_data, tmp_path):
    common = [
        "--data",
        str(stdlib_data),
        "--max-steps",
        "2",
        "--eval-every",
        "2",
        "--save-every",
        "0",
        *SMALL,
        "--set",
        "train.eval_samples=20",
        "--set",
        "ds.train_micro_batch_size_per_gpu=2",
    ]
    run_recipe(
        ["--out", str(tmp_path / "one"), *common, "--set", "ds.gradient_accumulation_steps=2"]
    )
    run_recipe(
        ["--out", str(tmp_path / "two"), *common, "--set", "ds.gradient_accumulation_steps=1"],
        ranks=2,
    )
    one, two = read_metrics(tmp_path / "one", "val")[-1], read_metrics(tmp_path / "two", "val")[-1]
    assert one["val_loss"] == pytest.approx(two["val_loss"], rel=1e-5)
    assert one["val_bpb"] == pytest.approx(two["val_bpb"], rel=1e-5)
    t1, t2 = read_metrics(tmp_path / "one", "train"), read_metrics(tmp_path / "two", "train")
    assert [r["loss"] for r in t1] == pytest.approx([r["loss"] for r in t2], rel=1e-5)
    assert one["val_ppl"] == pytest.approx(math.exp(one["val_loss"]))
    # bpb = loss per token in bits x tokens per byte of the evaluated windows
    meta = json.loads((stdlib_data / "meta.json").read_text())
    ratio = meta["splits"]["val"]["tokens"] / meta["splits"]["val"]["bytes"]
    assert one["val_bpb"] == pytest.approx(one["val_loss"] / math.log(2) * ratio, rel=0.15)
