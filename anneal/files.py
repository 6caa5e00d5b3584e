"""Small file writes that a reader, a crash or another process never sees half done.

Torch-free on purpose: the data commands and the benchmarks use it without loading torch.
"""

from __future__ import annotations

import os
import threading
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
