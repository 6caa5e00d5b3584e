"""DeepSpeed hostfiles: ``host slots=N`` per line, ``#`` comments.

Parsing is strict so that a typo fails on the launch host, with the line number, instead of as
a hang on the cluster. Host names are limited to letters, digits, ``.``, ``-`` and ``_``: pdsh
puts them into a shell command line, so anything else could run on the launch host.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from anneal.errors import UserError

HOST = re.compile(r"^[A-Za-z0-9_.\-]+$")
_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S+)$")


def check_host(host: str, *, where: str) -> str:
    """``host`` if it is a safe host name; UserError naming ``where`` otherwise."""
    if not HOST.match(host) or host.startswith("-"):
        raise UserError(
            f"{where}: host name {host!r} has characters other than letters, digits, '.', '-' "
            f"and '_' (or starts with '-'). pdsh passes host names to a shell, so Anneal "
            f"refuses them: use the name as `hostname` or your DNS gives it."
        )
    return host


def parse(path: str | Path) -> dict[str, int]:
    """Host -> slots, in file order. UserError names the file and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"hostfile {path}: cannot read it ({e.strerror}).") from None
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {path}, line {number}"
        m = _LINE.match(line)
        if not m or not m["slots"].isdigit():
            raise UserError(
                f"{where}: {raw.strip()!r} is not 'HOST slots=N' (e.g. 'gpu001 slots=8')."
            )
        host, slots = check_host(m["host"], where=where), int(m["slots"])
        if host in hosts:
            raise UserError(f"{where}: host {host!r} is listed twice.")
        if slots < 1:
            raise UserError(f"{where}: slots must be at least 1.")
        hosts[host] = slots
    if not hosts:
        raise UserError(f"hostfile {path}: no hosts. Add lines like 'gpu001 slots=8'.")
    return hosts


def render(hosts: dict[str, int]) -> str:
    return "".join(f"{host} slots={slots}\n" for host, slots in hosts.items())


def write(path: str | Path, hosts: dict[str, int]) -> None:
    for host in hosts:
        check_host(host, where=f"hostfile {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(hosts))


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
    if slots is None:
        gpus = environ.get("SLURM_GPUS_ON_NODE", "")
        if not gpus.isdigit():
            raise UserError(
                "--from-slurm: SLURM_GPUS_ON_NODE is not set (the job asked for no GPUs "
                "with --gpus-per-node or --gres): give --slots N."
            )
        slots = int(gpus)
    if slots < 1:
        raise UserError(f"--slots {slots}: must be at least 1.")
    names = slurm.expand_nodelist(nodelist)
    return {check_host(h, where="SLURM_JOB_NODELIST"): slots for h in names}
