"""Beside the run: ``anneal eval RUN --watch`` scores each checkpoint of a training run once, as
it appears, in a process (a Slurm job of its own) that the training job never waits for.

Which tag directories of ``RUN/checkpoints/`` are due (``survey``, rank 0, without hashing):

- **scored**: ``RUN/evals/step-<N>.json`` exists for its manifest's step N (written whole by
  this watcher, by an earlier one, by ``anneal eval`` or by the loop). Never scored again, so a
  restarted watcher resumes where the last one stopped.
- **being written**: no ``manifest.json`` yet. A save writes its manifest last, after every
  rank's files are on the disk (``anneal.resilience.manifest``), so this is a save in progress
  (or one cut short). Said once, and looked at again on every poll: it is scored once its
  manifest is there and verifies.
- **damaged**: a ``manifest.json`` that is not one Anneal writes, names a file outside the tag,
  or lists files that are missing or of another size; found later, files whose bytes differ
  from the manifest's hashes, or a file torch's weights-only loader refuses. A finished save
  never changes, so this watcher skips it for good, with a warning that names the files; a
  restarted watcher looks at it again (put a good copy back first).
- **due**: the rest, oldest first.

Only tags named ``stepNNNNNNNN`` are looked at (another name, ``Documents`` say, is left alone).
Before a due checkpoint is read, its files are pinned: hard-linked into a new directory
``RUN/evals/.reading/<tag>/`` (``pin``), marked as a watcher's by a ``.anneal-pin`` file written
into it first. ``evals/`` and ``evals/.reading`` must be real directories of the run, never links
(``anneal.files.real_dir``): the watcher deletes only pinned directories it made, and, at its
start, a killed watcher's (a real directory named for a tag, holding the mark). The run's keep-last
pruning may delete the tag at any time; once pinned, its bytes stay until the scoring is over. A
tag deleted before it was pinned is skipped with a warning that says so. Where the file system has
no hard links, the tag is read in place, and a deletion during the scoring skips it the same way.
The pinned copy is verified against every hash of its manifest
(``anneal.resilience.manifest.verify``, the ranks sharing the files), and only then scored.

The watcher ends when the run has finished (a checkpoint at the ``run.train.max_steps`` of the
run's ``config.json``, read again on every poll, is scored or skipped) or at ``until_step``.
On SIGUSR1 or SIGTERM it finishes the scoring it is in (a result is written whole, so one
killed midway leaves nothing), starts no other, and exits 75 (``Preempted``) like training, so
its batch script requeues it; the requeued job skips what ``evals/`` holds. On several ranks,
rank 0 decides and the others follow (``all_gather``), so every rank scores the same tags.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from anneal import rundir
from anneal.dist import all_gather, is_main_process, print0
from anneal.errors import UserError
from anneal.files import confined, real_dir
from anneal.resilience import preempt
from anneal.resilience.checkpoint import step_of_tag
from anneal.resilience.manifest import MANIFEST, missing_files, read_manifest, verify

log = logging.getLogger(__name__)

READING = ".reading"
"""``RUN/evals/.reading/<tag>/``: the pinned files of the checkpoint being scored."""
PIN_MARK = ".anneal-pin"
"""Written first into each pinned directory: a watcher made it, and a later one may remove it."""
DEFAULT_POLL_S = 60.0
"""How often the watcher looks for new checkpoints (``--poll-s``)."""


@dataclasses.dataclass(frozen=True)
class Tag:
    """One tag directory as the survey found it."""

    name: str
    state: str
    """"scored", "writing", "damaged" or "due"."""
    step: int | None = None
    why: str = ""


class Gone(Exception):
    """The tag directory was removed (keep-last pruning) before its files could be read."""


def _state(tag_dir: Path, run_dir: Path) -> Tag:
    """What ``tag_dir`` is now (see the module docstring); no hashing."""
    name = tag_dir.name
    named = step_of_tag(name)  # for a damaged manifest
    if tag_dir.is_symlink():
        return Tag(name, "damaged", named, "a link, not a directory the run saved")
    if not (tag_dir / MANIFEST).exists():
        return Tag(name, "writing", named, f"no {MANIFEST} yet")
    try:
        manifest = read_manifest(tag_dir)
    except UserError as e:  # a name that leaves the directory
        return Tag(name, "damaged", named, str(e))
    if manifest is None:
        if not tag_dir.exists():
            raise Gone(name)
        return Tag(name, "damaged", named, f"its {MANIFEST} is not one Anneal writes")
    step = manifest["step"]
    if rundir.eval_path(run_dir, step).exists():
        return Tag(name, "scored", step)
    missing = missing_files(tag_dir, manifest)
    if missing and tag_dir.exists():
        listed = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        why = f"files its {MANIFEST} lists are missing or cut ({listed})"
        return Tag(name, "damaged", step, why)
    return Tag(name, "due", step)


def survey(run_dir: Path) -> list[Tag]:
    """Every tag directory of ``RUN/checkpoints`` named ``stepNNNNNNNN`` (``step_of_tag``; not
    ``.superseded``, nor a folder of another name), by name (oldest first). A tag removed
    while it is looked at is left out."""
    ckpt_dir = rundir.checkpoints_dir(run_dir)
    try:
        names = sorted(p.name for p in ckpt_dir.iterdir() if step_of_tag(p.name) is not None)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        tag_dir = ckpt_dir / name
        if not tag_dir.is_dir():
            continue
        try:
            found.append(_state(tag_dir, run_dir))
        except (Gone, FileNotFoundError):
            continue
    return found


def pin_root(run_dir: Path, *, make: bool = True) -> Path:
    """``RUN/evals/.reading``: both real directories of the run (made when missing with
    ``make``), never links; a UserError otherwise (``anneal.files.real_dir``)."""
    return real_dir(run_dir, rundir.EVALS, READING, make=make)


def pin(tag_dir: Path, root: Path) -> Path:
    """Hard links to the manifest and every file it lists, under a new directory ``root/<tag>``
    (marked ``PIN_MARK``); the pinned directory. ``Gone`` when the tag (or a file of it)
    vanished first; ``tag_dir`` itself where the file system makes no hard links; a UserError
    when ``root/<tag>`` is there already (not this watcher's). Rank 0 only."""
    dest = root / tag_dir.name
    try:
        dest.mkdir()
    except FileExistsError:
        raise UserError(
            f"{dest}: is there already and is not this watcher's, so nothing is pinned over it. "
            f"Move it away, and start the watcher again to score {tag_dir.name}."
        ) from None
    try:
        (dest / PIN_MARK).write_text(f"{os.getpid()}\n")
        manifest = read_manifest(tag_dir)
        if manifest is None:
            raise Gone(tag_dir.name)
        for name in [MANIFEST, *manifest["files"]]:
            src = tag_dir / name if name == MANIFEST else confined(tag_dir, name, where=MANIFEST)
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dest / name)
    except FileNotFoundError:
        shutil.rmtree(dest, ignore_errors=True)
        raise Gone(tag_dir.name) from None
    except OSError as e:
        shutil.rmtree(dest, ignore_errors=True)
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        log.info("%s: no hard links here (%s): reading the checkpoint in place", root, e)
        return tag_dir
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest


def clear_pins(run_dir: Path) -> None:
    """Rank 0, at the start: remove what a killed watcher pinned, each a real directory of
    ``RUN/evals/.reading`` named for a tag and holding ``PIN_MARK``; anything else there is
    left alone. A UserError when ``evals/`` or ``.reading`` is a link or a file."""
    root = pin_root(run_dir, make=False)
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        mark = entry / PIN_MARK
        ours = step_of_tag(entry.name) is not None and not entry.is_symlink() and entry.is_dir()
        if ours and mark.is_file() and not mark.is_symlink():
            shutil.rmtree(entry)
        else:
            log.warning("%s: not a watcher's pinned checkpoint: left alone", entry)


def _drop_empty(run_dir: Path) -> None:
    """``RUN/evals/.reading`` removed when it is empty (and still a real directory)."""
    try:
        root = pin_root(run_dir, make=False)
    except UserError:
        return
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()


def _exists(pinned: str) -> bool:
    """Collective: whether rank 0 still sees the checkpoint's manifest at ``pinned``."""
    return all_gather(is_main_process() and (Path(pinned) / MANIFEST).exists())[0]


class Stop(preempt.SignalFlag):
    """SIGUSR1/SIGTERM handler of the watcher: sets a flag (the scoring in progress finishes),
    and a pid file in ``RUN/preempt/`` through which the batch script's trap finds this
    process, as it finds the training ranks (``anneal.resilience.preempt.SignalFlag``)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir, _finishing)

    def requested(self) -> bool:
        """Collective: whether any rank got a signal."""
        return any(all_gather(self.signalled))


def _finishing(name: str) -> None:
    log.warning(
        "got %s: finishing the scoring in progress, then exiting %d for a requeue",
        name,
        preempt.PREEMPTED_EXIT_CODE,
    )


@dataclasses.dataclass
class Watcher:
    """The loop of ``anneal eval RUN --watch``. ``score(tag_dir)``: collective, scores one
    verified checkpoint and writes ``RUN/evals/step-<N>.json`` (the command's); ``until_step``:
    stop once a checkpoint at this step or later is handled (None: at the run's last step)."""

    run_dir: Path
    score: Callable[[Path], object]
    until_step: int | None = None
    poll_s: float = DEFAULT_POLL_S
    scored: list[int] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    """Tag -> why, for this watcher's life: damaged, or removed before it was read."""
    _said: set[str] = dataclasses.field(default_factory=set)

    def target(self) -> int | None:
        """The step after which the watcher ends: the run's ``run.train.max_steps`` as its
        config.json holds it now, or ``until_step`` if smaller (None: neither is known yet)."""
        steps = rundir.record_or_empty(self.run_dir).train_settings.get("max_steps")
        if not isinstance(steps, int) or isinstance(steps, bool):
            return self.until_step
        return steps if self.until_step is None else min(steps, self.until_step)

    def plan(self) -> tuple[list[Tag], bool]:
        """Rank 0's survey, shared with every rank: (the due tags, whether the end is reached
        by what is scored or skipped already)."""
        due, done = [], False
        if is_main_process():
            tags, target = survey(self.run_dir), self.target()
            for tag in tags:
                self._note(tag)
            handled = [t for t in tags if t.state == "scored" or t.name in self.skipped]
            handled_steps = [t.step for t in handled if t.step is not None]
            done = target is not None and any(s >= target for s in handled_steps)
            due = [t for t in tags if t.state == "due" and t.name not in self.skipped]
            last = [i for i, t in enumerate(due) if target is not None and t.step >= target]
            due = due[: last[0] + 1] if last else due  # nothing past the end
        return all_gather((due, done))[0]

    def _note(self, tag: Tag) -> None:
        """Say once what a tag that is not scored now is (being written, or damaged)."""
        if tag.state == "writing" and tag.name not in self._said:
            log.info(
                "%s: %s (a save still being written, or one cut short): it is scored once its "
                "manifest is there and verifies",
                tag.name,
                tag.why,
            )
            self._said.add(tag.name)
        elif tag.state == "damaged":
            self._skip(tag.name, tag.why)

    def _skip(self, name: str, why: str) -> None:
        if name in self.skipped:
            return
        self.skipped[name] = why
        log.warning("%s: skipped, not scored: %s", name, why)

    def handle(self, tag: Tag) -> None:
        """Collective: pin, verify and score one due tag (or skip it, saying why)."""
        ckpt_dir = rundir.checkpoints_dir(self.run_dir)
        root = pinned = refused = None
        if is_main_process():
            try:
                root = pin_root(self.run_dir)
                pinned = str(pin(ckpt_dir / tag.name, root))
            except Gone:
                pass
            except UserError as e:  # a link where evals/ was, or a directory in the way
                refused = str(e)
        pinned, refused = all_gather((pinned, refused))[0]
        if refused is not None:
            return self._skip(tag.name, refused)
        if pinned is None:
            return self._gone(tag.name)
        try:
            if bad := verify(Path(pinned)):
                if not _exists(pinned):  # read in place, and pruned meanwhile
                    return self._gone(tag.name)
                listed = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
                self._skip(tag.name, f"{len(bad)} file(s) differ from its {MANIFEST} ({listed})")
                return None
            try:
                self.score(Path(pinned))
            except (UserError, OSError) as e:
                if not _exists(pinned):
                    return self._gone(tag.name)
                if not isinstance(e, UserError):
                    raise
                self._skip(tag.name, str(e))
                return None
            self.scored.append(tag.step)
        finally:
            if is_main_process() and Path(pinned).parent == root:  # made by pin() above
                shutil.rmtree(pinned, ignore_errors=True)
        return None

    def _gone(self, name: str) -> None:
        """Skip a tag that the run deleted before (or, read in place, while) it was read."""
        self._skip(name, "removed (the run's keep-last pruning) before it could be read")

    def run(self, stop: Stop | None = None, *, sleep: Callable[[float], None] = time.sleep) -> str:
        """Until the end: "finished" (the target step is handled) or "preempted" (a signal;
        the caller exits 75). Between polls, sleeps ``poll_s`` in slices of at most 1 s, and
        wakes early on this rank's signal."""
        refused = None
        if is_main_process():
            try:
                clear_pins(self.run_dir)
            except UserError as e:
                refused = str(e)
        if (refused := all_gather(refused)[0]) is not None:
            raise UserError(refused, every_rank=True)
        try:
            return self._loop(stop, sleep)
        finally:
            if is_main_process():
                _drop_empty(self.run_dir)

    def _loop(self, stop: Stop | None, sleep: Callable[[float], None]) -> str:
        while True:
            due, done = self.plan()
            if done:
                return "finished"
            for tag in due:
                if stop is not None and stop.requested():
                    return "preempted"
                self.handle(tag)
            if due:
                continue  # the end may be reached now; look again before sleeping
            if stop is not None and stop.requested():
                return "preempted"
            slept = 0.0
            while slept < self.poll_s and not (stop is not None and stop.signum is not None):
                sleep(min(1.0, self.poll_s - slept))
                slept += 1.0


def watch_run(
    run_dir: Path,
    score: Callable[[Path], None],
    *,
    tasks: list[str],
    until_step: int | None,
    poll_s: float | None,
) -> int:
    """Collective: the watcher over ``run_dir`` until its end, ``score(tag_dir)`` scoring each
    checkpoint (``anneal.cli.eval_watch`` composes it); 0, or 75 after a preemption signal. The
    run directory may not exist yet (the training job starts beside)."""
    stop = Stop(run_dir)
    poll_s = DEFAULT_POLL_S if poll_s is None else poll_s
    watcher = Watcher(run_dir, score, until_step=until_step, poll_s=poll_s)
    print0(f"watching {run_dir} for checkpoints every {poll_s:g} s (tasks: {', '.join(tasks)})")
    try:
        result = watcher.run(stop)
    finally:
        stop.close()
    skipped = "".join(f"\n  {tag}: {why}" for tag, why in watcher.skipped.items())
    steps = ", ".join(map(str, watcher.scored)) or "none"
    print0(f"watcher {result}: scored step(s) {steps}; skipped {len(watcher.skipped)}{skipped}")
    return preempt.PREEMPTED_EXIT_CODE if result == "preempted" else 0
