"""The one owner of a run directory: the name of every path inside a run, reading and writing
its ``config.json``, the one reader of its ``metrics.jsonl``, and a launch's writes to it
(``RunDir``, undone when the launch fails before its first step).

```
RUN/
  config.json      the resolved run config and ds_config, as launched (write_config; read as an
                   anneal.run_record.RunRecord by read_record and record_or_empty)
  metrics.jsonl    one JSON object per line (anneal.observe.metrics writes, read_metrics reads)
  guard.json       the spike guard's record (anneal.resilience.guard)
  checkpoints/     <tag>/ + latest (anneal.resilience.checkpoint)
  evals/step-<N>.json  downstream scores of step N (anneal.eval.results; write_eval, read_eval(s))
  tb/ plots/ report.txt hf/<tag>/ heartbeat/ preempt/ previous-<time>/
```

A Hugging Face model directory's own ``config.json`` (``RUN/hf/<tag>/config.json``) is the
exporter's, not this module's. Nothing here imports torch at import time (the data and scaling
commands read run directories too).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path

from anneal.errors import UserError
from anneal.files import is_matplotlib_png, make_dir, read_regular, real_dir, write_atomic
from anneal.json_values import loads_bounded
from anneal.run_record import RunRecord

CONFIG = "config.json"
METRICS = "metrics.jsonl"
GUARD = "guard.json"
CHECKPOINTS = "checkpoints"
PLOTS = "plots"
REPORT = "report.txt"
TB = "tb"
HF = "hf"
HEARTBEAT = "heartbeat"
PREEMPT = "preempt"
EVALS = "evals"
_EVAL_FILE = re.compile(r"step-(\d+)\.json")
PREVIOUS = "previous-"

RUN_FILES = (CONFIG, METRICS, GUARD, CHECKPOINTS, PLOTS, REPORT, TB, HF, HEARTBEAT, EVALS, "wandb")
"""What a run writes into its directory, and what ``--restart`` moves to ``previous-<time>/``.
The launcher's files (forecast.json, .deepspeed_env, hostfile, submit.sbatch, eval-watch.sbatch,
logs/) and the live ``preempt/`` stay where they are."""
MARKS = (CONFIG, METRICS, GUARD)
"""Files whose presence shows that a run has been in a directory (as does a checkpoint)."""
LAUNCHER_FILES = (
    ".deepspeed_env",
    ".deepspeed_env.runner",
    "forecast.json",
    "hostfile",
    "submit.sbatch",
    "eval-watch.sbatch",
    "logs",
    PREEMPT,
)
"""What ``python -m launcher run|submit`` and its sbatch script put into a run directory before
the recipe starts (``launcher.dsenv``, ``anneal.planning.forecast``, ``launcher.slurm``); with
``previous-<time>/``, the only entries that a directory holding no run may hold without
``--force``."""
RUN_DIRS = (CHECKPOINTS, PLOTS, TB, HF, HEARTBEAT, PREEMPT, EVALS)
"""The directories a run makes in its directory."""
REPORT_HEAD = "health of "
"""The first line of ``report.txt`` (``anneal.observe.report.format_table``), then the run."""
_REPORT_TAIL = re.compile(r"  (no problems|\d+ problem\(s\))")

log = logging.getLogger(__name__)


def config_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CONFIG


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS


def guard_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / GUARD


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def of_checkpoint(tag_dir: str | Path) -> Path:
    """The run directory that holds checkpoint ``tag_dir`` (``RUN/checkpoints/<tag>``)."""
    return Path(tag_dir).parent.parent


def tb_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / TB


def plots_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / PLOTS


def report_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / REPORT


def hf_dir(run_dir: str | Path, tag: str | None = None) -> Path:
    """``RUN/hf``, or ``RUN/hf/<tag>``: where the export of checkpoint ``tag`` goes."""
    return Path(run_dir) / HF if tag is None else Path(run_dir) / HF / tag


def heartbeat_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / HEARTBEAT


def preempt_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / PREEMPT


def evals_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / EVALS


def eval_path(run_dir: str | Path, step: int) -> Path:
    """``RUN/evals/step-<step>.json``: the downstream scores of checkpoint ``step``."""
    return evals_dir(run_dir) / f"step-{step}.json"


def write_eval(run_dir: str | Path, doc: dict) -> Path:
    """``evals/step-<N>.json`` of ``doc["step"]`` (``anneal.eval.results``'), replaced whole;
    ``evals/`` a real directory of the run (``anneal.files.real_dir``), never a link."""
    path = real_dir(run_dir, EVALS, make=True) / f"step-{doc['step']}.json"
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n", durable=True)
    return path


def read_eval(run_dir: str | Path, step: int) -> dict | None:
    """``evals/step-<step>.json`` if ``write_eval`` wrote it (of that step, with tasks), or None."""
    return _eval_doc(eval_path(run_dir, step), step)[0]


def read_evals(run_dir: str | Path) -> list[dict]:
    """The run's ``evals/step-<N>.json`` by step ([] without any), read as files from elsewhere:
    one that is not a document of its step (a FIFO, a link, over 8 MiB or 8 levels, not JSON)
    is skipped with a warning naming it (its values: ``anneal.observe.downstream``)."""
    found, directory = [], evals_dir(run_dir)
    for path in directory.iterdir() if directory.is_dir() else []:
        if (m := _EVAL_FILE.fullmatch(path.name)) is None:
            continue
        doc, why = _eval_doc(path, int(m[1]))
        if doc is not None:
            found.append((int(m[1]), doc))
        else:
            log.warning("%s: skipped, not a score document anneal eval writes (%s)", path, why)
    return [doc for _, doc in sorted(found, key=lambda t: t[0])]


def _eval_doc(path: Path, step: int) -> tuple[dict | None, str]:
    try:
        doc = loads_bounded(read_regular(path, limit=1 << 23), max_depth=8)
    except (OSError, ValueError) as e:
        return None, getattr(e, "strerror", None) or str(e)[:200]
    ours = isinstance(doc, dict) and type(doc.get("step")) is int and doc["step"] == step
    if ours and isinstance(doc.get("tasks"), dict):
        return doc, ""
    return None, f"not a JSON object of step {step} with its tasks"


# -- config.json ---------------------------------------------------------------------------------


def read_record(run_dir: str | Path, *, section: str = "run", missing_ok: bool = False):
    """The run's ``config.json`` as a ``RunRecord`` (``anneal.run_record``): a UserError naming
    the file when it cannot be read or is not a run's (a JSON object with a ``section`` object:
    "run" for the launcher and the runs, "model" for the exporter, which needs only the shape).
    When there is none: None with ``missing_ok``, else a UserError. A Hugging Face model
    directory's own ``config.json`` is ``anneal.hf``'s."""
    return RunRecord.from_file(config_path(run_dir), section=section, missing_ok=missing_ok)


def record_or_empty(run_dir: str | Path) -> RunRecord:
    """The run's ``config.json`` when it is a readable JSON object, else an empty record (for
    labels and optional checks that have something else to fall back on)."""
    return RunRecord.lenient(config_path(run_dir))


def write_config(run_dir: str | Path, doc: dict) -> None:
    write_atomic(config_path(run_dir), json.dumps(doc, indent=2) + "\n")


def holds_run(out: Path) -> list[str]:
    """What in ``out`` shows that a run has been there: its config.json, metrics.jsonl or
    guard.json, or anything in checkpoints/ (even a torn save). Empty when none."""
    found = [name for name in MARKS if (out / name).exists()]
    ckpt = checkpoints_dir(out)
    if ckpt.is_dir() and any(ckpt.iterdir()):
        found.append(f"{CHECKPOINTS}/")
    return found


def others_entries(out: Path) -> list[str]:
    """The entries of ``out`` that no run or launcher put there (``LAUNCHER_FILES``, an earlier
    run's ``previous-<time>/``), sorted. For a directory that holds no run (``holds_run``):
    everything in it is someone else's, a ``report.txt`` or ``plots/`` of that name included."""
    try:
        names = sorted(p.name for p in Path(out).iterdir())
    except OSError:
        return []
    return [n for n in names if n not in LAUNCHER_FILES and not n.startswith(PREVIOUS)]


def check_others_entries(out: Path, *, force: bool) -> None:
    """A launch into ``out``, which holds no run (``holds_run``): UserError if it holds anything
    else (``others_entries``), among which the run would write its files (a report.txt of the
    same name, say). ``--force`` allows that, and the run then replaces none of them; but never
    a file where the run makes a directory."""
    others = others_entries(out)
    if not others:
        return
    if not force:
        listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise UserError(
            f"--out {out}: holds files but no run ({listed}), and a run writes config.json, "
            f"metrics.jsonl, checkpoints/, plots/ and report.txt there. Choose a new or empty "
            f"--out, or pass --force to train beside those files (none of them is replaced: a "
            f"report.txt or chart of yours is kept, and the run's is not saved)."
        )
    for name in others:
        if name in RUN_DIRS and not (out / name).is_dir():
            raise UserError(
                f"--out {out}: {name} is a file, where the run makes its {name}/ directory. "
                f"Move it away, or choose another --out."
            )


def written_by_anneal(path: Path) -> bool:
    """Whether the file at ``path`` is one that Anneal wrote and so may replace: a run's health
    report (a ``report.txt`` holding the table of ``anneal.observe.report``, from its first line
    to its count of problems) or a chart (any other name: a PNG that Matplotlib wrote,
    ``anneal.files.is_matplotlib_png``). A link, a directory, or any other file is someone
    else's: a run, ``anneal plot`` and the end of a run never replace it. The one place that
    decides it for the files they replace by name."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    if path.name != REPORT:
        return is_matplotlib_png(path)
    try:
        with open(path, "rb") as f:
            lines = f.read(1 << 20).decode().splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return (
        len(lines) >= 2
        and lines[0].startswith(REPORT_HEAD)
        and _REPORT_TAIL.fullmatch(lines[-1]) is not None
    )


# -- metrics.jsonl -------------------------------------------------------------------------------


def read_metrics(run_dir: str | Path, kind: str | None = None, *, trained=False) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` in order, only those of ``kind`` if given.

    A killed run can leave its last line torn (no newline, not valid JSON); that line is
    skipped with a warning. Any other line that is not a JSON object is a UserError naming the
    file and line, as is a run directory without the file. ``trained``: a run that has not
    taken a step yet (no file, no train row) is a UserError that says so (plots, report).
    """
    path = metrics_path(run_dir)
    if trained and not path.is_file():
        raise UserError(
            f"{run_dir}: no {METRICS} yet. A run writes it from its first step; give the "
            f"run's --out directory, or wait for the first step to finish."
        )
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(
            f"{path}: cannot read it ({e.strerror or e}). Every Anneal run writes "
            f"{METRICS} into its run directory from its first step on; give the directory "
            f"of a run that has trained (the --out of the recipe)."
        ) from None
    rows = _rows(path, data)
    if trained and not any(r.get("kind") == "train" for r in rows):
        raise UserError(
            f"{path}: no train rows yet (the first is written after the first optimizer step). "
            f"Wait for the run to take a step."
        )
    return [r for r in rows if kind is None or r.get("kind") == kind]


def val_sources(val_rows: list[dict]) -> list[str]:
    """The sources with validation figures of their own (a blend's ``val_loss/<source>`` keys,
    ``anneal.train.step.validate``), in the order they first appear."""
    keys = (k for row in val_rows for k in row if k.startswith("val_loss/"))
    return list(dict.fromkeys(k.split("/", 1)[1] for k in keys))


def _rows(path: Path, data: bytes) -> list[dict]:
    lines = data.split(b"\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif number == len(lines):  # no newline after it: a write cut short by a kill
            log.warning("%s: skipping the torn last line %d (the run was killed)", path, number)
        else:
            start = line[:80].decode(errors="replace")
            raise UserError(
                f"{path}, line {number}: not a JSON object ({start!r}). {METRICS} "
                f"holds one JSON object per line, as Anneal writes it; the file was changed "
                f"or damaged by something else. Remove that line or rerun."
            )
    return rows


# -- a launch's writes ---------------------------------------------------------------------------


class RunDir:
    """This launch's writes to the run directory, made once the engine is built and any
    checkpoint loaded, and undone when the launch fails before its first step."""

    def __init__(self, out: Path, config_doc: dict, *, restart: bool = False):
        """Rank 0: with ``restart``, move the run that is there to ``previous-<time>/``; then
        write the resolved config.json. Every rank waits for that, then has checkpoints/."""
        from anneal.dist import barrier, is_main_process

        self.out, self.stepped = Path(out), False
        self._existed: set[str] | None = None
        self._old_config: str | None = None
        if is_main_process():
            if restart:
                move_previous_run(self.out)
            if self.out.is_dir():
                self._existed = {p.name for p in self.out.iterdir()}
                config = config_path(self.out)
                self._old_config = config.read_text() if config.is_file() else None
            make_dir(self.out)
            write_config(self.out, config_doc)
        barrier()
        checkpoints_dir(self.out).mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_launch(cls, launch) -> RunDir:
        """The writes of launch ``launch`` (an ``anneal.resolution.resolve.Launch``)."""
        return cls(launch.out, launch.config_document(), restart=launch.cfg.restart)

    def undo(self) -> None:
        """Rank 0, before any step completed: remove what this launch created in the run
        directory (and the directory, if it made it) and put back the config.json it replaced.
        A run that ``--restart`` moved to ``previous-<time>/`` stays there."""
        from anneal.dist import is_main_process

        if self.stepped or not is_main_process() or not self.out.is_dir():
            return
        try:
            for p in self.out.iterdir():
                if (self._existed is None or p.name not in self._existed) and not (
                    p.name.startswith(PREVIOUS)
                ):
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            if self._old_config is not None:
                write_atomic(config_path(self.out), self._old_config)
            if self._existed is None and not any(self.out.iterdir()):
                self.out.rmdir()
        except OSError as e:  # the failure that got us here is the one to report
            log.warning("could not put %s back as it was: %s", self.out, e)
            return
        log.warning("the run failed before its first step: %s is as it was before", self.out)


def move_previous_run(out: Path) -> Path | None:
    """``--restart``: the run files in ``out`` (``RUN_FILES``) to a new ``out/previous-<time>/``,
    by rename (nothing is copied or deleted)."""
    from anneal.dist import print0

    names = [n for n in RUN_FILES if (out / n).exists() or (out / n).is_symlink()]
    if not names:
        return None
    dest = out / f"{PREVIOUS}{time.strftime('%Y%m%d-%H%M%S')}"
    while dest.exists():
        dest = dest.with_name(dest.name + "-1")
    dest.mkdir()
    for name in names:
        (out / name).rename(dest / name)
    print0(f"--restart: the run that was in {out} ({', '.join(names)}) is now in {dest}")
    return dest
