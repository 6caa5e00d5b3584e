"""The merge's copy (:mod:`anneal.data.merge`): the tasks' ids of one (split, source), in task
order, cut into shards of ``--shard-tokens`` exactly as one node cuts them, each shard written
and hashed by a thread of a pool, so that the copy runs at the disk's rate rather than one
core's sha256 rate (reads, writes and hashlib all release the GIL).

A task records an xxh3-128 of every ``CHECK_CHUNK`` bytes of its ids (part.json ``xxh3_128``);
a shard's job reads the whole chunks its range overlaps and checks each against it before it
writes and hashes the bytes it needs, so a changed byte anywhere in a part is found while
copying, with no pass of its own. (xxh3-128 misses a change, any change, once in 2**128: a bad
copy or a disk error; it runs at about 10 GB/s per core, against crc32's 2 GB/s, so the
merge's CPU goes to the sha256 that meta.json records. Nobody who can rewrite a part is kept
out by a cryptographic hash, since part.json and the marker lie beside it.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

CHECK_CHUNK = 1 << 20
"""Bytes of a task's ids per xxh3-128 in part.json, at most (less for shards smaller than it, so
that a shard's job reads little more than its own bytes)."""


def check_chunk(shard_bytes: int) -> int:
    return max(1, min(CHECK_CHUNK, shard_bytes))


def piece_hashes(path: Path, chunk_bytes: int) -> list[str]:
    """The xxh3-128 (hex) of every ``chunk_bytes`` bytes of ``path`` (the last may be shorter)."""
    hashes = []
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            hashes.append(xxhash.xxh3_128_hexdigest(chunk))
    return hashes


@dataclasses.dataclass(frozen=True)
class Range:
    """Bytes ``[start, end)`` of one task's ids file, and that file's chunk hashes."""

    path: Path
    start: int
    end: int
    hashes: tuple[str, ...]
    chunk: int
    """Bytes per xxh3-128."""
    task: int


@dataclasses.dataclass(frozen=True)
class Shard:
    """One output shard: its file, tokens and the ranges of the tasks' files it is made of."""

    path: Path
    tokens: int
    ranges: tuple[Range, ...]


def cut(
    pieces: list[tuple[Path, int, list[str], int, int]],
    *,
    directory: Path,
    source: int,
    itemsize: int,
    shard_tokens: int,
    name: Callable[[int, int], str],
) -> list[Shard]:
    """The shards of one (split, source): ``pieces`` are (ids file, tokens, xxh3-128s, bytes
    per hash, task) in task order, their ids concatenated and cut every ``shard_tokens`` as
    one node's writer cuts them; ``name(source, index)`` names shard ``index``."""
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
    """Write ``shard`` from its ranges, checking every chunk read; returns its sha256.

    Each read fills a reused buffer of whole chunks (up to ``READ_BYTES``) with ``readinto``;
    the bytes are checked, hashed and written from that buffer through memoryviews, so what is
    written and hashed is exactly what was checked, with no copy between."""
    h = hashlib.sha256()
    buf = _buffer(max((r.chunk for r in shard.ranges), default=1))
    with open(shard.path, "wb", buffering=0) as out:
        for r in shard.ranges:
            per_read = max(1, len(buf) // r.chunk) * r.chunk
            with open(r.path, "rb", buffering=0) as f:
                at, end = r.start // r.chunk * r.chunk, -(-r.end // r.chunk) * r.chunk
                _advise(f, at, end - at)
                f.seek(at)
                while at < r.end:
                    got = _read_full(f, memoryview(buf)[: min(per_read, end - at)])
                    view = memoryview(buf)[:got]
                    for lo in range(0, got, r.chunk):
                        c = (at + lo) // r.chunk
                        got_hash = xxhash.xxh3_128_hexdigest(view[lo : lo + r.chunk])
                        if c >= len(r.hashes) or got_hash != r.hashes[c]:
                            raise tampered(r.task, r.path, _differs(c * r.chunk))
                    piece = view[max(r.start - at, 0) : min(r.end - at, got)]
                    h.update(piece)
                    _write_full(out, piece)
                    at += got
                    if not got:
                        raise tampered(r.task, r.path, f"it ends at {at:,} bytes, before {r.end:,}")
    return h.hexdigest()


def _differs(offset: int) -> str:
    return f"its bytes from {offset:,} differ from the xxh3-128 in part.json"


READ_BYTES = 1 << 20
"""Bytes read at a time per thread (whole chunks of ``CHECK_CHUNK``): a buffer that stays in
the core's cache while it is checked, hashed and written (measured on 2 cores: about 10%
faster than 8 MiB, whose bytes are fetched from memory three times)."""

_local = threading.local()


def _buffer(chunk: int) -> bytearray:
    """This thread's read buffer: ``READ_BYTES``, or one chunk when a chunk is larger."""
    size = max(READ_BYTES, chunk)
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < size:
        buf = _local.buf = bytearray(size)
    return buf


def _advise(f, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), offset, length, os.POSIX_FADV_SEQUENTIAL)


def _read_full(f, view: memoryview) -> int:
    """Fill ``view`` from ``f`` up to its end; the bytes read (fewer only at the file's end)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _write_full(out, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += out.write(view[done:])


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
