"""DeepSpeed hostfiles: ``host slots=N`` per line, ``#`` comments.

Parsing is strict so that a typo fails on the launch host, with the line number, instead of as
a hang on the cluster. Host names are limited to letters, digits, ``.``, ``-`` and ``_``: pdsh
puts them into a shell command line, so anything else could run on the launch host.

``python -m launcher hostfile`` checks everything before it writes, writes atomically, and
replaces an existing file only with ``--force`` and only when that file is a hostfile itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from anneal.errors import UserError
from anneal.files import check_creatable, write_atomic

HOST = re.compile(r"[A-Za-z0-9_.\-]+")
_LINE = re.compile(r"(?P<host>\S+)\s+slots=(?P<slots>\S+)")
_SLOTS = re.compile(r"[0-9]+")
MAX_HOST_CHARS = 253
"""The longest DNS name."""
MAX_SLOTS = 1024
"""More devices than any node has: a larger ``slots`` is a typo, not a node."""
MAX_BYTES = 1 << 20
"""A hostfile of a million bytes is already 40,000 hosts; a larger file is not a hostfile."""


def check_host(host: str, *, where: str) -> str:
    """``host`` if it is a safe host name; UserError naming ``where`` otherwise."""
    if not HOST.fullmatch(host) or host.startswith("-"):
        raise UserError(
            f"{where}: host name {host!r} has characters other than letters, digits, '.', '-' "
            f"and '_' (or starts with '-'). pdsh passes host names to a shell, so Anneal "
            f"refuses them: use the name as `hostname` or your DNS gives it."
        )
    if len(host) > MAX_HOST_CHARS:
        raise UserError(
            f"{where}: host name {host[:40]!r}... is {len(host)} characters, longer than any "
            f"DNS name ({MAX_HOST_CHARS}): use the name as `hostname` or your DNS gives it."
        )
    return host


def check_slots(slots: int, *, where: str) -> int:
    """``slots`` if it is a plausible number of devices on one host."""
    if slots < 1:
        raise UserError(
            f"{where}: {slots} slots: a host needs at least 1 slot (one per GPU it runs). "
            f"Give the number of GPUs on the host, e.g. 8."
        )
    if slots > MAX_SLOTS:
        raise UserError(
            f"{where}: {slots} slots: more than {MAX_SLOTS}, more devices than any node has. "
            f"Give the number of GPUs on the host, e.g. 8."
        )
    return slots


def parse_text(text: str, *, source: str) -> dict[str, int]:
    """Host -> slots, in file order. UserError names ``source`` and the line."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {source}, line {number}"
        m = _LINE.fullmatch(line)
        if not m or not _SLOTS.fullmatch(m["slots"]):
            raise UserError(
                f"{where}: {raw.strip()[:80]!r} is not 'HOST slots=N' (e.g. 'gpu001 slots=8')."
            )
        host = check_host(m["host"], where=where)
        slots = check_slots(int(m["slots"]), where=where)
        if host in hosts:
            raise UserError(f"{where}: host {host!r} is listed twice. Keep one line per host.")
        hosts[host] = slots
    if not hosts:
        raise UserError(f"hostfile {source}: no hosts. Add lines like 'gpu001 slots=8'.")
    return hosts


def parse(path: str | Path) -> dict[str, int]:
    """Host -> slots of the hostfile at ``path``, in file order. UserError names the file and
    line."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise UserError(
            f"hostfile {path}: not a regular file (a directory or a device). Give the path "
            f"of a hostfile, e.g. hostfiles/loopback."
        )
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise UserError(f"hostfile {path}: cannot read it ({e.strerror}).") from None
    if len(data) > MAX_BYTES:
        raise UserError(
            f"hostfile {path}: larger than {MAX_BYTES:,} bytes, so not a hostfile. Give the "
            f"path of a hostfile (lines like 'gpu001 slots=8')."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"hostfile {path}: not UTF-8 text (byte {e.start}), so not a hostfile. Give the "
            f"path of a hostfile (lines like 'gpu001 slots=8')."
        ) from None
    return parse_text(text, source=str(path))


def render(hosts: dict[str, int]) -> str:
    return "".join(f"{host} slots={slots}\n" for host, slots in hosts.items())


def _claim(path: Path, *, force: bool) -> None:
    """May ``path`` be written? Only a new file, or with ``force`` an existing hostfile."""
    if path.is_dir() and not path.is_symlink():
        raise UserError(
            f"--out {path}: a directory is there, and the hostfile command writes a file. "
            f"Name a file, e.g. --out {path / 'hostfile'}."
        )
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise UserError(
            f"--out {path}: a link or a special file is there, and the hostfile command never "
            f"replaces one. Name a new file for the hostfile."
        )
    if path.exists():
        if not force:
            raise UserError(
                f"--out {path}: exists. Choose a new file, or pass --force to replace it "
                f"(only a file that is itself a hostfile is replaced)."
            )
        try:
            parse(path)
        except UserError as e:
            raise UserError(
                f"--out {path}: exists and is not a hostfile ({e}), so --force will not "
                f"replace it. Choose a new file, or move that one away yourself."
            ) from None
    check_creatable(path)


def write(path: str | Path, hosts: dict[str, int], *, force: bool = False) -> None:
    """Write the hostfile for ``hosts`` at ``path``, after checking everything: the hosts and
    slots, and that ``path`` is new (or, with ``force``, an existing hostfile). The file is
    replaced atomically: a reader sees the old one or the new one."""
    path = Path(path)
    text = render({check_host(h, where=f"hostfile {path}"): s for h, s in hosts.items()})
    parse_text(text, source=str(path))
    _claim(path, force=force)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    except OSError as e:
        raise UserError(f"--out {path}: cannot write it ({e.strerror}).") from None


def from_slurm(environ: dict | None = None, *, slots: int | None = None) -> dict[str, int]:
    """The hosts of the current Slurm allocation: ``SLURM_JOB_NODELIST`` expanded, with
    ``slots`` GPUs each, or ``SLURM_GPUS_ON_NODE`` when ``slots`` is None."""
    from launcher import slurm

    environ = os.environ if environ is None else environ
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise UserError(
            "--from-slurm: SLURM_JOB_NODELIST is not set, so this is not inside a Slurm "
            "allocation. Run it in the batch script or under salloc, or use --hosts."
        )
    where = "--slots"
    if slots is None:
        where = "SLURM_GPUS_ON_NODE"
        gpus = environ.get("SLURM_GPUS_ON_NODE", "")
        if not _SLOTS.fullmatch(gpus):
            raise UserError(
                "--from-slurm: SLURM_GPUS_ON_NODE is not set (the job asked for no GPUs "
                "with --gpus-per-node or --gres): give --slots N."
            )
        slots = int(gpus)
    check_slots(slots, where=where)
    names = slurm.expand_nodelist(nodelist)
    return {check_host(h, where="SLURM_JOB_NODELIST"): slots for h in names}
