"""Slurm: compressed node lists, and the sbatch script that ``python -m launcher submit``
renders from ``launcher/templates/`` and hands to ``sbatch``.

Node lists are Slurm's compressed form, e.g. ``gpu[001-003,007],cpu-a[1-2]-ib``: names
separated by commas outside brackets; each name is literal text and bracket groups of ranges
(``001-003``, zero padding kept from the first bound) and single values, expanded left to right
with the last group varying fastest (as ``scontrol show hostnames`` does).
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import unicodedata
from pathlib import Path

from anneal.errors import UserError

TEMPLATES = Path(__file__).resolve().parent / "templates"
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TEXT = re.compile(r"[A-Za-z0-9_.\-]*")


def _bad(nodelist: str, why: str) -> UserError:
    return UserError(
        f"node list {nodelist!r} does not parse: {why}. Expected Slurm's form, e.g. "
        f"'gpu[001-003,007],cpu-a[1-2]-ib' (what SLURM_JOB_NODELIST holds)."
    )


def _split_top(nodelist: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _bad(nodelist, "a '[' inside brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _bad(nodelist, "a ']' without its '['")
        elif ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise _bad(nodelist, "a '[' without its ']'")
    parts.append(nodelist[start:])
    return [p for p in parts if p.strip()]


def _group(nodelist: str, body: str) -> list[str]:
    values = []
    for item in body.split(","):
        m = _RANGE.fullmatch(item.strip())
        if not m:
            raise _bad(nodelist, f"[{body}] holds {item!r}, not a number or a range 'A-B'")
        lo, hi = m[1], m[2] if m[2] is not None else m[1]
        if int(hi) < int(lo):
            raise _bad(nodelist, f"the range {item} runs backwards")
        if int(hi) - int(lo) >= 100_000:
            raise _bad(nodelist, f"the range {item} has more than 100,000 values")
        width = len(lo) if lo.startswith("0") else 0
        values += [str(v).zfill(width) for v in range(int(lo), int(hi) + 1)]
    return values


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a compressed node list, in order; UserError when it does not parse."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise _bad(nodelist, "it is empty")
    hosts: list[str] = []
    for name in _split_top(nodelist):
        pieces: list[list[str]] = []
        for m in re.finditer(r"([^\[\]]*)(?:\[([^\]]*)\])?", name.strip()):
            text, body = m[1], m[2]
            if not _TEXT.fullmatch(text):
                raise _bad(nodelist, f"{text!r} has characters other than letters, digits, .-_")
            if text:
                pieces.append([text])
            if body is not None:
                pieces.append(_group(nodelist, body))
        hosts += ["".join(p) for p in itertools.product(*pieces)]
    seen = set()
    for h in hosts:
        if h in seen:
            raise _bad(nodelist, f"host {h} appears twice")
        seen.add(h)
    return hosts


def scontrol_hostnames(nodelist: str) -> list[str] | None:
    """``scontrol show hostnames``' expansion (the reference), or None where scontrol is absent
    or refuses the list."""
    if not shutil.which("scontrol"):
        return None
    try:
        done = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or "Invalid hostlist" in done.stdout + done.stderr:
        return None
    return done.stdout.split()


# ---------------------------------------------------------------------------------------------
# sbatch

MAX_SIGNAL_S = 65535
"""Slurm's limit on ``--signal=...@SECONDS``."""
RUN_DIR_REFUSED = "%\"'\\#"
_RUN_DIR_WHY = (
    "the sbatch script's `#SBATCH --output=` line and srun's --output carry the run directory, "
    "and Slurm reads '%' there as a file-name pattern (%j, %n) and quotes, '\\' and '#' as "
    "its own syntax. Choose an --out without these characters"
)


def check_plain(value: str, *, what: str, why: str, also: str = "") -> str:
    """``value`` if it holds no control character (newline, tab, ...) and none of ``also``;
    otherwise a UserError: ``what`` holds CHARACTER: ``why``."""
    for ch in value:
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in also:
            raise UserError(f"{what} holds {ch!r}: {why}.")
    return value


def time_limit_s(time: str) -> int | None:
    """Seconds of a Slurm time limit in one of the forms ``--time`` takes (``MM``,
    ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``); None for ``0`` (no limit) or a form
    it does not read."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d\d))?(?::(\d\d))?", time, re.ASCII)
    if not m:
        return None
    days, first, second, third = (int(g) if g else 0 for g in m.groups())
    if m[1] is None and m[3] is None:  # minutes
        seconds = 60 * first
    elif m[1] is None and m[4] is None:  # MM:SS
        seconds = 60 * first + second
    else:  # [D-]HH[:MM[:SS]]
        seconds = 86400 * days + 3600 * first + 60 * second + third
    return seconds or None


def _check_job(
    *,
    time: str,
    nodes: int,
    gpus_per_node: int,
    partition: str,
    account: str | None,
    grace_s: int,
    master_port: int,
) -> None:
    """The job's request as Slurm and the rendezvous read it: the time limit in one of Slurm's
    forms, counts of at least 1, names from a safe alphabet, the signal's lead and the port in
    range."""
    if not re.fullmatch(r"\d+:\d\d:\d\d|\d+-\d+(:\d\d(:\d\d)?)?|\d+", time, re.ASCII):
        raise UserError(f"--time {time!r}: give HH:MM:SS (e.g. 04:00:00) or D-HH[:MM[:SS]].")
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be at least 1.")
    for flag, value in (("--partition", partition), ("--account", account or "x")):
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", value):
            raise UserError(f"{flag} {value!r}: letters, digits, '.', '-' and '_' only.")
    if not 1 <= grace_s <= MAX_SIGNAL_S:
        raise UserError(
            f"--grace-s {grace_s}: Slurm sends the preemption signal 1..{MAX_SIGNAL_S} s "
            f"before the time limit. Give a number of seconds in that range (or leave it out)."
        )
    limit_s = time_limit_s(time)
    if limit_s is not None and grace_s >= limit_s:
        raise UserError(
            f"--grace-s {grace_s}: the job's --time {time} is {limit_s} s, so the preemption "
            f"signal would come before the job starts. Give a --grace-s under {limit_s} s (the "
            f"time of one step and one checkpoint save, docs/cluster.md), or a longer --time."
        )
    if not 1 <= master_port <= 65535:
        raise UserError(f"--master-port {master_port}: a TCP port is 1..65535, e.g. 29500.")


def _check_command(*, run_dir: Path, workdir: Path, python: str, args: list[str]) -> None:
    """What the script carries on its lines (the run directory, the working directory, the
    Python, the recipe and its arguments) holds no control character, and the run directory
    none of what Slurm reads in ``--output`` itself (RUN_DIR_REFUSED)."""
    check_plain(
        str(run_dir), what=f"--out {str(run_dir)!r}", also=RUN_DIR_REFUSED, why=_RUN_DIR_WHY
    )
    check_plain(str(workdir), what=f"the working directory {str(workdir)!r}", why=_CD_WHY)
    check_plain(python, what=f"the Python {python!r}", why=_PYTHON_WHY)
    for arg in args:
        check_plain(arg, what=f"recipe argument {arg!r}", why=_LINE_WHY)


_CD_WHY = "the script `cd`s there. Run from a directory without one (rename it)"
_PYTHON_WHY = "the script runs it by path. Use a virtual environment at a plain path"
_LINE_WHY = "the script carries the command on one line. Remove it"


DEFAULT_GRACE_S = 120
WRITE_BYTES_PER_S = 200e6


def default_grace_s(*, step_s: float, checkpoint_bytes: int, time: str) -> tuple[int, str]:
    """(seconds, note) of the preemption signal's lead when ``--grace-s`` is not given: two
    forecast steps, one checkpoint save at WRITE_BYTES_PER_S and 30 s of exit, at least
    DEFAULT_GRACE_S; at most Slurm's limit and half the job's ``time``. The note (else "")
    says when that bound cut the lead short of what the forecast asks for."""
    want = max(DEFAULT_GRACE_S, int(2 * step_s + checkpoint_bytes / WRITE_BYTES_PER_S) + 30)
    limit_s = time_limit_s(time)
    bound = min(MAX_SIGNAL_S, max(1, limit_s // 2) if limit_s else MAX_SIGNAL_S)
    if want <= bound:
        return want, ""
    return bound, (
        f"note: the forecast asks for {want} s between the preemption signal and the time "
        f"limit (two steps, one checkpoint save, the exit), more than the {bound} s that "
        f"--time {time} and Slurm allow; the signal comes {bound} s before the end. Give a "
        f"longer --time, or measure the save and pass --grace-s (docs/cluster.md)."
    )


def render_sbatch(
    *,
    template: str = "multinode.sbatch",
    job_name: str,
    nodes: int,
    gpus_per_node: int,
    gpus: bool = True,
    partition: str,
    time: str,
    account: str | None,
    grace_s: int,
    run_dir: Path,
    workdir: Path,
    python: str,
    recipe: str,
    recipe_args: list[str],
    master_port: int = 29500,
    log_name: str = "slurm",
) -> str:
    """The batch script: the template with its ``{{NAME}}`` fields filled in; Slurm writes the
    script's output to ``RUN/logs/<log_name>-<job id>.out``.

    Every value is checked or quoted: numbers in range, names from a safe alphabet, paths and
    recipe flags shell-quoted and free of control characters, and the run directory (which
    the ``#SBATCH --output=`` line and srun's ``--output`` carry) also free of what Slurm reads
    there itself: ``%`` patterns, quotes, ``\\`` and ``#``.
    """
    _check_job(
        time=time,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        partition=partition,
        account=account,
        grace_s=grace_s,
        master_port=master_port,
    )
    _check_command(run_dir=run_dir, workdir=workdir, python=python, args=[recipe, *recipe_args])
    run_dir = Path(run_dir)
    fields = {
        "JOB_NAME": re.sub(r"[^A-Za-z0-9_.\-]", "_", job_name),
        "NODES": str(nodes),
        "GPUS_PER_NODE": str(gpus_per_node),
        "GPU_LINE": f"#SBATCH --gpus-per-node={gpus_per_node}\n" if gpus else "",
        "PARTITION": partition,
        "TIME": time,
        "ACCOUNT_LINE": f"#SBATCH --account={account}\n" if account else "",
        "GRACE_S": str(grace_s),
        "RUN_DIR": shlex.quote(str(run_dir)),
        "RUN_DIR_SLURM": f'"{run_dir}/logs/{log_name}-%j.out"',
        "WORKDIR": shlex.quote(str(workdir)),
        "PYTHON": shlex.quote(python),
        "DEEPSPEED": shlex.quote(str(Path(python).parent / "deepspeed")),
        "MASTER_PORT": str(master_port),
        "RECIPE_CMD": shlex.join([recipe, *recipe_args]),
    }
    text = (TEMPLATES / template).read_text()
    for key, value in fields.items():
        text = text.replace("{{" + key + "}}", value)
    left = re.findall(r"\{\{[A-Z_]+\}\}", text)
    assert not left, f"template {template} has unfilled fields {left}"
    return text


PREPARE_STEPS = {  # aligned by hand: a row per step (title, command line's addition, log)
    "plan": ("step 1 of 3, the plan and the tokenizer", "", "plan-%j.out"),
    "tasks": ("step 2 of 3, one task of the array", ' --task "$SLURM_ARRAY_TASK_ID"',
              "task-%a-%A.out"),
    "merge": ("step 3 of 3, the merge and its verification", " --merge", "merge-%j.out"),
}  # fmt: skip
"""Per step of a preparation in tasks: its title, what its command line adds, its log's name."""


def render_prepare(
    *,
    step: str,
    job_name: str,
    tasks: int,
    partition: str,
    time: str,
    account: str | None,
    logs: Path,
    workdir: Path,
    python: str,
    prepare_args: list[str],
) -> str:
    """One step's batch script (``launcher/templates/prepare.sbatch``). As for training
    (:func:`render_sbatch`), every value is checked or quoted: the logs' directory (on the
    ``#SBATCH --output=`` line) free of what Slurm reads there, paths and the prepare flags
    shell-quoted and free of control characters."""
    _check_job(
        time=time,
        nodes=1,
        gpus_per_node=1,
        partition=partition,
        account=account,
        grace_s=1,
        master_port=1,
    )
    check_plain(
        str(logs),
        what=f"--out's parts directory {str(logs.parent.parent)!r}",
        also=RUN_DIR_REFUSED,
        why="the scripts' `#SBATCH --output=` lines carry its logs' directory, and Slurm reads "
        "'%' there as a file-name pattern (%j, %a) and quotes, '\\' and '#' as its own syntax. "
        "Choose an --out without these characters",
    )
    check_plain(str(workdir), what=f"the working directory {str(workdir)!r}", why=_CD_WHY)
    check_plain(python, what=f"the Python {python!r}", why=_PYTHON_WHY)
    for arg in prepare_args:
        check_plain(arg, what=f"prepare flag {arg!r}", why=_LINE_WHY)
    title, step_args, log_name = PREPARE_STEPS[step]
    fields = {
        "STEP": step,
        "STEP_TITLE": title,
        "TASKS": str(tasks),
        "JOB_NAME": re.sub(r"[^A-Za-z0-9_.\-]", "_", job_name),
        "PARTITION": partition,
        "TIME": time,
        "ACCOUNT_LINE": f"#SBATCH --account={account}\n" if account else "",
        "EXTRA_LINE": "#SBATCH --kill-on-invalid-dep=yes\n" if step != "plan" else "",
        "OUTPUT": f'"{logs}/{log_name}"',
        "WORKDIR": shlex.quote(str(workdir)),
        "PYTHON": shlex.quote(python),
        "PREPARE_CMD": shlex.join([*prepare_args, "--tasks", str(tasks)]),
        "STEP_ARGS": step_args,
    }
    text = (TEMPLATES / "prepare.sbatch").read_text()
    for key, value in fields.items():
        text = text.replace("{{" + key + "}}", value)
    left = re.findall(r"\{\{[A-Z_]+\}\}", text)
    assert not left, f"template prepare.sbatch has unfilled fields {left}"
    return text


def sbatch_parsable(script: Path, *options: str) -> str:
    """Submit ``script`` with ``options`` (``--array``, ``--dependency``); returns the job id."""
    exe = shutil.which("sbatch")
    if exe is None:
        raise UserError(
            "sbatch is not on PATH: run `python -m launcher submit-prepare` on a Slurm login "
            "node, or use --dry-run to write the scripts only."
        )
    cmd = [exe, "--parsable", *options, str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        raise UserError(f"{shlex.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]


def array_spec(tasks: list[int]) -> str:
    """Slurm's ``--array`` list of task ids, runs of consecutive ids as ranges: ``0-2,5``."""
    runs: list[list[int]] = []
    for t in sorted(tasks):
        if runs and t == runs[-1][1] + 1:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def sbatch(script: Path) -> str:
    """Submit; returns sbatch's output (``Submitted batch job N``)."""
    exe = shutil.which("sbatch")
    if exe is None:
        raise UserError(
            "sbatch is not on PATH: run `python -m launcher submit` on a Slurm login node, or "
            "use --dry-run to write the script only."
        )
    done = subprocess.run([exe, str(script)], capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        raise UserError(f"sbatch {script} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip()
