"""The token stream reads one global sample sequence, whatever the number of ranks or restarts.

Proves: the keyed permutation is a permutation for any size; every window is read exactly once
per epoch and epochs are reshuffled; 1, 2 and 3 ranks read the same global sequence of samples
(and the same tensors); a run stopped at step k on 2 ranks and continued on 1 rank from the
saved state reads exactly the samples of the uninterrupted run (no replay, no skip); weighted
sources get their exact quota in every block and are each read without repetition within
their own epoch; prefetching changes nothing; the validation set is the same for any rank
count; the public names the trainer uses keep their shape; and an error while reading a batch
in the prefetch thread (a shard shorter than meta.json says) is raised by ``next_batch`` within
seconds, chained to the original, instead of leaving the caller waiting forever.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from anneal.data.stream import (
    BLEND_BLOCK,
    PackedSplit,
    TokenStream,
    blend_quotas,
    permute,
    validation_windows,
)
from anneal.errors import UserError

SEQ = 16


def write_split(root: Path, sources: dict[str, int], *, weights=None, shard_tokens=1000) -> Path:
    """A prepared-looking directory whose train ids are 0, 1, 2, ... (unique per position), so
    that a window's first id says which window it is."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "train").mkdir()
    shards, start = [], 0
    for s, n_tokens in enumerate(sources.values()):
        for k, a in enumerate(range(0, n_tokens, shard_tokens)):
            n = min(shard_tokens, n_tokens - a)
            name = f"{s:02d}_{k:05d}.bin"
            np.arange(start + a, start + a + n, dtype=np.uint32).tofile(root / "train" / name)
            shards.append({"file": name, "tokens": n, "source": s})
        start += n_tokens
    meta = {
        "vocab_size": start + 1,
        "dtype": "uint32",
        "tokenizer_sha256": "0" * 64,
        "blend": "weighted" if weights else "natural",
        "sources": [
            {"name": name, "weight": (weights[i] if weights else None)}
            for i, name in enumerate(sources)
        ],
        "splits": {"train": {"shards": shards}},
    }
    (root / "meta.json").write_text(json.dumps(meta))
    return root


@pytest.fixture()
def split(tmp_path) -> PackedSplit:
    # 3 shards of 1000 tokens and one of 337. Windows of 17 tokens start every 16 (the last
    # token of one is the first target of the next): 62 + 62 + 62 + 21.
    return PackedSplit(write_split(tmp_path / "d", {"web": 3337}), "train", seq_len=SEQ)


def first_ids(x: torch.Tensor) -> list[int]:
    return x[:, 0].tolist()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097, 65_537])
def test_permute_is_a_permutation(n):
    out = permute(np.arange(n), n, (7, 0, 3))
    assert sorted(out.tolist()) == list(range(n))
    assert (permute(np.arange(n), n, (7, 0, 3)) == out).all()  # deterministic
    if n >= 1000:
        assert not (out == np.arange(n)).all()
        assert (permute(np.arange(n), n, (7, 0, 4)) != out).mean() > 0.9  # another key
        # Well mixed: neighbours land far apart, positions are uncorrelated.
        assert abs(np.corrcoef(np.arange(n), out)[0, 1]) < 0.1


def test_windows_do_not_cross_shards(split):
    assert split.n_windows == 62 * 3 + 21
    x, y = split.batch([61, 62])
    assert first_ids(x) == [61 * SEQ, 1000]  # window 62 starts the second shard
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_every_window_once_per_epoch_and_epochs_reshuffle(split):
    n = split.n_windows
    stream = TokenStream(split, seed=3, rank=0, world_size=1, micro_batch=1, prefetch=0)
    epochs = [stream.windows_of(np.arange(e * n, (e + 1) * n)) for e in range(3)]
    for windows in epochs:
        assert sorted(windows.tolist()) == list(range(n))
    assert not (epochs[0] == epochs[1]).all() and not (epochs[1] == epochs[2]).all()
    other_seed = TokenStream(split, seed=4, rank=0, world_size=1, micro_batch=1, prefetch=0)
    assert not (other_seed.windows_of(np.arange(n)) == epochs[0]).all()


def _global_sequence(
    split, *, world_size: int, micro_batch: int, steps: int, position=0, prefetch=2
) -> list[int]:
    """Samples read by all ranks, put back in global order (rank r's k-th sample of a
    micro-batch at position p is global sample p + k*W + r)."""
    streams = [
        TokenStream(
            split,
            seed=11,
            rank=r,
            world_size=world_size,
            micro_batch=micro_batch,
            position=position,
            prefetch=prefetch,
        )
        for r in range(world_size)
    ]
    out = []
    for _ in range(steps):
        batches = [first_ids(s.next_batch()[0]) for s in streams]
        for k in range(micro_batch):
            out += [batches[r][k] for r in range(world_size)]
    assert len({s.position for s in streams}) == 1
    for s in streams:
        s.close()
    return out


def test_one_two_and_three_ranks_read_the_same_global_sequence(split):
    # 6 samples per micro-step in all: micro 6 x 1 rank, 3 x 2 ranks, 2 x 3 ranks. 100 steps
    # cover almost three epochs of 207 windows.
    one = _global_sequence(split, world_size=1, micro_batch=6, steps=100)
    assert one == _global_sequence(split, world_size=2, micro_batch=3, steps=100)
    assert one == _global_sequence(split, world_size=3, micro_batch=2, steps=100)
    reference = TokenStream(split, seed=11, rank=0, world_size=1, micro_batch=1, prefetch=0)
    assert one == [w * SEQ + _offset(split, w) for w in reference.windows_of(np.arange(600))]


def _offset(split: PackedSplit, window: int) -> int:
    """First id of a window minus window*SEQ (each shard restarts the window grid)."""
    return int(split.window(window)[0]) - window * SEQ


def test_resume_on_fewer_ranks_sees_exactly_the_uninterrupted_samples(split):
    """Global batch 8: 2 ranks x micro 2 x accumulation 2, then 1 rank x micro 4 x 2."""
    steps, k = 40, 13
    uninterrupted = _global_sequence(split, world_size=1, micro_batch=4, steps=2 * steps)

    ranks = [TokenStream(split, seed=11, rank=r, world_size=2, micro_batch=2) for r in (0, 1)]
    before = []
    for _ in range(2 * k):  # k optimizer steps of 2 micro-steps
        batches = [first_ids(s.next_batch()[0]) for s in ranks]
        before += [batches[r][j] for j in range(2) for r in range(2)]
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()
    for s in ranks:
        s.close()
    state = json.loads(json.dumps(state))  # as it is stored in a checkpoint
    assert state["position"] == k * 8

    resumed = TokenStream(
        split, seed=state["seed"], rank=0, world_size=1, micro_batch=4, position=state["position"]
    )
    after = []
    for _ in range(2 * (steps - k)):
        after += first_ids(resumed.next_batch()[0])
    resumed.close()
    assert before + after == uninterrupted
    assert len(before + after) == 8 * steps


def test_prefetch_changes_nothing(split):
    a = TokenStream(split, seed=5, rank=1, world_size=2, micro_batch=3, position=30, prefetch=0)
    b = TokenStream(split, seed=5, rank=1, world_size=2, micro_batch=3, position=30, prefetch=3)
    for _ in range(50):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.state_dict() == b.state_dict()  # position counts consumed, not prefetched
    b.close()


def test_blend_quotas_are_exact_and_sum_to_the_block():
    q = blend_quotas([0.7, 0.3])
    assert q.tolist() == [2867, 1229] and q.sum() == BLEND_BLOCK
    q = blend_quotas([1, 1, 1])
    assert q.tolist() == [1366, 1365, 1365]
    with pytest.raises(UserError, match="below one sample"):
        blend_quotas([1.0, 1e-6])


def test_weighted_sources_get_their_quota_and_each_its_own_epochs(tmp_path):
    root = write_split(tmp_path / "w", {"web": 5000, "code": 700}, weights=[0.7, 0.3])
    split = PackedSplit(root, "train", seq_len=SEQ)
    (f0, n0), (f1, n1) = split.source_windows
    assert (f0, f1) == (0, n0) and n0 + n1 == split.n_windows
    stream = TokenStream(split, seed=2, rank=0, world_size=1, micro_batch=1, prefetch=0)
    windows = stream.windows_of(np.arange(2 * BLEND_BLOCK))
    is_code = windows >= f1
    for b in range(2):
        block = is_code[b * BLEND_BLOCK : (b + 1) * BLEND_BLOCK]
        assert int(block.sum()) == 1229  # exactly 30% in every block
    # Each source's samples, in order, run through its windows once per source epoch.
    code = windows[is_code] - f1
    for e in range(len(code) // n1):
        assert sorted(code[e * n1 : (e + 1) * n1].tolist()) == list(range(n1))
    web = windows[~is_code]
    assert sorted(web[:n0].tolist()) == list(range(n0))
    # World-size independence holds for blends too.
    two = [TokenStream(split, seed=2, rank=r, world_size=2, micro_batch=4) for r in (0, 1)]
    seq = []
    for _ in range(20):
        xs = [first_ids(s.next_batch()[0]) for s in two]
        seq += [xs[r][k] for k in range(4) for r in range(2)]
    assert seq == [w * SEQ + _offset(split, w) for w in windows[:160]]
    for s in two:
        s.close()


def test_validation_set_is_the_same_for_any_rank_count():
    sets = []
    for world in (1, 2, 3, 4):
        per_rank = [
            validation_windows(100, n_samples=10, rank=r, world_size=world, micro_batch=2)
            for r in range(world)
        ]
        assert len({len(b) for b in per_rank}) == 1  # same number of batches on every rank
        sets.append(sorted(j for b in per_rank for mb in b for j in mb if j >= 0))
    assert all(s == sets[0] for s in sets)
    assert sets[0] == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90]  # spread over the split


def test_too_short_split_is_a_clear_error(tmp_path):
    root = write_split(tmp_path / "s", {"web": 10})
    with pytest.raises(UserError, match="fewer than 17 tokens"):
        PackedSplit(root, "train", seq_len=SEQ)


def _drain(stream: TokenStream, batches: int, timeout_s: float) -> BaseException | None:
    """Call ``next_batch`` up to ``batches`` times in a helper thread; the error it raised, or
    None. Fails the test (instead of hanging it) when the calls do not end in ``timeout_s``."""
    outcome: list = []

    def consume():
        try:
            for _ in range(batches):
                stream.next_batch()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert outcome, f"next_batch still waiting after {timeout_s} s: the stream hangs"
    return outcome[0]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_shard_shorter_than_its_meta_raises_in_next_batch_instead_of_hanging(tmp_path, prefetch):
    """A shard cut short on disk (meta.json still lists its full length): the windows past its
    end come out short, and stacking them fails in the prefetch thread. That error reaches the
    caller of next_batch, chained to the original, within seconds."""
    root = write_split(tmp_path / "d", {"web": 3337})
    shard = root / "train" / "00_00000.bin"
    shard.write_bytes(shard.read_bytes()[: 400 * 4])  # 400 of its 1000 uint32 ids
    split = PackedSplit(root, "train", seq_len=SEQ)
    stream = TokenStream(split, seed=0, rank=0, world_size=1, micro_batch=8, prefetch=prefetch)
    error = _drain(stream, batches=10 * split.n_windows // 8, timeout_s=60)
    stream.close()
    assert isinstance(error, RuntimeError if prefetch else ValueError), error
    if prefetch:
        assert "prefetch thread" in str(error) and isinstance(error.__cause__, ValueError)
        assert error.__cause__.__traceback__ is not None
        # The stream stays failed: a second call raises too, and does not wait.
        assert isinstance(_drain(stream, batches=1, timeout_s=10), RuntimeError)
