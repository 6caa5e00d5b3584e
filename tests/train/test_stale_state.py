"""A run never waits forever on something a killed process left behind.

DeepSpeed's CPU accelerator JIT-builds a shared-memory op under torch's extension lock file in
every process; a process killed while holding that lock once hung every later run on the machine
(a whole CI run). The same op also left a 64 MiB file per rank in /dev/shm after every run
(322 of them, 21 GB of RAM, until the kernel's OOM killer stepped in). Anneal's CPU runs no longer
use the op, so a stale lock is harmless and a run leaves /dev/shm as it found it.
"""

import pytest

from tests.conftest import SMALL, read_metrics, run_recipe, shm_files


# The two-rank launch (20-30 s here) starts every process that could meet the lock or leave a
# file; it is the session's two_rank_run (tests/conftest.py), which tests/hf/test_export.py
# exports. One rank alone checks nothing more and runs with the slow tests.
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_a_stale_extension_lock_does_not_hang_a_run(tiny_data, tmp_path, ranks, request):
    if ranks == 2:
        run = request.getfixturevalue("two_rank_run")
        assert [r["step"] for r in read_metrics(run["out"], "train")] == [1, 2]
        assert run["lock"].exists()  # nobody had to clear it
        assert shm_files() - run["shm_before"] == set()
        return
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    out = tmp_path / "run"
    shm_before = shm_files()
    run_recipe(
        ["--out", str(out), "--data", str(tiny_data), "--max-steps", "2", "--val-every", "0"]
        + SMALL,
        ranks=ranks,
        timeout_s=180,
        extra_env={"TORCH_EXTENSIONS_DIR": str(extensions)},
    )
    assert [r["step"] for r in read_metrics(out, "train")] == [1, 2]
    assert lock.exists()  # nobody had to clear it
    assert shm_files() - shm_before == set()
