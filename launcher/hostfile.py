"""DeepSpeed hostfiles: ``host slots=N`` per line, ``#`` comments.

Parsing is strict so that a typo fails on the launch host, with the line number, instead of as
a hang on the cluster.
"""

from __future__ import annotations

import re
from pathlib import Path

_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+)\s+slots=(?P<slots>\d+)$")


def parse(path: str | Path) -> dict[str, int]:
    """Host -> slots, in file order. ValueError names the file and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"hostfile {path}: cannot read it ({e.strerror}).") from None
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(
                f"hostfile {path}, line {number}: {raw.strip()!r} is not "
                f"'HOST slots=N' (e.g. 'gpu001 slots=8')."
            )
        host, slots = m["host"], int(m["slots"])
        if host in hosts:
            raise ValueError(f"hostfile {path}, line {number}: host {host!r} is listed twice.")
        if slots < 1:
            raise ValueError(f"hostfile {path}, line {number}: slots must be at least 1.")
        hosts[host] = slots
    if not hosts:
        raise ValueError(f"hostfile {path}: no hosts. Add lines like 'gpu001 slots=8'.")
    return hosts


def render(hosts: dict[str, int]) -> str:
    return "".join(f"{host} slots={slots}\n" for host, slots in hosts.items())


def write(path: str | Path, hosts: dict[str, int]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(hosts))
