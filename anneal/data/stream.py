"""The token stream: global sample index -> (x, y), independent of the number of ranks.

Sample i of the run is window ``perm_e[i mod n]`` of the packed split, where ``n`` is the
number of windows, ``e = i // n`` the epoch and ``perm_e`` a permutation seeded by (seed, e).
Rank r of W reads samples ``i = k*W + r``. The only state is the next global index, so resume
sets one integer: no replay, no skip, and any world size sees the same global sequence.
"""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path

import numpy as np
import torch


class PackedSplit:
    """Non-overlapping windows of ``seq_len + 1`` tokens over one split's shards."""

    def __init__(self, data_dir: Path, split: str, *, seq_len: int):
        data_dir = Path(data_dir)
        meta = json.loads((data_dir / "meta.json").read_text())
        self.seq_len = seq_len
        self.vocab_size = meta["vocab_size"]
        self._shards = []
        counts = []
        for shard in meta["splits"][split]["shards"]:
            if shard["tokens"] <= seq_len:
                continue
            self._shards.append(np.memmap(data_dir / split / shard["file"],
                                          dtype=meta["dtype"], mode="r"))
            counts.append((shard["tokens"] - 1) // seq_len)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.n_windows = int(self._starts[-1])
        if self.n_windows == 0:
            raise ValueError(f"{data_dir}/{split}: fewer than {seq_len + 1} tokens; prepare "
                             f"more data or use a shorter sequence length.")

    def window(self, j: int) -> np.ndarray:
        s = int(np.searchsorted(self._starts, j, side="right")) - 1
        off = (j - int(self._starts[s])) * self.seq_len
        return np.asarray(self._shards[s][off:off + self.seq_len + 1], dtype=np.int64)

    def batch(self, windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (B, T); y is x shifted by one token."""
        data = torch.from_numpy(np.stack([self.window(j) for j in windows]))
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class TokenStream:
    """This rank's micro-batches of the global sample sequence, prefetched in a thread."""

    def __init__(self, split: PackedSplit, *, seed: int, rank: int, world_size: int,
                 micro_batch: int, position: int = 0, prefetch: int = 4):
        self.split = split
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.micro_batch = micro_batch
        self.position = position
        """Global index of the next sample to be consumed by the whole job."""
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None
        self._prefetch = prefetch
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def window_of(self, i: int) -> int:
        """Window index of global sample ``i``."""
        n = self.split.n_windows
        epoch, k = divmod(i, n)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(n)
            self._perm_epoch = epoch
        return int(self._perm[k])

    def indices_at(self, position: int) -> list[int]:
        """Global sample indices of this rank's micro-batch starting at ``position``."""
        w, r = self.world_size, self.rank
        return [position + k * w + r for k in range(self.micro_batch)]

    def _make(self, position: int):
        return self.split.batch([self.window_of(i) for i in self.indices_at(position)])

    def _worker(self, position: int) -> None:
        stride = self.micro_batch * self.world_size
        while not self._stop.is_set():
            item = self._make(position)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            position += stride

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._prefetch <= 0:
            item = self._make(self.position)
        else:
            if self._thread is None:
                self._queue = queue.Queue(maxsize=self._prefetch)
                self._thread = threading.Thread(target=self._worker, args=(self.position,),
                                                daemon=True, name="anneal-prefetch")
                self._thread.start()
            item = self._queue.get()
        self.position += self.micro_batch * self.world_size
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed}


def validation_windows(n_windows: int, *, n_samples: int, rank: int, world_size: int,
                       micro_batch: int) -> list[list[int]]:
    """The fixed held-out set (the first ``n_samples`` windows of the val split, in order),
    dealt round-robin to ranks and cut into micro-batches. Every rank gets the same number of
    batches (ZeRO-3 forwards are collective); -1 marks padding that carries no weight."""
    n = min(n_samples, n_windows)
    mine = list(range(rank, n, world_size))
    per_rank = -(-n // world_size)
    batches = -(-per_rank // micro_batch)
    mine += [-1] * (batches * micro_batch - len(mine))
    return [mine[b * micro_batch:(b + 1) * micro_batch] for b in range(batches)]
