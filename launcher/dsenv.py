"""``.deepspeed_env``: the environment DeepSpeed's runner exports to every node.

Only names on an allow-list are written (``NCCL_*``, ``HF_*``, ``CUDA_*``, ``TORCH_*``,
``PYTHONPATH``, ``OMP_NUM_THREADS`` and any ``--env NAME``), and of those never a secret: pdsh
puts the values on a command line that other users can read in ``ps`` on every node. Left out,
with their names (never their values) printed by the launcher:
- a name that looks like a secret: ``TOKEN``, ``KEY``, ``SECRET``, ``PASSW``, ``PASSPHRASE``,
  ``CRED`` (``CREDS``, ``CREDENTIAL``), ``AUTH``, ``BEARER``, ``LOGIN``, ``PRIVATE``,
  ``SESSION``, ``COOKIE`` or ``JWT`` anywhere in it, or ``PASS``, ``PWD``, ``PW`` or ``PAT`` as
  a part between underscores (``HF_PWD``, ``HF_HUB_PAT``; ``PATH`` and the shell's own ``PWD``
  and ``OLDPWD`` are not secrets);
- a value that carries a credential: ``user:password@`` or any ``scheme://user@`` (a token in
  a URL, ``HF_ENDPOINT=https://user:pass@host``);
- a value that the remote shell would expand or split: a control character (a newline), or
  ``$``, a backquote, ``"`` or ``\\``, which stay live inside the double quotes DeepSpeed puts
  around a value.

Two files, both mode 0600, in the run directory:
- ``.deepspeed_env``: for people. A hand-written file there (or, the first time, one in the
  current directory) keeps its lines and ``#`` comments; a name it sets wins over the
  environment, and allow-listed names it lacks are appended. Its secrets are commented out.
- ``.deepspeed_env.runner``: what DeepSpeed reads (``DS_ENV_FILE``). DeepSpeed 0.19's reader
  splits every line at ``=``, so a blank or ``#`` line would crash it, and ``# a=b`` would export
  ``# a`` and comment out the rest of the remote command; this copy has ``NAME=value`` lines
  only. Values are written as they are: DeepSpeed wraps a value with any character outside
  ``[A-Za-z0-9_@%+=:,./-]`` in double quotes itself (``export NAME="a b";``), so a quoted
  value here would reach the ranks with its quotes.

DeepSpeed's runner also exports, by itself, every variable of its own environment whose name
starts with ``MLFLOW``, ``PYTHON``, ``MV2``, ``UCX`` or ``NCCL``: for a pdsh launch the launcher
starts it without those of them that would be left out here (``runner_environ``).
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path

from anneal.errors import UserError
from anneal.files import make_dir

ALLOW_PREFIXES = ("NCCL_", "HF_", "CUDA_", "TORCH_")
ALLOW_NAMES = ("PYTHONPATH", "OMP_NUM_THREADS")
DEEPSPEED_EXPORTS = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
"""Prefixes DeepSpeed 0.19's runner exports from its own environment (runner.py EXPORT_ENVS
and the CUDA accelerator's ``export_envs``)."""
_SECRET_WORDS = re.compile(
    r"TOKEN|KEY|SECRET|PASSW|PASSPHRASE|CRED|AUTH|BEARER|LOGIN|PRIVATE|SESSION|COOKIE|JWT",
    re.IGNORECASE,
)
_SECRET_PARTS = re.compile(r"(?:^|_)(?:PASS|PWD|PW|PAT)(?:_|$)", re.IGNORECASE)
NOT_SECRETS = ("PWD", "OLDPWD")
"""The shell's working directories, not passwords."""
_CREDENTIAL = re.compile(r"[^\s/@:]*:[^\s/@]*@|://[^\s/@]+@")
_EXPANDED = '$`"\\'
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
FILE = ".deepspeed_env"
RUNNER_FILE = ".deepspeed_env.runner"
KEEP_SECRETS_HINT = (
    "pdsh puts these values on every node's command line (visible in ps): give the job what it "
    "needs through a file only it can read (e.g. ~/.cache/huggingface/token), or a value "
    "without such characters"
)


def is_secret_name(name: str) -> bool:
    """Does ``name`` look like the name of a secret (module docstring)?"""
    if name.upper() in NOT_SECRETS:
        return False
    return bool(_SECRET_WORDS.search(name) or _SECRET_PARTS.search(name))


def why_left_out(name: str, value: str) -> str | None:
    """Why ``name=value`` stays out of what the other nodes receive, or None. Never quotes the
    value."""
    if is_secret_name(name):
        return "a secret's name"
    if _CREDENTIAL.search(value):
        return "a user:password@ credential in its value"
    for ch in value:
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp"):
            return "a control character in its value"
        if ch in _EXPANDED:
            return f"{ch!r} in its value, which the remote shell would expand"
    return None


def _allowed(name: str, extra) -> bool:
    return (name in extra or name in ALLOW_NAMES or name.startswith(ALLOW_PREFIXES)) and bool(
        _NAME.fullmatch(name)
    )


def select(environ: dict[str, str], extra: list[str] = ()) -> dict[str, str]:
    """The allow-listed variables of ``environ`` (sorted by name) plus the ``--env`` names,
    without those ``why_left_out`` names. A ``--env`` name that would be left out is refused."""
    for name in extra:
        if not _NAME.fullmatch(name):
            raise UserError(f"--env {name!r}: not a variable name (letters, digits, '_').")
        if name not in environ:
            raise UserError(f"--env {name}: not set in this environment; export it first.")
        why = why_left_out(name, environ[name])
        if why == "a secret's name":
            raise UserError(
                f"--env {name}: looks like a secret, and .deepspeed_env values end up on the "
                f"command line of every node (visible in ps). Put it in a file only the job "
                f"can read (e.g. ~/.cache/huggingface/token) instead."
            )
        if why:
            raise UserError(
                f"--env {name}: the launcher will not pass it: {why}. {KEEP_SECRETS_HINT}."
            )
    return {
        k: environ[k]
        for k in sorted(environ)
        if _allowed(k, extra) and why_left_out(k, environ[k]) is None
    }


def left_out(environ: dict[str, str], extra: list[str] = (), *, hand_written: str = "") -> dict:
    """Name -> why, for the allow-listed variables of ``environ`` and the ``NAME=`` lines of a
    hand-written ``.deepspeed_env`` that the other nodes will not receive (names only)."""
    out = {}
    for k in sorted(environ):
        if _allowed(k, extra) and (why := why_left_out(k, environ[k])):
            out[k] = why
    for line in hand_written.splitlines():
        if (m := _ASSIGN.match(line)) and (why := why_left_out(m[1], _unquote(m[2]))):
            out[m[1]] = why
    return out


def describe_left_out(names: dict[str, str]) -> str:
    """One line for the launcher to print, or "" when nothing was left out."""
    if not names:
        return ""
    listed = ", ".join(f"{k} ({why})" for k, why in names.items())
    return f"note: not passed to the other nodes through {FILE}: {listed}. {KEEP_SECRETS_HINT}."


def runner_environ(environ: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the environment to start DeepSpeed's runner with for a pdsh launch, name -> why for
    what it leaves out): ``environ`` without the variables the runner would export itself
    (``DEEPSPEED_EXPORTS``) that ``why_left_out`` names."""
    gone = {
        k: why
        for k, v in sorted(environ.items())
        if k.startswith(DEEPSPEED_EXPORTS)
        and (why := why_left_out(k, v) if _NAME.fullmatch(k) else "not a plain variable name")
    }
    return {k: v for k, v in environ.items() if k not in gone}, gone


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    return value


def merge(existing: str, values: dict[str, str]) -> str:
    """``existing`` (hand-written: kept line by line, comments too, secrets commented out)
    plus ``values`` it does not already set."""
    lines = []
    for line in existing.splitlines():
        m = _ASSIGN.match(line)
        why = m and why_left_out(m[1], _unquote(m[2]))
        if why in ("a secret's name", "a user:password@ credential in its value"):
            line = f"# {m[1]}=... removed by python -m launcher: secrets do not go in this file"
        lines.append(line)
    have = {m[1] for line in lines if (m := _ASSIGN.match(line))}
    added = [f"{k}={v}" for k, v in values.items() if k not in have]
    if added and lines:
        added.insert(0, "# added by python -m launcher from this environment (allow-list):")
    return "".join(line + "\n" for line in [*lines, *added])


def runner_copy(text: str) -> str:
    """NAME=value lines only, values as DeepSpeed's runner wants them (unquoted: it adds the
    quotes); everything ``why_left_out`` names dropped."""
    out = []
    for line in text.splitlines():
        m = _ASSIGN.match(line)
        if m and why_left_out(m[1], value := _unquote(m[2])) is None:
            out.append(f"{m[1]}={value}\n")
    return "".join(out)


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def hand_written(run_dir: Path, *, cwd: Path | None = None) -> str:
    """The hand-written ``.deepspeed_env`` the launcher starts from: the run directory's, else
    (the first time) the current directory's, else ""."""
    for source in (Path(run_dir) / FILE, Path(cwd or Path.cwd()) / FILE):
        if source.is_file():
            try:
                return source.read_text()
            except (OSError, UnicodeDecodeError) as e:
                why = e.strerror if isinstance(e, OSError) else f"not UTF-8 text at byte {e.start}"
                raise UserError(
                    f"{source}: cannot read it ({why}). Fix it (lines NAME=value) or remove it; "
                    f"the launcher starts {FILE} from it."
                ) from None
    return ""


def contents(run_dir: Path, values: dict[str, str], *, cwd: Path | None = None) -> str:
    """What ``write`` puts in ``run_dir/.deepspeed_env`` (for the dry run too)."""
    return merge(hand_written(run_dir, cwd=cwd), values)


def write(run_dir: Path, values: dict[str, str], *, cwd: Path | None = None) -> Path:
    """Write both files; returns the one for DeepSpeed's runner (its ``DS_ENV_FILE``)."""
    run_dir = make_dir(Path(run_dir))
    text = contents(run_dir, values, cwd=cwd)
    _write_private(run_dir / FILE, text)
    _write_private(run_dir / RUNNER_FILE, runner_copy(text))
    return (run_dir / RUNNER_FILE).resolve()
