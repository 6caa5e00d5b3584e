"""The token stream: global sample index -> (x, y), independent of the number of ranks.

A split is cut into non-overlapping windows of ``seq_len + 1`` tokens (within each shard).
Sample i of the run is a window chosen by a pure function of (seed, i):

- one source, or several blended by size (no weights given): ``e, k = divmod(i, n)`` and the
  window is ``perm(k)`` where ``perm`` is a seeded permutation of the ``n`` windows, drawn
  afresh for each epoch ``e``;
- sources blended with weights: samples come in blocks of 4096 in which source s has exactly
  its quota (its weight's share, rounded by largest remainder) in a seeded order; the j-th
  sample of source s is window ``perm_{s,e}(j mod n_s)`` of that source, ``e = j // n_s``, so
  each source is read without repetition within its own epoch.

Data-parallel rank r of W reads samples ``i = k*W + r``. W counts model replicas, not
processes: under tensor parallelism the ranks of one group hold one replica and read the same
samples (the trainer passes the index DeepSpeed's data-parallel process group gives it; this
module never looks at ranks itself). The only state is the next global index, so resume sets one
integer: no replay, no skip, and any number of replicas sees the same global sequence; with the
same global batch each optimizer step consumes the same samples. The permutation is a
keyed Feistel network (no table): O(1) memory and time per sample for any number of windows.
"""

from __future__ import annotations

import functools
import queue
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from anneal.data.prepared_dir import PreparedDir
from anneal.errors import UserError

BLEND_BLOCK = 4096  # samples per block in which weighted sources get exact quotas
_M64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=1024)
def _round_keys(key: tuple[int, ...]) -> np.ndarray:
    seed = [int(x) % (1 << 64) for x in key]  # SeedSequence takes non-negative integers
    return np.random.default_rng(seed).integers(0, _M64, size=4, dtype=np.uint64, endpoint=True)


def permute(k: np.ndarray, n: int, key: tuple[int, ...]) -> np.ndarray:
    """``perm(k)`` for a keyed pseudo-random permutation ``perm`` of ``range(n)``: a 4-round
    Feistel network on the smallest even power of two >= n, with cycle walking to stay in
    range. Deterministic in (n, key); vectorised over ``k``."""
    k = np.asarray(k, dtype=np.uint64)
    if n <= 1:
        return np.zeros_like(k, dtype=np.int64)
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    round_keys = _round_keys((*key, n))

    def feistel(x):
        left, right = x >> half, x & mask
        for rk in round_keys:
            left, right = right, left ^ (_mix64(right ^ rk) & mask)
        return (left << half) | right

    out = feistel(k)
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = feistel(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


def blend_quotas(weights: list[float], block: int = BLEND_BLOCK) -> np.ndarray:
    """Samples per block for each source: ``weights`` normalised, times ``block``, rounded by
    largest remainder (ties to the earlier source) so that they sum to ``block``."""
    w = np.asarray(weights, dtype=np.float64)
    raw = w / w.sum() * block
    quotas = np.floor(raw).astype(np.int64)
    order = sorted(range(len(w)), key=lambda s: (-(raw[s] - quotas[s]), s))
    for s in order[: block - int(quotas.sum())]:
        quotas[s] += 1
    if (quotas == 0).any():
        s = int(np.argmin(quotas))
        raise UserError(
            f"source {s} has weight {w[s]:g} of {w.sum():g}: below one sample in "
            f"{block}. Raise its weight or leave the source out."
        )
    return quotas


class PackedSplit:
    """Non-overlapping windows of ``seq_len + 1`` tokens over one split's shards, numbered
    source by source (each source's windows are one contiguous range)."""

    def __init__(self, data_dir: Path, split: str, *, seq_len: int):
        prepared = PreparedDir(data_dir)
        meta = prepared.meta(splits=(split,))  # checked: types, counts, file names
        self.data_dir = data_dir = prepared.path
        self.seq_len = seq_len
        self.vocab_size = meta["vocab_size"]
        self.tokenizer_sha256 = meta.get("tokenizer_sha256")
        sources = meta.get("sources") or [{"name": "data", "weight": None}]
        self.source_names = [s["name"] for s in sources]
        weighted = meta.get("blend") == "weighted"
        self.weights = [float(s["weight"]) for s in sources] if weighted else None
        """Blend weights per source, or None: blend by size (one permutation of all)."""
        self._shards = []
        self._paths: list[Path] = []
        counts = []
        per_source = [0] * len(sources)
        for shard in meta["splits"][split]["shards"]:
            if shard["tokens"] <= seq_len:
                continue
            path = prepared.shard_path(split, shard)
            self._shards.append(np.memmap(path, dtype=meta["dtype"], mode="r"))
            self._paths.append(path)
            n = (shard["tokens"] - 1) // seq_len
            counts.append(n)
            per_source[shard.get("source", 0)] += n
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.n_windows = int(self._starts[-1])
        firsts = np.concatenate([[0], np.cumsum(per_source)[:-1]]).astype(np.int64)
        self.source_windows = [(int(f), int(n)) for f, n in zip(firsts, per_source, strict=True)]
        """(first window, number of windows) of each source."""
        if self.n_windows == 0:
            raise UserError(
                f"{data_dir}/{split}: fewer than {seq_len + 1} tokens in every shard; prepare "
                f"more data or use a shorter sequence length (model.seq_len)."
            )

    def window(self, j: int) -> np.ndarray:
        s = int(np.searchsorted(self._starts, j, side="right")) - 1
        off = (j - int(self._starts[s])) * self.seq_len
        ids = np.asarray(self._shards[s][off : off + self.seq_len + 1], dtype=np.int64)
        if ids.size and int(ids.max()) >= self.vocab_size:  # one pass over seq_len ids: cheap
            raise self._damaged(s, off, int(ids.max()))
        return ids

    def source_of(self, windows: list[int]) -> np.ndarray:
        """The source index of each window number (empty sources own no number)."""
        firsts = [first for first, _ in self.source_windows]
        return np.searchsorted(firsts, np.asarray(windows), side="right") - 1

    def _damaged(self, s: int, offset: int, token: int) -> UserError:
        """Ids beyond the vocabulary: bytes of the shard changed after prepare (its size did
        not, or check_prepared would have refused the directory). Only the rank that read the
        window sees it, so ``every_rank`` stays False and the message names the rank."""
        return UserError(
            f"{self._paths[s]}: holds token id {token} near id offset {offset}, but the "
            f"vocabulary has {self.vocab_size:,} ids (meta.json): the shard is damaged (its "
            f"bytes changed after it was prepared). Run `anneal data verify {self.data_dir}` "
            f"to list every damaged file, then prepare the data again (`anneal data prepare "
            f"--input ... --out {self.data_dir} --force`) or restore it from a copy."
        )

    def batch(self, windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (B, T); y is x shifted by one token."""
        data = torch.from_numpy(np.stack([self.window(j) for j in windows]))
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class TokenStream:
    """This replica's micro-batches of the global sample sequence, prefetched in a thread.

    ``rank`` / ``world_size``: the data-parallel index of this process and the number of
    data-parallel replicas (with tensor parallelism, world / TP: every rank of a TP group gets
    the same index and so the same batches)."""

    def __init__(
        self,
        split: PackedSplit,
        *,
        seed: int,
        rank: int,
        world_size: int,
        micro_batch: int,
        position: int = 0,
        prefetch: int = 4,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}.")
        self.split = split
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.micro_batch = micro_batch
        self.position = position
        """Global index of the next sample to be consumed by the whole job."""
        self._quotas = None
        if split.weights is not None:
            self._quotas = blend_quotas(split.weights)
            empty = [
                split.source_names[s] for s, (_, n) in enumerate(split.source_windows) if n == 0
            ]
            if empty:
                raise UserError(
                    f"source(s) {', '.join(empty)} have weight but no window of "
                    f"{split.seq_len + 1} tokens in this split; prepare more of their data, "
                    f"or a shorter sequence length."
                )
        self._block: tuple | None = None
        self._prefetch = prefetch
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def windows_of(self, indices) -> np.ndarray:
        """Window index of each global sample index."""
        i = np.asarray(indices, dtype=np.int64)
        if self._quotas is None:
            epoch, k = np.divmod(i, self.split.n_windows)
            out = np.empty_like(i)
            for e in np.unique(epoch):
                sel = epoch == e
                out[sel] = permute(k[sel], self.split.n_windows, (self.seed, 0, int(e)))
            return out
        out = np.empty_like(i)
        for n, idx in enumerate(i.ravel()):
            out.flat[n] = self._blended_window(int(idx))
        return out

    def _block_layout(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Source of each slot of block ``b`` and the slot's rank among its source's slots."""
        if self._block is None or self._block[0] != b:
            slots = np.repeat(np.arange(len(self._quotas)), self._quotas)
            order = slots[permute(np.arange(BLEND_BLOCK), BLEND_BLOCK, (self.seed, 1, b))]
            rank = np.empty(BLEND_BLOCK, dtype=np.int64)
            for s in range(len(self._quotas)):
                where = np.flatnonzero(order == s)
                rank[where] = np.arange(len(where))
            self._block = (b, order, rank)
        return self._block[1], self._block[2]

    def _blended_window(self, i: int) -> int:
        b, j = divmod(i, BLEND_BLOCK)
        order, rank = self._block_layout(b)
        s = int(order[j])
        first, n = self.split.source_windows[s]
        epoch, k = divmod(b * int(self._quotas[s]) + int(rank[j]), n)
        return first + int(permute([k], n, (self.seed, 2, s, epoch))[0])

    def indices_at(self, position: int) -> list[int]:
        """Global sample indices of this rank's micro-batch starting at ``position``."""
        w, r = self.world_size, self.rank
        return [position + k * w + r for k in range(self.micro_batch)]

    def _make(self, position: int):
        return self.split.batch(self.windows_of(self.indices_at(position)).tolist())

    def _worker(self, position: int) -> None:
        """Fills the queue until stopped. An exception ends the thread after handing itself to
        the consumer (as a :class:`_Failed` item), which raises it from :meth:`next_batch`."""
        stride = self.micro_batch * self.world_size
        while not self._stop.is_set():
            try:
                item = self._make(position)
            except BaseException as e:  # noqa: BLE001 - raised again in the consumer thread
                item = _Failed(e, position)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failed):
                return
            position += stride

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch (x, y). An error while reading it, here or in the prefetch
        thread, is raised here (chained to the original, with its traceback)."""
        if self._prefetch <= 0:
            item = self._make(self.position)
        else:
            if self._thread is None:
                self._queue = queue.Queue(maxsize=self._prefetch)
                self._thread = threading.Thread(
                    target=self._worker, args=(self.position,), daemon=True, name="anneal-prefetch"
                )
                self._thread.start()
            item = self._next_prefetched()
        self.position += self.micro_batch * self.world_size
        return item

    def _next_prefetched(self):
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    # Only reachable if the thread ended without handing over a _Failed item.
                    raise RuntimeError("the prefetch thread of the token stream ended") from None
        if isinstance(item, _Failed):
            self._queue.put(item)  # every later call fails the same way
            if isinstance(item.error, UserError):  # damaged data: the entry point reports it
                raise item.error
            raise RuntimeError(
                f"reading the micro-batch at global sample {item.position} failed in the "
                f"prefetch thread: {type(item.error).__name__}: {item.error}"
            ) from item.error
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def state_dict(self) -> dict:
        """``position`` is all that resume needs; the rest identifies the data it indexes."""
        return {
            "position": self.position,
            "seed": self.seed,
            "n_windows": self.split.n_windows,
            "tokenizer_sha256": self.split.tokenizer_sha256,
        }


class _Failed(NamedTuple):
    """What the prefetch thread queues instead of a batch when reading it raised."""

    error: BaseException
    position: int


def heldout_counts(sizes: list[int], n_samples: int) -> list[int]:
    """Held-out windows per source: ``n_samples`` (at most all windows) shared in proportion to
    the sources' window counts ``sizes``, by largest remainder (ties to the earlier source), then
    at least one for every source that has a window. So the total is ``min(n_samples, sum)``
    (plus one for each source too small for its share to round up to a window)."""
    total = sum(sizes)
    n = min(n_samples, total)
    if n <= 0:
        return [0] * len(sizes)
    counts = [n * size // total for size in sizes]
    order = sorted(range(len(sizes)), key=lambda s: (-(n * sizes[s] % total), s))
    for s in order[: n - sum(counts)]:
        counts[s] += 1
    return [min(size, max(k, 1 if size else 0)) for k, size in zip(counts, sizes, strict=True)]


def heldout_windows(sources: list[tuple[int, int]], n_samples: int) -> list[int]:
    """The fixed held-out set, stratified by source: source s, windows ``[first, first + n)``,
    gives ``k = heldout_counts(...)[s]`` windows spread evenly over its own range,
    ``first + t * n // k``. With one source this is ``t * n // n_samples``; a source prepared
    alone and evaluated with ``n_samples = k`` gives the same windows of its own."""
    counts = heldout_counts([n for _, n in sources], n_samples)
    return [
        first + t * n // k for (first, n), k in zip(sources, counts, strict=True) for t in range(k)
    ]


def validation_windows(
    n_windows: int,
    *,
    n_samples: int,
    rank: int,
    world_size: int,
    micro_batch: int,
    sources: list[tuple[int, int]] | None = None,
) -> list[list[int]]:
    """The held-out set (:func:`heldout_windows` of ``sources``, (first, n) per source; default
    one source of ``n_windows``), dealt round-robin to ranks and cut into micro-batches. Every
    rank gets the same number of batches (ZeRO-3 forwards are collective); -1 marks padding that
    carries no weight."""
    chosen = heldout_windows(sources or [(0, n_windows)], n_samples)
    mine = chosen[rank::world_size]
    per_rank = -(-len(chosen) // world_size)
    batches = -(-per_rank // micro_batch)
    mine += [-1] * (batches * micro_batch - len(mine))
    return [mine[b * micro_batch : (b + 1) * micro_batch] for b in range(batches)]
