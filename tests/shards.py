"""`make test-all`: the whole suite as N pytest sessions side by side (``ANNEAL_TEST_SHARD=i/N``;
tests/conftest.py says which tests each takes), shard 1's output as it comes, the others' after
it; then the tests marked ``alone`` (they measure the machine) in one more session, on their
own; and the exit status of the worst.

    .venv/bin/python tests/shards.py 3 -q --durations=10 tests

Each session gets its own ``--basetemp`` in one temporary directory, removed when every session
passed and kept (its path printed) when one failed. On 2 cores one session keeps them about 1.4
busy (the ranks of a run wait on each other, processes start, the cluster drills wait on Slurm);
more sessions fill those gaps. Where the sessions are at least as many as the cores, each
process computes on one thread (``one_thread``). Ctrl-C or SIGTERM stops every session with its
processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NO_TESTS = 5  # pytest's exit status when a session selected nothing


def one_thread(n: int) -> dict[str, str]:
    """``OMP_NUM_THREADS=1`` for every process of a shard, where N shards fill the cores:
    without it the pytest process and a 1-rank run each compute on every core (torch's
    default; the recipe splits the cores only between the ranks of its own launch), so two
    shards ran twice as many spinning threads as there are cores. A value the caller set is
    kept."""
    if "OMP_NUM_THREADS" in os.environ or n < (os.cpu_count() or 1):
        return {}
    return {"OMP_NUM_THREADS": "1"}


def alone_args(args: list[str]) -> list[str]:
    """``args`` for the session of the tests marked ``alone``: each folder among them replaced by
    the test files under it that say ``pytest.mark.alone``, so that the session collects those
    few files instead of the whole suite again (11 s of collection on its own, after the shards,
    against 2 s). Options and files are kept as given."""
    out = []
    for arg in args:
        path = Path(arg)
        if arg.startswith("-") or not path.is_dir():
            out.append(arg)
            continue
        out += sorted(
            str(f) for f in path.rglob("test_*.py") if "pytest.mark.alone" in f.read_text()
        )
    return out


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: tests/shards.py N [pytest arguments...]", file=sys.stderr)
        return 2
    n, args = int(argv[0]), argv[1:]
    tmp = Path(tempfile.mkdtemp(prefix="anneal-shards-"))
    procs, logs, started = [], [], time.monotonic()
    for i in range(1, n + 1):
        log = None if i == 1 else (tmp / f"shard{i}.log").open("w+")
        env = {**os.environ, "ANNEAL_TEST_SHARD": f"{i}/{n}", **one_thread(n)}
        cmd = [sys.executable, "-m", "pytest", *args, "--basetemp", str(tmp / f"shard{i}")]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        logs.append(log)

    def stop(signum, _frame):
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ended = [None] * n  # seconds from the start to each shard's end, in the order they end
    while None in ended:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic() - started
        time.sleep(0.5)
    codes = [p.returncode for p in procs]
    for i, log in enumerate(logs[1:], start=2):
        log.seek(0)
        print(f"\n== shard {i}/{n} ==", flush=True)
        sys.stdout.write(log.read())
        log.close()
    # The tests marked alone measure the machine: on their own, once the shards are done.
    print("\n== the tests marked alone ==", flush=True)
    env = {**os.environ, "ANNEAL_TEST_SHARD": "alone"}
    cmd = [sys.executable, "-m", "pytest", *alone_args(args), "--basetemp", str(tmp / "alone")]
    procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    codes.append(procs[-1].wait())
    ended.append(time.monotonic() - started)
    print()
    names = [f"shard {i}/{n}" for i in range(1, n + 1)] + ["alone"]
    for name, code, took in zip(names, codes, ended, strict=True):
        said = "no tests selected" if code == NO_TESTS else f"exit {code}"
        print(f"== {name}: {said}, done {took:.0f} s after the start")
    bad = [c for c in codes if c not in (0, NO_TESTS)]
    if bad:
        print(f"the sessions' files (--basetemp) are kept in {tmp}")
        return max(bad)
    removing = time.monotonic()
    shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"== every session passed; their files removed in {time.monotonic() - removing:.0f} s, "
        f"{time.monotonic() - started:.0f} s after the start"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
