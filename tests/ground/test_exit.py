"""The ground floor's ``anneal/__init__.py``: a process that imported Anneal freezes its heap at
exit, so that the interpreter's final collections do not walk every object torch, transformers
and DeepSpeed keep (2-4 s of CPU a process; the figures are in that module's docstring)."""

import subprocess
import sys

from tests.conftest import ROOT, env

EXIT = """
import atexit, gc
import anneal
assert gc.get_freeze_count() == 0
atexit._run_exitfuncs()
print(gc.get_freeze_count())
"""


def test_a_process_that_imported_anneal_freezes_its_heap_at_exit():
    done = subprocess.run(
        [sys.executable, "-c", EXIT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env(),
        check=True,
    )
    assert int(done.stdout) > 1000, done.stdout  # the interpreter's own objects at least
