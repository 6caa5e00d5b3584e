"""The merge's copy (:mod:`anneal.data.merge`): the tasks' ids of one (split, source), in task
order, cut into shards of ``--shard-tokens`` exactly as one node cuts them, each shard written
and hashed by a thread of a pool, so that the copy runs at the disk's rate rather than one
core's sha256 rate (reads, writes and hashlib all release the GIL).

A task records a crc32 of every ``CRC_CHUNK`` bytes of its ids (part.json ``crc32``); a shard's
job reads the whole chunks its range overlaps and checks each against it before it writes and
hashes the bytes it needs, so a changed byte anywhere in a part is found while copying, with no
pass of its own. (A crc32 finds every error of a bit, every burst of up to 32 bits, and any
other change but one in 2**32: a bad copy or a disk error. Nobody who can rewrite a part is
kept out by a stronger hash, since part.json and the marker lie beside it.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CRC_CHUNK = 1 << 20
"""Bytes of a task's ids per crc32 in part.json, at most (less for shards smaller than it, so
that a shard's job reads little more than its own bytes)."""


def crc_chunk(shard_bytes: int) -> int:
    return max(1, min(CRC_CHUNK, shard_bytes))


def piece_crc32(path: Path, chunk_bytes: int) -> list[int]:
    """The crc32 of every ``chunk_bytes`` bytes of ``path`` (the last chunk may be shorter)."""
    crcs = []
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            crcs.append(zlib.crc32(chunk))
    return crcs


@dataclasses.dataclass(frozen=True)
class Range:
    """Bytes ``[start, end)`` of one task's ids file, and that file's chunk checksums."""

    path: Path
    start: int
    end: int
    crcs: tuple[int, ...]
    chunk: int
    """Bytes per crc32."""
    task: int


@dataclasses.dataclass(frozen=True)
class Shard:
    """One output shard: its file, tokens and the ranges of the tasks' files it is made of."""

    path: Path
    tokens: int
    ranges: tuple[Range, ...]


def cut(
    pieces: list[tuple[Path, int, list[int], int, int]],
    *,
    directory: Path,
    source: int,
    itemsize: int,
    shard_tokens: int,
    name: Callable[[int, int], str],
) -> list[Shard]:
    """The shards of one (split, source): ``pieces`` are (ids file, tokens, crc32s, bytes per
    crc32, task) in
    task order, their ids concatenated and cut every ``shard_tokens`` as one node's writer
    cuts them; ``name(source, index)`` names shard ``index``."""
    starts, total = [], 0
    for _, tokens, _, _, _ in pieces:
        starts.append(total)
        total += tokens
    shards = []
    for k, lo in enumerate(range(0, total, shard_tokens)):
        hi = min(lo + shard_tokens, total)
        ranges = tuple(
            Range(
                path, (max(lo, g) - g) * itemsize, (min(hi, g + n) - g) * itemsize, tuple(c), b, t
            )
            for (path, n, c, b, t), g in zip(pieces, starts, strict=True)
            if n and g < hi and lo < g + n
        )
        shards.append(Shard(directory / name(source, k), hi - lo, ranges))
    return shards


def write_shard(shard: Shard, tampered: Callable[[int, Path, str], Exception]) -> str:
    """Write ``shard`` from its ranges, checking every chunk read; returns its sha256."""
    h = hashlib.sha256()
    with open(shard.path, "wb") as out:
        for r in shard.ranges:
            with open(r.path, "rb") as f:
                first, last = r.start // r.chunk, -(-r.end // r.chunk)
                f.seek(first * r.chunk)
                for c in range(first, last):
                    chunk = f.read(r.chunk)
                    if c >= len(r.crcs) or zlib.crc32(chunk) != r.crcs[c]:
                        where = f"its bytes from {c * r.chunk:,} differ from the crc32 in part.json"
                        raise tampered(r.task, r.path, where)
                    lo = max(r.start - c * r.chunk, 0)
                    hi = min(r.end - c * r.chunk, len(chunk))
                    view = memoryview(chunk)[lo:hi]
                    out.write(view)
                    h.update(view)
    return h.hexdigest()


def write_all(shards: list[Shard], *, workers: int, tampered) -> list[str]:
    """Every shard's sha256, written by ``workers`` threads; the first error is raised once the
    jobs not yet started are dropped."""
    with ThreadPoolExecutor(max(1, workers)) as pool:
        futures = [pool.submit(write_shard, s, tampered) for s in shards]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
