"""``anneal checkpoint prune-universal`` on hostile input (issue 41, point 6): it acts only in a
run (its config.json reads as a run's), through no link, and removes a conversion's temporary
folder only when ``to_universal`` marked it (``universal.MARK``). A user's directory with a
config.json of its own and a ``checkpoints/.universal/.thesis.tmp/``, a fake run whose
``checkpoints/`` (or ``.universal``) links to another run's, and an unmarked ``.thesis.tmp`` in a
real run: one paragraph, exit 2 (or left alone and not listed), and nothing anywhere changed.
In-process, well under a second each."""

from __future__ import annotations

import json
from pathlib import Path

from anneal.resilience import universal
from tests.conftest import tree
from tests.eval.test_eval_see import cli
from tests.resilience.test_prune_universal import _checkpoint, _conversion


def _thesis(directory: Path) -> Path:
    """``directory/checkpoints/.universal/.thesis.tmp/`` holding a file of the user's."""
    thesis = directory / "checkpoints" / universal.CACHE / ".thesis.tmp"
    thesis.mkdir(parents=True)
    (thesis / "chapter1.tex").write_text("years of work\n")
    return thesis


def _run(run: Path) -> Path:
    """A run with checkpoints at steps 4 and 8 and a conversion of each (the older prunable)."""
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"run": {"train": {"max_steps": 8}}}))
    for step in (4, 8):
        _conversion(run / "checkpoints", _checkpoint(run / "checkpoints", step))
    return run


def test_a_directory_that_is_not_a_run_is_refused(tmp_path, capsys):
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text(json.dumps({"name": "my thesis", "version": 2}))
    _thesis(project)
    before = tree(tmp_path)
    rc, out, err = cli(capsys, "checkpoint", "prune-universal", project)
    assert rc == 2 and "not a run's config.json" in err and str(project) in err
    assert len(err.strip().splitlines()) == 1 and tree(tmp_path) == before


def test_an_unmarked_tmp_folder_in_a_run_is_left_alone(tmp_path, capsys):
    run = _run(tmp_path / "run")
    thesis = _thesis(run)
    rc, out, err = cli(capsys, "checkpoint", "prune-universal", run, "--all")
    assert rc == 0 and ".thesis.tmp" not in out
    assert (thesis / "chapter1.tex").read_text() == "years of work\n"
    assert sorted(p.name for p in thesis.parent.iterdir()) == [".thesis.tmp"]


def test_a_fake_run_linked_to_another_runs_checkpoints_is_refused(tmp_path, capsys):
    other = _run(tmp_path / "other")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "config.json").write_text(json.dumps({"run": {}}))
    (fake / "checkpoints").symlink_to(other / "checkpoints")
    half = tmp_path / "half"  # its own checkpoints/, the cache a link
    (half / "checkpoints").mkdir(parents=True)
    (half / "config.json").write_text(json.dumps({"run": {}}))
    (half / "checkpoints" / universal.CACHE).symlink_to(other / "checkpoints" / universal.CACHE)
    before = tree(tmp_path)
    for run, where in ((fake, "checkpoints"), (half, f"checkpoints/{universal.CACHE}")):
        rc, out, err = cli(capsys, "checkpoint", "prune-universal", run, "--all")
        assert rc == 2 and f"{run / where}: a link to" in err, err
        assert "never writes or deletes" in err and len(err.strip().splitlines()) == 1
    assert tree(tmp_path) == before
