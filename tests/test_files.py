"""anneal.files: the one atomic write every small state file goes through."""

from __future__ import annotations

import subprocess
import sys

import pytest

from anneal.files import write_atomic


@pytest.mark.parametrize("durable", [False, True])
def test_write_atomic_replaces_and_leaves_nothing_beside(tmp_path, durable):
    path = tmp_path / "state.json"
    path.write_text("old")
    write_atomic(path, "new", durable=durable)
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_failed_write_keeps_the_old_file_and_cleans_up(tmp_path):
    path = tmp_path / "latest"
    path.write_text("step_00000010")
    with pytest.raises(TypeError):
        write_atomic(path, None)  # type: ignore[arg-type]  # the write itself fails
    assert path.read_text() == "step_00000010"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_module_stays_torch_free():
    """The data commands and benchmarks import it; it must not drag torch in."""
    code = "import sys, anneal.files; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
