"""``.deepspeed_env``: the environment DeepSpeed's runner exports to every node.

Only names on an allow-list are written (``NCCL_*``, ``HF_*``, ``CUDA_*``, ``TORCH_*``,
``PYTHONPATH``, ``OMP_NUM_THREADS`` and any ``--env NAME``), never one that looks like a secret
(``TOKEN``, ``KEY``, ``SECRET``, ``PASSW``, ``CREDENTIAL``, ``AUTH`` in the name): pdsh puts the
values on a command line that other users can read in ``ps`` on every node.

Two files, both mode 0600, in the run directory:
- ``.deepspeed_env``: for people. A hand-written file there (or, the first time, one in the
  current directory) keeps its lines and ``#`` comments; a name it sets wins over the
  environment, and allow-listed names it lacks are appended.
- ``.deepspeed_env.runner``: what DeepSpeed reads (``DS_ENV_FILE``). DeepSpeed 0.19's reader
  splits every line at ``=``, so a blank or ``#`` line would crash it, and ``# a=b`` would export
  ``# a`` and comment out the rest of the remote command; this copy has ``NAME=value`` lines
  only, values shell-quoted because pdsh runs ``export NAME=value;`` in a shell.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from anneal.errors import UserError

ALLOW_PREFIXES = ("NCCL_", "HF_", "CUDA_", "TORCH_")
ALLOW_NAMES = ("PYTHONPATH", "OMP_NUM_THREADS")
SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
FILE = ".deepspeed_env"
RUNNER_FILE = ".deepspeed_env.runner"


def select(environ: dict[str, str], extra: list[str] = ()) -> dict[str, str]:
    """The allow-listed variables of ``environ`` (sorted by name) plus the ``--env`` names."""
    for name in extra:
        if not _NAME.match(name):
            raise UserError(f"--env {name!r}: not a variable name (letters, digits, '_').")
        if SECRET.search(name):
            raise UserError(
                f"--env {name}: looks like a secret, and .deepspeed_env values end up on the "
                f"command line of every node (visible in ps). Put it in a file only the job "
                f"can read (e.g. ~/.cache/huggingface/token) instead."
            )
        if name not in environ:
            raise UserError(f"--env {name}: not set in this environment; export it first.")
    return {
        k: environ[k]
        for k in sorted(environ)
        if (k in extra or k in ALLOW_NAMES or k.startswith(ALLOW_PREFIXES))
        and not SECRET.search(k)
        and _NAME.match(k)
        and "\n" not in environ[k]
    }


def merge(existing: str, values: dict[str, str]) -> str:
    """``existing`` (hand-written: kept line by line, comments too) plus ``values`` it does not
    already set."""
    lines = [
        f"# {m[1]}=... removed by python -m launcher: secrets do not go in this file"
        if (m := _ASSIGN.match(line)) and SECRET.search(m[1])
        else line
        for line in existing.splitlines()
    ]
    have = {m[1] for line in lines if (m := _ASSIGN.match(line))}
    added = [f"{k}={v}" for k, v in values.items() if k not in have]
    if added and lines:
        added.insert(0, "# added by python -m launcher from this environment (allow-list):")
    return "".join(line + "\n" for line in [*lines, *added])


def runner_copy(text: str) -> str:
    """NAME=value lines only, values quoted for pdsh's shell; secrets dropped."""
    out = []
    for line in text.splitlines():
        m = _ASSIGN.match(line)
        if m and not SECRET.search(m[1]):
            value = m[2].strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            out.append(f"{m[1]}={shlex.quote(value)}\n")
    return "".join(out)


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def contents(run_dir: Path, values: dict[str, str], *, cwd: Path | None = None) -> str:
    """What ``write`` puts in ``run_dir/.deepspeed_env`` (for the dry run too)."""
    for source in (Path(run_dir) / FILE, Path(cwd or Path.cwd()) / FILE):
        if source.is_file():
            return merge(source.read_text(), values)
    return merge("", values)


def write(run_dir: Path, values: dict[str, str], *, cwd: Path | None = None) -> Path:
    """Write both files; returns the one for DeepSpeed's runner (its ``DS_ENV_FILE``)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = contents(run_dir, values, cwd=cwd)
    _write_private(run_dir / FILE, text)
    _write_private(run_dir / RUNNER_FILE, runner_copy(text))
    return (run_dir / RUNNER_FILE).resolve()
