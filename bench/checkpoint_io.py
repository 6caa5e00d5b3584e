"""Part 1 of the checkpoint benchmark, in this process: a real engine's checkpoint saved and
loaded (``anneal.resilience.checkpoint``) against a plain sequential write and read of the same
number of bytes on the same disk, in alternating order, each save after ``os.sync()`` and each
read from a cold page cache (``posix_fadvise`` DONTNEED). Then, as a resume at another layout
does it: the checkpoint converted to DeepSpeed's universal format
(``anneal.resilience.universal.to_universal``, from a cold cache) and loaded from there, against
the native load just timed.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from anneal.files import fsync_path  # noqa: E402

CHUNK = 32 << 20
SEQ_LEN = 64
"""The sequence length of both parts (part 2's recipe runs take it through --set)."""
TIMES = (
    "save_s",
    "save_durable_s",
    "write_s",
    "write_durable_s",
    "verify_s",
    "load_s",
    "read_s",
    "convert_s",
    "universal_load_s",
)
"""What each repeat times, in seconds."""


def fsync_tree(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        fsync_path(p)


def drop_cache(path: Path) -> None:
    """Evict a file's (or a tree's) clean pages, so the next read comes from the disk."""
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def watch_size(path: Path, peak: list[int], stop: threading.Event) -> None:
    """``peak[0]``: the largest size of the tree at ``path`` seen every 50 ms until ``stop``
    (the converter's temporary fragments come and go within its run)."""
    while not stop.wait(0.05):
        try:
            peak[0] = max(peak[0], tree_bytes(path))
        except FileNotFoundError:  # a file removed between the listing and its stat
            pass


def plain_write(path: Path, n_bytes: int) -> tuple[float, float]:
    """Seconds to write ``n_bytes`` (random, 32 MiB chunks) and to have them fsync'd."""
    buf = memoryview(os.urandom(CHUNK))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = n_bytes
        while left:
            left -= f.write(buf[: min(CHUNK, left)])
        f.flush()
        written = time.perf_counter() - t0
        os.fsync(f.fileno())
    return written, time.perf_counter() - t0


def plain_read(path: Path) -> float:
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def engine_after_one_step(args, work: Path):
    """A ZeRO-3 fp32 engine of ``args.preset`` on one rank (cpu.json) after one optimizer step,
    so that its checkpoint holds the optimizer state; and the seconds its build took."""
    from anneal.config.run import DataConfig, ModelConfig, RunConfig, TrainConfig
    from anneal.data.stream import PackedSplit, TokenStream
    from anneal.dist import single_process_env
    from anneal.train import build_engine, next_token_loss, resolve_run, setup_process

    cfg = RunConfig(
        out=str(work / "run"),
        ds_config="cpu.json",
        resume="none",
        model=ModelConfig(preset=args.preset, seq_len=SEQ_LEN),
        data=DataConfig(path=args.data),
        train=TrainConfig(max_steps=10, val_samples=0),
    )
    single_process_env()
    setup_process()
    plan = resolve_run(cfg, ["ds.gradient_accumulation_steps=1"])
    t0 = time.perf_counter()
    engine = build_engine(plan)
    build_s = time.perf_counter() - t0
    stream = TokenStream(
        PackedSplit(Path(args.data), "train", seq_len=SEQ_LEN),
        seed=1,
        rank=0,
        world_size=1,
        micro_batch=plan.micro_batch,
        prefetch=0,
    )
    x, y = stream.next_batch()
    engine.backward(next_token_loss(engine(input_ids=x).logits, y))
    engine.step()  # the optimizer state exists from here on
    return engine, build_s


def io_part(args, work: Path) -> dict:
    engine, build_s = engine_after_one_step(args, work)
    r = {k: [] for k in TIMES}
    n_bytes = 0
    for i in range(args.repeats):
        n_bytes = one_repeat(engine, work, i, r, n_bytes)
    return {
        "bytes": n_bytes,
        "build_s": build_s,
        **{k: r.pop(k) for k in ("universal_bytes", "universal_peak_bytes")},
        **r,
    }


def one_repeat(engine, work: Path, i: int, r: dict, n_bytes: int) -> int:
    """Repeat ``i``: save and plain write, then load and plain read, each pair in alternating
    order; the times appended to ``r``. The plain write takes ``n_bytes``, the checkpoint's size
    (repeat 0's when it goes first); returns this repeat's checkpoint size."""
    from anneal.resilience import checkpoint, safeload, universal

    ckpt, plain = work / f"ckpt{i}", work / f"plain{i}.bin"
    ckpt.mkdir()

    def save():
        nonlocal n_bytes
        os.sync()
        t0 = time.perf_counter()
        client = {"step": 1, "tokens": 0, "data": {}}
        tag_dir = checkpoint.save(engine, ckpt, step=1, keep_last=3, client_state=client)
        r["save_s"].append(time.perf_counter() - t0)
        fsync_tree(ckpt)
        r["save_durable_s"].append(time.perf_counter() - t0)
        n_bytes = tree_bytes(ckpt)
        return tag_dir

    def write():
        os.sync()
        written, durable = plain_write(plain, n_bytes)
        r["write_s"].append(written)
        r["write_durable_s"].append(durable)

    def load(tag_dir):
        t0 = time.perf_counter()
        assert checkpoint.verified_resume(tag_dir, fallback=False) == tag_dir
        t1 = time.perf_counter()
        checkpoint.load(engine, tag_dir, ckpt_dir=ckpt)
        r["verify_s"].append(t1 - t0)
        r["load_s"].append(time.perf_counter() - t1)

    if i % 2 == 0:  # alternate the order: neither side always goes first
        tag_dir = save()
        write()
    else:  # the same size as repeat 0's, checked below
        write()
        tag_dir = save()
    assert tree_bytes(ckpt) == plain.stat().st_size
    drop_cache(ckpt)
    drop_cache(plain)
    if i % 2 == 0:
        load(tag_dir)
        r["read_s"].append(plain_read(plain))
    else:
        r["read_s"].append(plain_read(plain))
        load(tag_dir)
    # A resume at another layout: convert (rank 0 runs DeepSpeed's ds_to_universal as a child
    # process; here the one rank), then load from the conversion, which is verified first.
    drop_cache(ckpt)
    uc = work / f"uc{i}"
    peak, stop = [0], threading.Event()
    watcher = threading.Thread(target=watch_size, args=(uc, peak, stop))
    watcher.start()
    t0 = time.perf_counter()
    try:
        out = universal.to_universal(tag_dir, uc)
    finally:
        r["convert_s"].append(time.perf_counter() - t0)
        stop.set()
        watcher.join()
    r.setdefault("universal_bytes", []).append(tree_bytes(out))
    r.setdefault("universal_peak_bytes", []).append(peak[0])
    drop_cache(out)
    t0 = time.perf_counter()
    with safeload.loading():
        universal.load_universal(engine, tag_dir, ckpt_dir=uc, saved=(1, 1, 1), here=(1, 1, 1))
    r["universal_load_s"].append(time.perf_counter() - t0)
    shutil.rmtree(uc)
    shutil.rmtree(ckpt)
    plain.unlink()
    return n_bytes
