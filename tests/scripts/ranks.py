"""Start a script on N local ranks for the tests, as DeepSpeed's launcher does on one node, with
none of the launcher processes that import torch and DeepSpeed first.

    python tests/scripts/ranks.py [--exec | --preload=MODULE,...] N SCRIPT [ARGS...]
    python tests/scripts/ranks.py [--exec | --preload=MODULE,...] N -m MODULE [ARGS...]

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

Each rank is a process of its own, forked from this one once it has imported what every rank
imports first (``PRELOAD``: torch, transformers' two model families, DeepSpeed), in the
ranks' own environment: the import, about 4 s of CPU a rank, is paid once a launch instead of
once a rank. The rank then runs the script as ``python -u SCRIPT`` would (its own ``sys.argv``,
``sys.path[0]``, ``__main__``, fresh seeds, the interpreter's exit), with nothing of the
script or of Anneal run before it but Anneal's package import (its message filters, which a
rank installs first anyway). ``--exec`` starts each rank as a new interpreter instead;
``--preload=`` names what to import first instead of ``PRELOAD`` (none: ``--preload=``).
"""

from __future__ import annotations

import gc
import importlib
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

_PATH = list(sys.path)  # as python set it for this script: [its folder, PYTHONPATH..., ...]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from anneal.dist import free_port  # noqa: E402 (imports no torch)

GRACE_S = 10.0
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # ZeRO's optimizer check imports it
)
"""What every training rank imports before its first step, imported once here and shared by the
forked ranks (copy-on-write)."""


class Forked:
    """A rank forked from this process, with the part of ``subprocess.Popen`` that ``main`` uses."""

    def __init__(self, env: dict[str, str], command: list[str]):
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:
            sys.exit(_run_rank(env, command))  # the rank's interpreter exit: atexit, threads

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, signum):
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _preload(base: dict[str, str], names: Sequence[str]) -> None:
    """``names`` imported in the ranks' environment (the libraries read it as they load:
    OpenMP its thread count, DeepSpeed its accelerator), after Anneal's package import, as in a
    rank."""
    os.environ.clear()
    os.environ.update(base)
    import anneal  # noqa: F401

    for name in names:
        importlib.import_module(name)
    gc.freeze()  # the collector leaves what was imported alone: its pages stay shared


def _run_rank(env: dict[str, str], command: list[str]) -> int:
    """In the forked rank: ``command`` run as ``python -u`` would run it; its exit status."""
    os.environ.clear()
    os.environ.update(env)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)
    # a new process's seeds, not the ones forked from this one (random reseeds itself in a
    # forked child; a library not imported yet seeds itself when the script imports it)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    try:
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            sys.path[:] = [os.getcwd(), *_PATH[1:]]
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(command)
            sys.path[:] = [str(Path(command[0]).resolve().parent), *_PATH[1:]]
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main(argv: list[str]) -> int:
    fork, preload = True, PRELOAD
    if argv and argv[0] == "--exec":
        fork, argv = False, argv[1:]
    elif argv and argv[0].startswith("--preload="):
        preload, argv = [m for m in argv[0].split("=", 1)[1].split(",") if m], argv[1:]
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
    envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(n)]
    if fork:
        _preload(base, preload)
        procs = [Forked(e, command) for e in envs]
    else:
        procs = [subprocess.Popen([sys.executable, "-u", *command], env=e) for e in envs]

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
