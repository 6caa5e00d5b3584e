"""Start a script on N local ranks for the tests, as DeepSpeed's launcher does on one node, with
none of the launcher processes that import torch and DeepSpeed first.

    python tests/scripts/ranks.py N SCRIPT [ARGS...]
    python tests/scripts/ranks.py N -m MODULE [ARGS...]

Each rank gets the environment DeepSpeed's launcher gives it (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) and computes on one thread unless ``OMP_NUM_THREADS`` is set. The ranks stay in
this process's session, so that a test that kills the session on a timeout or a crash drill
kills them all (torchrun starts each rank in a session of its own). When a rank exits non-zero
the others get SIGTERM (SIGKILL 10 s later) and this exits with that rank's status, as
DeepSpeed's launcher does; SIGTERM, SIGINT and SIGUSR1 are passed on to every rank.

What it saves: the deepspeed runner and its launcher each import torch and DeepSpeed before a
rank starts (about 5 s of a 2-rank launch of the tiny recipe here, 16 s against 11 s,
2026-12-07). The tests of what the runner itself does still go through it
(``tests.conftest.run_recipe``'s ``runner``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from anneal.dist import free_port  # noqa: E402 (imports no torch)

GRACE_S = 10.0


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print(__doc__, file=sys.stderr)
        return 2
    n, command = int(argv[0]), argv[1:]
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(n),
        LOCAL_SIZE=str(n),
        CROSS_RANK="0",
        CROSS_SIZE="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-u", *command], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}
        )
        for r in range(n)
    ]

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            break
        time.sleep(0.05)
    if not failed:
        return 0
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    code = failed[0]
    return code if code > 0 else 128 - code  # a rank killed by signal S: 128 + S, as a shell


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
