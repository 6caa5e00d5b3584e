"""Which checkpoint a run resumes from: the intact tag directories of a checkpoints directory,
the one ``--resume`` names (``auto``, ``none`` or a path), and, before anything loads, that its
hashes hold (with ``--resume auto``, the newest older one that verifies when they do not) and
that it was trained on the data's tokenizer. ``choose`` is the one chooser of a run's checkpoint:
resume, the export (``anneal.hf.source``) and ``anneal eval`` all take theirs from it.

A tag directory counts only by its manifest (``anneal.resilience.manifest``): a save killed
midway, or one that failed on a full disk, has none, so resume ignores it and the previous
checkpoint stays the newest. The tag in ``latest`` is read only to refuse one that leads out of
the directory; it is there for DeepSpeed's own tools.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from anneal.errors import UserError
from anneal.files import confined
from anneal.resilience.manifest import (
    MANIFEST,
    is_intact,
    read_manifest,
    saved_step,
    sizes_match,
    verify,
)

log = logging.getLogger(__name__)

LATEST = "latest"


def read_latest(ckpt_dir: Path) -> Path | None:
    """The tag directory that ``ckpt_dir/latest`` names (DeepSpeed's own tools, such as
    ``zero_to_fp32.py``, follow it when given no tag); None without one. Refused unless it names
    a plain tag inside ``ckpt_dir``. Anneal itself picks checkpoints by their manifests."""
    path = Path(ckpt_dir) / LATEST
    try:
        name = path.read_text().strip()
    except (OSError, ValueError):
        return None
    if len(PurePosixPath(name).parts) != 1 or name.startswith(".") or "/" in name:
        raise UserError(
            f"{path}: names {name[:80]!r}, not a plain checkpoint tag (stepNNNNNNNN) inside "
            f"{ckpt_dir}. Anneal writes only a tag there; put the newest tag back in it, or "
            f"delete the file (resume picks checkpoints by their manifests)."
        )
    return confined(Path(ckpt_dir), name, where=str(path))  # and no link that leads out


def check_checkpoint_tokenizer(
    tag_dir: Path, *, data_dir: Path, tokenizer_sha256: str | None
) -> None:
    """UserError when the checkpoint was trained on ids of another tokenizer than the data's.
    Read from the manifest, so resume refuses before any engine is built."""
    saved = (read_manifest(tag_dir) or {}).get("tokenizer_sha256")
    if saved and tokenizer_sha256 and saved != tokenizer_sha256:
        raise UserError(
            f"--data {data_dir}: its tokenizer ({tokenizer_sha256[:12]}...) is not the one "
            f"{tag_dir} was trained with ({saved[:12]}...). Resume with the original data "
            f"directory, or start a new run in a new --out."
        )


def verified_resume(chosen: Path, *, fallback: bool) -> Path | None:
    """Collective. ``chosen`` if its hashes hold; else, with ``fallback`` (``--resume auto``),
    the newest older checkpoint that verifies, saying so (None when none does)."""
    bad = verify(chosen)
    if not bad:
        return chosen
    if not fallback:
        raise UserError(
            f"--resume {chosen}: {_corrupt(chosen, bad)}. Resume from an older tag in "
            f"{chosen.parent}, or use --resume auto to take the newest intact one.",
            every_rank=True,
        )
    _falling_back(chosen, bad)
    older = choose(
        chosen.parent, before_step=saved_step(chosen), verified=True, on_damaged=_falling_back
    )
    if older is not None:
        log.warning("resuming from %s, the newest checkpoint that verifies", older)
    else:
        log.warning("no checkpoint in %s verifies: starting from scratch", chosen.parent)
    return older


def _corrupt(tag_dir: Path, bad: list[str]) -> str:
    return (
        f"checkpoint {tag_dir} is corrupt: {len(bad)} file(s) differ from its manifest "
        f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
    )


def _falling_back(tag_dir: Path, bad: list[str]) -> None:
    log.warning("%s; falling back to an older checkpoint", _corrupt(tag_dir, bad))


def choose(
    ckpt_dir: Path,
    *,
    step: int | None = None,
    before_step: int | None = None,
    verified: bool = False,
    on_damaged: Callable[[Path, list[str]], None] | None = None,
) -> Path | None:
    """The one chooser of a run's checkpoint (resume, export, eval): the newest intact tag
    directory of ``ckpt_dir`` (``intact_checkpoints``), or the one saved at ``step``, or the
    newest saved before ``before_step``; None when there is none. ``verified`` (collective):
    the newest of those whose hashes hold (``verify``), ``on_damaged(tag_dir, files)`` told of
    each newer one that does not."""
    found = intact_checkpoints(ckpt_dir)
    if step is not None:
        found = [t for t in found if saved_step(t) == step]
    if before_step is not None:
        found = [t for t in found if saved_step(t) < before_step]
    if not verified:
        return found[-1] if found else None
    for tag_dir in reversed(found):
        bad = verify(tag_dir)
        if not bad:
            return tag_dir
        if on_damaged is not None:
            on_damaged(tag_dir, bad)
    return None


def intact_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Intact tag directories (by ``is_intact``), oldest first (by step); each manifest is
    read once."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for tag_dir in _tag_dirs(ckpt_dir):
        manifest = read_manifest(tag_dir)
        if manifest is not None and sizes_match(tag_dir, manifest):
            found.append((manifest["step"], tag_dir))
    return [tag_dir for _, tag_dir in sorted(found, key=lambda found: found[0])]


def _tag_dirs(ckpt_dir: Path) -> list[Path]:
    """The directories of ``ckpt_dir`` that may be checkpoints (not ``.superseded``)."""
    return [p for p in ckpt_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]


def find_resume(resume: str, ckpt_dir: Path) -> Path | None:
    """The tag directory to resume from, or None to start fresh.

    ``auto``: the newest intact checkpoint in ``ckpt_dir`` (none: start fresh). ``none``: start
    fresh. Otherwise a path: a tag directory, or a checkpoints directory (its newest intact tag).
    """
    if resume == "none":
        return None
    if resume == "auto":
        read_latest(ckpt_dir)  # refuses a `latest` that leads out of the directory
        found = choose(ckpt_dir)
        skipped = (
            [p.name for p in _tag_dirs(ckpt_dir) if not is_intact(p)] if ckpt_dir.is_dir() else []
        )
        if skipped:
            log.warning("ignoring incomplete checkpoints (no intact manifest): %s", skipped)
        return found
    path = Path(resume)
    if not path.exists():
        raise UserError(
            f"--resume {resume}: no such file or directory. Give a checkpoint tag "
            f"directory (RUN/checkpoints/stepNNNNNNNN), 'auto' or 'none'."
        )
    if is_intact(path):
        return path
    found = choose(path)
    if found is not None:
        return found
    raise UserError(
        f"--resume {resume}: not an intact checkpoint (no valid {MANIFEST}) and "
        f"holds none. A save that was interrupted leaves such a directory; resume "
        f"from an older tag or use 'auto'."
    )
