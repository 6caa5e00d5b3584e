"""The manifest that makes a tag directory a checkpoint: ``manifest.json`` with each file's size
and xxh3-128 hash.

It is written collectively: every rank hashes the files it wrote itself, right after writing
them (still in its page cache), while a thread fsyncs them to the disk, and rank 0 writes the
manifest (fsync'd) once every rank has finished. It is read without trusting any name in it as a
path (:func:`anneal.files.confined`), and a checkpoint is checked against it two ways: cheaply,
by the files' sizes (``is_intact``), and fully, by re-hashing them, each rank its share
(``verify``), so that bytes changed after the save (a torn copy, a bad disk, a same-size
truncation) are found before anything is loaded.
"""

from __future__ import annotations

import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from anneal.dist import all_gather, is_main_process, rank, world_size
from anneal.files import confined, fsync_path, write_atomic
from anneal.resilience import ds_files

MANIFEST = "manifest.json"
HASH = "xxh3_128"
_CHUNK = 8 << 20


def file_hash(path: Path) -> str:
    """xxh3-128 of a file's bytes, hex (about 10 GB/s from the page cache)."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:  # no copy
            view = memoryview(m)
            for off in range(0, len(m), _CHUNK):
                h.update(view[off : off + _CHUNK])
            view.release()
    return h.hexdigest()


def owner_of(name: str, n_ranks: int, tp: int = 1) -> int:
    """The rank that hashes a file: the rank that wrote it, by the ranks its name gives
    (``anneal.resilience.ds_files.writer_ranks``); DeepSpeed's TP groups are blocks of ``tp``
    consecutive ranks."""
    dp, tp_rank = ds_files.writer_ranks(name)
    return (dp * tp + tp_rank) % n_ranks


def _hash_share(tag_dir: Path, names: list[str], tp: int) -> dict[str, dict]:
    """{name: {size, hash}} for this rank's share of ``names``, each file fsync'd before this
    returns. The hashing reads the page cache while a thread waits on the disk, so the hashes
    cost nothing as long as the disk writes slower than xxh3 hashes."""
    mine = [n for n in names if owner_of(n, world_size(), tp) == rank()]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsync") as pool:
        synced = [pool.submit(fsync_path, tag_dir / n) for n in mine]
        share = {
            n: {"size": (tag_dir / n).stat().st_size, HASH: file_hash(tag_dir / n)} for n in mine
        }
        for done in synced:
            done.result()  # an fsync error (EIO, ENOSPC) fails the save here
    return share


def _list_files(tag_dir: Path) -> list[str]:
    return sorted(
        str(p.relative_to(tag_dir))
        for p in tag_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    )


def write_manifest(
    tag_dir: Path, *, step: int, client_state: dict, model: dict | None = None
) -> None:
    """Collective, once every rank's files of the save are complete: each rank hashes (and
    fsyncs) its share, rank 0 fsyncs the directory entries and writes the manifest, durably.
    ``model``: the model's shape, so that a resume with another shape is refused before
    anything loads."""
    tp = client_state.get("tensor_parallel_size", 1)
    shares = all_gather(_hash_share(tag_dir, _list_files(tag_dir), tp))
    write_manifest_of(tag_dir, shares, step=step, client_state=client_state, model=model)


def write_manifest_of(
    tag_dir: Path,
    shares: list[dict[str, dict]],
    *,
    step: int,
    client_state: dict,
    model: dict | None = None,
) -> None:
    """Rank 0 (the others return): the manifest of ``tag_dir`` from every rank's share of its
    files (``{name: {size, hash}}``, each file already fsync'd by the rank that wrote it), the
    files that no share names (a file DeepSpeed wrote itself, outside its checkpoint engine,
    such as its recovery script) hashed and fsync'd here; the directory entries fsync'd, then
    the manifest written durably. An asynchronous save
    (``anneal.resilience.background_save``) gathers the shares its writers hashed."""
    if not is_main_process():
        return
    tp = client_state.get("tensor_parallel_size", 1)
    files = {name: entry for share in shares for name, entry in share.items()}
    rest = [n for n in _list_files(tag_dir) if n not in files]
    for name in rest:
        fsync_path(tag_dir / name)
    files |= {n: {"size": (tag_dir / n).stat().st_size, HASH: file_hash(tag_dir / n)} for n in rest}
    for d in {(tag_dir / name).parent for name in files}:
        fsync_path(d)  # the files' directory entries
    manifest = {
        "tag": tag_dir.name,
        "step": step,
        "tokens": client_state.get("tokens"),
        "tokenizer_sha256": client_state.get("data", {}).get("tokenizer_sha256"),
        "world_size": world_size(),
        # the layout it was saved at (anneal.resolution.parallel.check_resume_layout)
        "tensor_parallel_size": tp,
        "sequence_parallel_size": client_state.get("sequence_parallel_size", 1),
        "expert_parallel_size": client_state.get("expert_parallel_size", 1),
        "zero_stage": client_state.get("zero_stage"),
        "files": dict(sorted(files.items())),
    }
    if model is not None:
        manifest["model"] = model
    write_atomic(tag_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n", durable=True)


def read_manifest(tag_dir: Path) -> dict | None:
    """The manifest of a tag directory; None when it has none, or one that is not a manifest
    Anneal writes (not JSON, or not its shape), so that the directory counts as a save that
    never finished. A file name in it that leaves the directory is refused (``confined``)."""
    path = Path(tag_dir) / MANIFEST
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not _well_formed(doc):
        return None
    for name in doc["files"]:
        confined(Path(tag_dir), name, where=str(path))
    return doc


def saved_step(tag_dir: Path) -> int:
    """The step a checkpoint was saved at, as its manifest records it; the caller has found
    the manifest (``read_manifest``: not None)."""
    return read_manifest(tag_dir)["step"]


def saved_zero_stage(manifest: dict) -> int | None:
    """The ZeRO stage a checkpoint was saved at: its manifest's ``zero_stage``, or for a
    manifest from before that field, read off its file names (``ds_files.stage_of_names``):
    3, 2 (for 1 or 2, whose files are the same), 0, or None when it cannot tell."""
    stage = manifest.get("zero_stage")
    if stage is not None:
        return stage
    return ds_files.stage_of_names(manifest.get("files", {}))


def moves_stage(saved_stage: int | None, stage: int | None) -> bool:
    """Whether a resume at ZeRO ``stage`` of a checkpoint saved at ``saved_stage`` moves between
    ZeRO-1/2 and ZeRO-3, which goes through DeepSpeed's universal checkpoint
    (``anneal.resilience.checkpoint.load`` converts; ``anneal.resolution.parallel`` says so and
    refuses where that conversion fails); False when either stage is unknown."""
    return None not in (saved_stage, stage) and (saved_stage == 3) != (stage == 3)


def _well_formed(doc) -> bool:
    def count(v, low: int = 0) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    if not (
        isinstance(doc, dict) and count(doc.get("step")) and isinstance(doc.get("files"), dict)
    ):
        return False
    if "world_size" in doc and not count(doc["world_size"], 1):
        return False
    for key in ("tensor_parallel_size", "sequence_parallel_size", "expert_parallel_size"):
        if key in doc and not count(doc[key], 1):
            return False
    if doc.get("zero_stage") not in (None, 0, 1, 2, 3) or isinstance(doc.get("zero_stage"), bool):
        return False
    if not isinstance(doc.get("tokenizer_sha256") or "", str):
        return False
    entries = [e if isinstance(e, dict) else {"size": e} for e in doc["files"].values()]
    return all(count(e.get("size")) and isinstance(e.get(HASH, ""), str) for e in entries)


def _entries(manifest: dict) -> dict[str, dict]:
    """name -> {size[, hash]}; manifests written before hashes held name -> size."""
    return {n: e if isinstance(e, dict) else {"size": e} for n, e in manifest["files"].items()}


def missing_files(tag_dir: Path, manifest: dict) -> list[str]:
    """The files of ``manifest`` absent from ``tag_dir`` or of another size (no hashing)."""
    return [
        name
        for name, e in _entries(manifest).items()
        if not (tag_dir / name).is_file() or (tag_dir / name).stat().st_size != e["size"]
    ]


def sizes_match(tag_dir: Path, manifest: dict) -> bool:
    """Every file of ``manifest`` present in ``tag_dir`` with its size (no hashing)."""
    return not missing_files(tag_dir, manifest)


def is_intact(tag_dir: Path) -> bool:
    """Cheap check: a manifest, and every file in it present with its size (no hashing)."""
    manifest = read_manifest(tag_dir)
    return manifest is not None and sizes_match(tag_dir, manifest)


def damaged_files(tag_dir: Path, *, share_of: tuple[int, int] | None = None) -> list[str]:
    """Files of an intact-looking checkpoint whose bytes no longer match the manifest's hash.

    ``share_of=(rank, n)``: check only the files ``owner_of`` gives that rank of ``n``."""
    manifest = read_manifest(tag_dir)
    entries, tp = _entries(manifest), manifest.get("tensor_parallel_size", 1)
    bad = []
    for name, e in entries.items():
        if share_of and owner_of(name, share_of[1], tp) != share_of[0]:
            continue
        path = tag_dir / name
        if not path.is_file() or path.stat().st_size != e["size"]:
            bad.append(name)
        elif HASH in e and file_hash(path) != e[HASH]:
            bad.append(name)
    return bad


def verify(tag_dir: Path) -> list[str]:
    """Collective: re-hash a checkpoint, each rank its share; the damaged files (all ranks get
    the same list)."""
    mine = damaged_files(tag_dir, share_of=(rank(), world_size()))
    return sorted(n for share in all_gather(mine) for n in share)
