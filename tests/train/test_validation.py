"""Validation uses one fixed held-out set whatever the number of ranks (windows spread evenly
over the val split): the windows are dealt so that each is evaluated exactly once, and 1 rank
and 2 ranks that trained on the same global batches report the same val loss and bits per
byte (tests/train/test_validation_sources.py runs that, per source too). bpb is nats / ln 2 / UTF-8
bytes."""

import pytest

from anneal.data.stream import validation_windows


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
