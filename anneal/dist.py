"""The one rank helper. Library code asks here, never the environment."""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
from pathlib import Path

# DeepSpeed's CPU accelerator JIT-builds a shared-memory all-reduce op ("deepspeed_shm_comm") in
# every process that initializes distributed, taking torch's extension lock file for the build
# check each time. A process killed inside that window leaves the lock behind, and every later
# process on the machine then waits on it forever (seen here: a whole CI run hung). Anneal's CPU
# runs use gloo's collectives instead; ANNEAL_CPU_SHM_COMM=1 brings the op back.
SHM_COMM_ENV = "ANNEAL_CPU_SHM_COMM"


def init_distributed(timeout_s: float = 1800.0) -> None:
    """Start (or join) the process group; the one place Anneal calls DeepSpeed's init.
    ``timeout_s``: how long any collective may wait for a peer before it fails."""
    from datetime import timedelta

    import deepspeed

    if deepspeed.get_accelerator().device_name() == "cpu" and os.environ.get(SHM_COMM_ENV) != "1":
        import deepspeed.ops

        # DeepSpeed keeps this dict for the process and consults it before any op build.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(verbose=False, timeout=timedelta(seconds=timeout_s))


def accelerator_env(environ: dict[str, str]) -> dict[str, str]:
    """``{"DS_ACCELERATOR": "cpu"}`` where DeepSpeed finds no accelerator on this host and
    ``environ`` names none; empty otherwise. For DeepSpeed's runner and per-node launcher started
    on this host (``python -m launcher run``): told what their own detection would find here,
    they skip it and its "Setting accelerator to CPU" warning, one per process (the ranks' own is
    quieted by importing ``anneal``). Not for other hosts, which may have GPUs."""
    if "DS_ACCELERATOR" in environ:
        return {}
    import deepspeed

    return {"DS_ACCELERATOR": "cpu"} if deepspeed.get_accelerator().device_name() == "cpu" else {}


def shutdown() -> None:
    """Destroy the process group, if there is one: the last distributed call of a process that
    finishes (or refuses) cleanly. Gloo's worker threads outlive a process group nobody destroyed,
    and tearing them down during the interpreter's own shutdown aborts the process now and then
    ("terminate called without an active exception", exit -6 after a run that succeeded: seen in
    CI). Not for a rank that may be inside a collective: destroying waits for it to end."""
    if _group() is not None:
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's cached groups


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local MASTER_PORT), chosen below
    the kernel's ephemeral range. A port the kernel hands out (``bind`` to 0) comes from that
    range, which every outgoing connection also draws from: in the seconds between this call and
    rank 0's store binding it, a gloo or store connection of another job on the host took it
    (EADDRINUSE, seen with two test sessions side by side). Below the range only another such
    choice can collide, and it picks at random among thousands."""
    low = _ephemeral_low()
    below = range(_FIRST_PORT, low)
    tries = random.SystemRandom().sample(below, 64) if len(below) > 64 else []
    for port in [*tries, 0]:  # 0: the kernel's choice, where nothing below the range is free
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


_FIRST_PORT = 20000  # above the well-known and most services' ports


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), 32768 where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def world_of_one_env() -> dict[str, str]:
    """The environment that makes this process a world of one rank on this host (a plain
    ``python recipes/...`` run, or an engine built inside a test)."""
    return dict(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )


def single_process_env() -> None:
    """Started without a launcher (a plain ``python recipes/...``, ``anneal eval``, a bench):
    make this process a world of one, or DeepSpeed would look for MPI. A no-op under a
    launcher, which has set ``RANK``."""
    if "RANK" not in os.environ:
        os.environ.update(world_of_one_env())


def _group():
    """``torch.distributed`` where this process has a process group, else None. A process that
    never imported torch has none, and does not import it here: the helpers below serve torch-free
    processes too (the end-of-run plots and report read manifests through them), where importing
    torch would add about a second to each."""
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    group = _group()
    return group.get_rank() if group is not None else 0


def world_size() -> int:
    group = _group()
    return group.get_world_size() if group is not None else 1


def all_gather(obj) -> list:
    """Every rank's ``obj``, in rank order; ``[obj]`` without a process group."""
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    _group().all_gather_object(out, obj)
    return out


def barrier() -> None:
    """``torch.distributed.barrier()`` when there is a process group (a one-process run has
    none)."""
    group = _group()
    if group is not None:
        group.barrier()


def is_main_process() -> bool:
    return rank() == 0


def print0(*args: object) -> None:
    """Print on rank 0 only (console summaries; use logging elsewhere)."""
    if is_main_process():
        print(*args, flush=True)


def setup_logging(level: int = logging.INFO) -> None:
    """Rank 0 logs at ``level``; other ranks only warnings and errors."""
    logging.basicConfig(
        level=level if is_main_process() else logging.WARNING,
        format=f"%(asctime)s [rank{rank()}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
