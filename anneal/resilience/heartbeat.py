"""Rank liveness: notice within a bounded time when a rank or node disappears, and say which.

Each rank of a multi-rank run keeps ``<run>/heartbeat/rank<R>.json`` fresh from a daemon thread
(host, pid, a beat counter, the last optimizer step it completed) and watches the others' files.
The thread is the only writer while the run goes on: one small file every ``interval_s``
(``heartbeat_timeout_s / 10``, between 0.2 and 10 s) per rank, whatever the step rate, so a
shared filesystem sees a bounded rate at any number of ranks, not one write per rank per step.
The step in the file is therefore at most ``interval_s`` old; failing and finishing are written
at once.

A rank whose beat counter has not moved for ``train.heartbeat_timeout_s`` seconds (as this rank
sees it: no clocks are compared across hosts), or whose process is gone on this host, is silent:
this rank prints which rank and host went silent and the last step each rank completed, and
exits non-zero. A rank blocked in a collective with a dead peer therefore never hangs; the
collective timeout (``train.collective_timeout_s``, given to ``deepspeed.init_distributed``) is
the backstop. A rank that fails with an exception marks its file ``failed``; one that finishes
or stops on a UserError marks it ``done``, which the others do not report.

The run directory is shared between nodes (checkpoints need that already).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from anneal import rundir
from anneal.files import write_atomic

EXIT_CODE = 1  # a peer is gone (75 is taken by preemption: "requeue me")


class Heartbeat:
    """The liveness thread of one rank; the loop calls ``completed(step)`` after every step."""

    def __init__(self, run_dir: Path, *, rank: int, world_size: int, timeout_s: float):
        self.dir = rundir.heartbeat_dir(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.interval_s = max(0.2, min(10.0, timeout_s / 10))
        self.host = socket.gethostname()
        self.step = 0
        self.status = "running"
        self._beats = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beat, local time it changed)
        self._launch = _launch_id()
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._write()
        self._thread = threading.Thread(target=self._run, daemon=True, name="anneal-heartbeat")
        self._thread.start()

    def _file(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.json"

    def completed(self, step: int) -> None:
        """Step ``step`` is done. Only recorded: the thread writes it with its next beat."""
        self.step = step

    def _write(self) -> None:
        with self._lock:
            self._write_locked()

    def _write_locked(self) -> None:
        self._beats += 1
        doc = {
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            "beat": self._beats,
            "step": self.step,
            "status": self.status,
            "launch": self._launch,
        }
        write_atomic(self._file(self.rank), json.dumps(doc))

    def _read(self, rank: int) -> dict | None:
        try:
            doc = json.loads(self._file(rank).read_text())
        except (OSError, ValueError):
            return None
        # a file left by an earlier launch of this run is not a heartbeat of this one
        return doc if doc.get("launch") == self._launch else None

    def silent(self) -> list[dict]:
        """The other ranks that are gone: beat unchanged for timeout_s, process gone on this
        host, or marked failed; each with the reason."""
        now = time.monotonic()
        gone = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            doc = self._read(r)
            if doc is None:  # not started yet
                if now - self._start > self.timeout_s:
                    gone.append({"rank": r, "host": "?", "step": None, "why": "never started"})
                continue
            if doc["status"] == "done":
                continue
            beat, since = self._seen.get(r, (None, now))
            if doc["beat"] != beat:
                self._seen[r] = (doc["beat"], now)
                since = now
            if doc["status"] == "failed":
                why = "failed (its traceback is above)"
            elif doc["host"] == self.host and not _alive(doc["pid"]):
                why = f"its process {doc['pid']} is gone"
            elif now - since > self.timeout_s:
                why = f"no heartbeat for {now - since:.0f} s"
            else:
                continue
            gone.append({**doc, "why": why})
        return gone

    def report(self, gone: list[dict]) -> str:
        steps = []
        for r in range(self.world_size):
            doc = {"step": self.step} if r == self.rank else (self._read(r) or {})
            steps.append(f"rank {r}: {doc.get('step', '?')}")
        names = "; ".join(
            f"rank {g['rank']} on {g['host']} went silent ({g['why']}), last completed step "
            f"{g['step']}"
            for g in gone
        )
        return (
            f"error (rank {self.rank} on {self.host}): {names}. Last step completed by each "
            f"rank: {', '.join(steps)} (the others' as of their last heartbeat, written every "
            f"{self.interval_s:g} s). Stopping this rank; restart the job with --resume auto "
            f"to continue from the newest intact checkpoint."
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()
            gone = self.silent()
            if gone:
                self._exit(gone)

    def _exit(self, gone: list[dict]) -> None:
        print(self.report(gone), file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)

    def failed(self, error: BaseException) -> None:
        """The loop raised: mark this rank failed (the others stop at once, naming it) and, for
        a communication error (the usual sign of a peer gone), wait up to the timeout for the
        evidence and print which peer; the caller re-raises, so this rank's own traceback
        follows."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.status = "failed"
        self._write()
        if not _is_comm_error(error):
            return
        deadline = time.monotonic() + self.timeout_s + 2 * self.interval_s
        while time.monotonic() < deadline:
            gone = self.silent()
            if gone:
                print(self.report(gone), file=sys.stderr, flush=True)
                return
            time.sleep(self.interval_s)

    def close(self) -> None:
        """Stop beating; a rank that did not fail is marked done (the others stop watching)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self.status == "running":
            self.status = "done"
            self._write()


class NoHeartbeat:
    """One rank: nobody to watch."""

    def completed(self, step: int) -> None:
        pass

    def failed(self, error: BaseException) -> None:
        pass

    def close(self) -> None:
        pass


def start(run_dir: Path, *, rank: int, world_size: int, timeout_s: float):
    if world_size == 1 or timeout_s <= 0:
        return NoHeartbeat()
    return Heartbeat(run_dir, rank=rank, world_size=world_size, timeout_s=timeout_s)


def _launch_id() -> str:
    """One id shared by every rank of this launch (rank 0's, broadcast)."""
    import torch.distributed as dist

    ident = [f"{socket.gethostname()}:{os.getpid()}:{time.time()}"]
    dist.broadcast_object_list(ident, src=0)
    return ident[0]


def _is_comm_error(error: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
