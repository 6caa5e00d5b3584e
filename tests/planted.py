"""Planting pickles that would run code into a real checkpoint, for the tests that prove no
load of Anneal's runs them (tests/resilience/test_checkpoint_trust.py,
tests/resilience/test_hostile_run.py).

The two kinds that walked round the opcode scan of issue 18 (issue 27):

- ``dotted``: a protocol-4 ``STACK_GLOBAL`` of ``deepspeed.checkpoint.constants`` and
  ``__builtins__.get``, which Python's unpickler resolves one attribute at a time to the
  builtins' ``get``; ``get("eval")`` then ``eval(CODE)``, prepended to the file's ``data.pkl``.
- ``front``: the same pickle written in front of the zip: ``zipfile`` still reads the archive,
  and torch, seeing no zip header, reads the file as its legacy format, unpickling the front.

Each touches ``marker`` when it runs. The manifest is rewritten to match, so only the loader
can tell.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

from anneal.resilience.manifest import HASH, MANIFEST, file_hash

KINDS = ("dotted", "front")


def short_str(text: str) -> bytes:
    """SHORT_BINUNICODE, or BINUNICODE for longer text."""
    b = text.encode()
    if len(b) < 256:
        return b"\x8c" + bytes([len(b)]) + b
    return b"X" + len(b).to_bytes(4, "little") + b


def touch_code(marker: Path) -> str:
    return f"__import__('pathlib').Path({str(marker)!r}).touch()"


def dotted_payload(marker: Path) -> bytes:
    """Pickle opcodes (no STOP) that evaluate ``touch_code(marker)`` and leave nothing behind."""
    return (
        b"\x80\x04"
        + short_str("deepspeed.checkpoint.constants")
        + short_str("__builtins__.get")
        + b"\x93"  # STACK_GLOBAL
        + short_str("eval")
        + b"\x85R"  # TUPLE1 REDUCE: get("eval")
        + short_str(touch_code(marker))
        + b"\x85R0"  # eval(CODE), POP
    )


def replace_pickle(path: Path, data_pkl: bytes) -> None:
    """Rewrite a torch zip file with ``data.pkl`` replaced, every other record as it was."""
    src = zipfile.ZipFile(path)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = data_pkl if info.filename.endswith("/data.pkl") else src.read(info)
            z.writestr(info, data)
    src.close()
    path.write_bytes(buf.getvalue())


def plant(path: Path, kind: str, marker: Path) -> None:
    """Plant a payload of ``kind`` into the checkpoint file ``path`` and rehash its manifest."""
    if kind == "dotted":
        with zipfile.ZipFile(path) as z:
            [pkl] = [n for n in z.namelist() if n.endswith("/data.pkl")]
            original = z.read(pkl)
        replace_pickle(path, dotted_payload(marker) + original)
    elif kind == "front":
        path.write_bytes(dotted_payload(marker) + b"N." + path.read_bytes())
    else:
        raise ValueError(kind)
    rehash(path.parent)


def rehash(tag_dir: Path) -> None:
    """Rewrite ``tag_dir``'s manifest so that every file it lists matches again."""
    path = tag_dir / MANIFEST
    manifest = json.loads(path.read_text())
    for name, entry in manifest["files"].items():
        entry.update(size=(tag_dir / name).stat().st_size, **{HASH: file_hash(tag_dir / name)})
    path.write_text(json.dumps(manifest, indent=2))
