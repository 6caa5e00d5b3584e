"""Small file writes that a reader, a crash or another process never sees half done.

Torch-free on purpose: the data commands and the benchmarks use it without loading torch.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data (or a directory's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, *, durable: bool = False) -> None:
    """Replace ``path`` with ``text``: a reader sees the old file or the new one, never a part.

    The text goes to a hidden temporary file beside ``path`` (named for this process and
    thread, so concurrent writers never share one) and is renamed over it. With ``durable``,
    the file and then its directory entry are fsync'd, so a power cut also leaves the old or
    the new file; without it, a crash of this process is covered, and the write is cheap.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)


# --- The one rule for every command that writes a directory -------------------------------
# A command replaces only what it made itself. Each tool marks its output directory (prepared
# data: meta.json with format_version; synthetic corpora: meta.json with "synth"; an export:
# anneal_export.json; a run: config.json with "run"), and --force replaces only a directory
# that carries the right marker, or an empty one. Never ".", an ancestor of the working
# directory, an input, or the thing being read.


def _resolved(p: Path) -> Path:
    return Path(os.path.abspath(os.path.realpath(Path(p).expanduser())))


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def claim_output(
    out: Path,
    *,
    what: str,
    force: bool = False,
    made_by_us: Callable[[Path], bool] | None = None,
    flag: str = "--out",
    inputs: Iterable[Path] = (),
    in_place: bool = False,
) -> None:
    """Check that ``out`` may be written, before anything is written.

    Refused, with a :class:`UserError` that names ``flag`` and the fix: a file at ``out``; the
    root, the working directory or one of its ancestors; ``out`` equal to, inside or holding
    any of ``inputs`` (what the command reads); an existing non-empty directory without
    ``force``; with ``force``, a non-empty directory for which ``made_by_us`` is False (not
    the output of this command, ``what`` says of what kind). Its parent must be a writable
    directory or creatable. Nothing is created or removed here.

    ``in_place``: the command adds to ``out`` beside what is there and replaces nothing (a run
    continued in its directory, one export per checkpoint under a directory of exports), so
    only the checks that do not depend on what ``out`` holds apply.
    """
    from anneal.errors import UserError

    out = Path(out)
    real = _resolved(out)
    cwd = _resolved(Path.cwd())
    if real == Path(real.anchor) or _inside(cwd, real):
        raise UserError(
            f"{flag} {out}: that is the working directory, one of its parents or the root, "
            f"and a command never writes over it. Name a new directory."
        )
    for inp in inputs:
        inp_real = _resolved(inp)
        if _inside(real, inp_real) or _inside(inp_real, real):
            raise UserError(
                f"{flag} {out}: it is, holds or lies inside {inp}, which this command reads. "
                f"Name a directory apart from the inputs."
            )
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(
            f"{flag} {out}: a file (or link) is there, and a command never replaces a file it "
            f"did not make. Name a new directory, or move that file away."
        )
    try:
        holds = out.is_dir() and any(out.iterdir())
    except OSError as e:
        raise UserError(
            f"{flag} {out}: cannot read it ({e.strerror}), so nothing there is replaced. "
            f"Choose a directory you can read and write."
        ) from None
    if not in_place and holds:
        if not force:
            raise UserError(
                f"{flag} {out}: exists and is not empty. Choose a new directory, or pass "
                f"--force to replace it (only a {what} that this command wrote is replaced)."
            )
        if made_by_us is None or not made_by_us(out):
            raise UserError(
                f"{flag} {out}: holds files that are not a {what} written by this command, "
                f"so --force will not delete it. Choose a new directory, or move its contents "
                f"away yourself."
            )
    check_creatable(out, flag=flag)


def check_creatable(path: Path, *, flag: str = "--out") -> None:
    """UserError unless ``path`` can be created: its nearest existing ancestor is a directory
    this process may write to (a path under a file, or in a read-only place, is refused)."""
    from anneal.errors import UserError

    parent = _resolved(path).parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(
            f"{flag} {path}: cannot create it, {parent} is not a writable directory. Choose a "
            f"place you can write to."
        )


PATH_MAX = 4096
"""Bytes in a path, its closing NUL included (Linux ``PATH_MAX``)."""
NAME_MAX = 255
"""Bytes in one name of a path (Linux ``NAME_MAX``, every common local file system)."""


def check_path_length(path: str, *, flag: str) -> None:
    """UserError naming ``flag`` when ``path`` is longer than the file system takes (4,095
    bytes, or 255 in one name): an ``ENAMETOOLONG`` traceback wherever it was first opened."""
    from anneal.errors import UserError

    raw = os.fsencode(path)
    longest = max(len(name) for name in raw.split(b"/"))
    if len(raw) >= PATH_MAX or longest > NAME_MAX:
        shown = ascii(path)[1:-1]
        raise UserError(
            f"{flag} {shown[:60]}{'...' if len(shown) > 60 else ''}: a path of {len(raw):,} "
            f"bytes whose longest name has {longest:,}; the file system takes at most "
            f"{PATH_MAX - 1:,} bytes in a path and {NAME_MAX} in one name. Give a shorter path.",
            every_rank=True,
        )


def make_dir(path: Path, *, flag: str = "--out") -> Path:
    """``mkdir -p path``, once the command writes. Where the file system makes none although
    :func:`check_creatable` passed (``/proc``, ``/sys``; a place only root may write to, for
    root), the OSError becomes a UserError naming ``flag`` and the fix."""
    from anneal.errors import UserError

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"{flag} {path}: cannot create the directory there ({e.strerror or e}). Choose a "
            f"place you can write to."
        ) from None
    return path


def replace_dir(partial: Path, out: Path) -> None:
    """Move a finished ``partial`` directory to ``out``, replacing what :func:`claim_output`
    allowed there (an empty directory or this command's own earlier output). The old one is
    renamed aside first and removed only once the new one is in place."""
    import shutil

    partial, out = Path(partial), Path(out)
    if not out.exists():
        partial.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    try:
        partial.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def confined(directory: Path, name: object, *, where: str) -> Path:
    """``directory / name`` for a file name read from metadata (a checkpoint's manifest or
    ``latest``, a prepared ``meta.json``, a dataset's state file), refused unless it is a
    relative path without ``..`` that resolves (links followed) inside ``directory``. Anneal
    writes only such names, so anything else was edited or comes from elsewhere, and nothing
    it names is opened. ``where`` says where the name was read (``DIR/meta.json, key
    splits.train.shards[0].file``)."""
    from pathlib import PurePosixPath

    from anneal.errors import UserError

    directory = Path(directory)
    why = None
    if not isinstance(name, str) or not name:
        why = f"is {name!r:.80}, not a file name"
    elif "\x00" in name or "\\" in name:
        why = "holds a NUL or a backslash"
    elif PurePosixPath(name).is_absolute():
        why = "is an absolute path"
    elif ".." in PurePosixPath(name).parts:
        why = "climbs out with '..'"
    else:
        root = os.path.realpath(directory)
        real = os.path.realpath(directory / name)
        if not real.startswith(root.rstrip(os.sep) + os.sep):
            why = f"resolves to {real}, outside {directory}"
    if why is not None:
        raise UserError(
            f"{where}: the entry {name!r:.80} {why}. Metadata may only name files inside its "
            f"own directory, so Anneal will not open it. The file was edited or does not come "
            f"from Anneal: use another one, or restore it from where it came."
        )
    return directory / name


def read_regular(path: Path, *, limit: int, head: bool = False) -> bytes:
    """The bytes of ``path``, a file of someone else's that may hold anything: opened without
    following a link and without blocking (a FIFO planted under the name would hang a plain
    ``open``), and read only when it is a regular file of at most ``limit`` bytes (``head``:
    of any size, its first ``limit`` bytes). ValueError saying what it is otherwise (a link, a
    FIFO, a device, a directory, too big); OSError when it cannot be opened
    (FileNotFoundError: it is not there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        if os.path.islink(path):
            raise ValueError("a link, not a file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file (a FIFO, a device, a socket or a directory)")
        if info.st_size > limit and not head:
            raise ValueError(f"{info.st_size:,} bytes, more than the {limit:,} it may hold")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit and not head:
        raise ValueError(f"more than the {limit:,} bytes it may hold")
    return data[:limit]


def real_dir(root: Path, *names: str, make: bool = False) -> Path:
    """``root/names[0]/names[1]/...``, where a command writes or deletes under ``root`` (a
    run directory): each of them a real directory of ``root``, never a link (through which a
    removal would reach another directory) nor a file; made when missing with ``make``
    (returned even when missing without it). A UserError naming the path and the fix
    otherwise. ``root`` itself is what the user named, and may be a link."""
    from anneal.errors import UserError

    path = Path(root)
    for name in names:
        path = path / name
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            kind = f"a link to {os.readlink(path)}" if path.is_symlink() else "a file"
            raise UserError(
                f"{path}: {kind}, where Anneal keeps a directory of its own under {root}. "
                f"Anneal never writes or deletes through a link (that would reach another "
                f"directory) nor over a file it did not make: move it away, and run again."
            )
        if make and not path.exists():
            make_dir(path, flag=str(root))
    return path


def is_matplotlib_png(path: Path) -> bool:
    """A PNG whose ``Software`` text chunk says Matplotlib wrote it (Anneal's charts are;
    a photo or a drawing is not). Reads the chunks before the image data only."""
    try:
        with open(path, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                return False
            for _ in range(64):
                head = f.read(8)
                if len(head) < 8:
                    return False
                size, kind = int.from_bytes(head[:4], "big"), head[4:]
                if kind == b"IDAT" or size > 1 << 20:
                    return False
                data = f.read(size)
                f.read(4)  # CRC
                if kind == b"tEXt" and data.startswith(b"Software\0Matplotlib"):
                    return True
    except OSError:
        return False
    return False


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """The sha256 of a file's bytes, hex, read in chunks (a multi-gigabyte weight file or shard
    never sits in memory whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
