"""A run never waits forever on something a killed process left behind.

DeepSpeed's CPU accelerator JIT-builds a shared-memory op under torch's extension lock file in
every process; a process killed while holding that lock once hung every later run on the machine
(a whole CI run). The same op also left a 64 MiB file per rank in /dev/shm after every run
(322 of them, 21 GB of RAM, until the kernel's OOM killer stepped in). Anneal's CPU runs no longer
use the op, so a stale lock is harmless and a run leaves /dev/shm as it found it.
"""

import pytest

from tests.conftest import SMALL, read_metrics, run_recipe, shm_files


def test_the_shared_two_rank_run_met_a_stale_lock_and_left_no_file_in_shm(two_rank_run):
    """The two-rank launch (20-30 s here) starts every process that could meet the lock or leave
    a file; it is the session's two_rank_run (tests/conftest.py), started with a stale lock in
    its TORCH_EXTENSIONS_DIR, which tests/hf/test_export.py exports. Taken as an argument, so
    that `make test`'s sessions see which tests read the shared runs."""
    assert [r["step"] for r in read_metrics(two_rank_run["out"], "train")] == [1, 2]
    assert two_rank_run["lock"].exists()  # nobody had to clear it
    assert shm_files() - two_rank_run["shm_before"] == set()


@pytest.mark.slow  # one rank alone checks nothing the two-rank run does not: with the drills
def test_a_stale_extension_lock_does_not_hang_a_one_rank_run(tiny_data, tmp_path):
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    out = tmp_path / "run"
    shm_before = shm_files()
    run_recipe(
        ["--out", str(out), "--data", str(tiny_data), "--max-steps", "2", "--val-every", "0"]
        + SMALL,
        timeout_s=180,
        extra_env={"TORCH_EXTENSIONS_DIR": str(extensions)},
    )
    assert [r["step"] for r in read_metrics(out, "train")] == [1, 2]
    assert lock.exists()  # nobody had to clear it
    assert shm_files() - shm_before == set()
