"""``anneal checkpoint prune-universal RUN`` (``anneal.resilience.universal.prune_run``): it
removes the universal conversions a run no longer needs and nothing else, and never one that a
job holds (``universal.reading``, taken by every rank that converts or loads). The conversions
here are folders with the conversion manifest Anneal writes (``universal._write_manifest``)
over small files: what is tested is which folders go, not DeepSpeed's converter."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from anneal.cli import main
from anneal.resilience import universal
from anneal.resilience.manifest import write_manifest


def _checkpoint(ckpt_dir: Path, step: int) -> Path:
    tag = ckpt_dir / f"step{step:08d}"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"w" * 64)
    write_manifest(tag, step=step, client_state={"zero_stage": 2})
    return tag


def _conversion(ckpt_dir: Path, source: Path) -> Path:
    out = ckpt_dir / universal.CACHE / f"{source.name}-{universal.source_hash(source)[:16]}"
    (out / "zero" / "w").mkdir(parents=True)
    (out / "zero" / "w" / "fp32.pt").write_bytes(b"u" * 4096)
    universal._write_manifest(out, source=source, source_sha256=universal.source_hash(source))
    return out


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def run(tmp_path) -> Path:
    """A run with checkpoints at steps 4 and 8, conversions of both and of another run's step
    2, a conversion's leftover temporary folder (marked as ``to_universal`` marks it), and a
    folder Anneal did not make."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    (run / "config.json").parent.mkdir(parents=True)
    (run / "config.json").write_text('{"run": {}}\n')
    old, new = _checkpoint(ckpt, 4), _checkpoint(ckpt, 8)
    other = _checkpoint(tmp_path / "other" / "checkpoints", 2)
    for source in (old, new, other):
        _conversion(ckpt, source)
    leftover = ckpt / universal.CACHE / ".step00000012-0123456789abcdef.tmp"
    (leftover / "zero").mkdir(parents=True)
    (leftover / universal.MARK).write_text("a conversion, being made\n")  # as to_universal
    (ckpt / universal.CACHE / "notes").mkdir()
    (ckpt / universal.CACHE / "notes" / "mine.txt").write_text("keep me\n")
    return run


def _names(found: list[dict], removed: bool) -> list[str]:
    return sorted(Path(f["path"]).name.split("-")[0] for f in found if f["removed"] == removed)


def test_prune_removes_older_conversions_and_leftovers_and_keeps_the_newest(run, tmp_path, capsys):
    cache = run / "checkpoints" / universal.CACHE
    before = _tree(run)
    assert main(["checkpoint", "prune-universal", str(run), "--dry-run"]) == 0
    assert _tree(run) == before  # a dry run removes nothing
    assert "would remove" in capsys.readouterr().out

    # The other run's step 2 is older than this run's newest checkpoint too: the run resumes
    # from its own step 8 now.
    assert main(["checkpoint", "prune-universal", str(run)]) == 0
    out = capsys.readouterr().out
    left = sorted(p.name for p in cache.iterdir())
    assert [n.split("-")[0] for n in left] == ["notes", "step00000008"]
    assert (cache / "notes" / "mine.txt").read_text() == "keep me\n"
    assert "kept" in out and "step00000008" in out and "freed 0.0 MiB" in out
    # Nothing outside the cache changed: the checkpoints are inputs.
    after = _tree(run)
    assert {k: v for k, v in before.items() if universal.CACHE not in k} == {
        k: v for k, v in after.items() if universal.CACHE not in k
    }


def test_prune_all_and_a_conversion_whose_checkpoint_is_gone(run, tmp_path):
    found = universal.prune_run(run, dry_run=True)
    assert _names(found, removed=False) == ["step00000008"]
    assert _names(found, removed=True) == [".step00000012", "step00000002", "step00000004"]
    # With the run's checkpoint at step 8 gone, its conversion goes too (step 4 is the newest
    # checkpoint now, and its conversion stays).
    for p in sorted((run / "checkpoints" / "step00000008").iterdir()):
        p.unlink()
    (run / "checkpoints" / "step00000008").rmdir()
    found = universal.prune_run(run, dry_run=True)
    assert _names(found, removed=False) == ["step00000004"]
    assert "step00000008" in _names(found, removed=True)
    found = universal.prune_run(run, everything=True)
    assert _names(found, removed=False) == []
    assert sorted(p.name for p in (run / "checkpoints" / universal.CACHE).iterdir()) == ["notes"]


def _hold(ckpt_dir: str, ready, done) -> None:
    with universal.reading(Path(ckpt_dir)):
        ready.set()
        done.wait(30)


def test_a_conversion_a_job_is_reading_is_never_removed(run, capsys):
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    job = ctx.Process(target=_hold, args=(str(run / "checkpoints"), ready, done))
    job.start()
    try:
        assert ready.wait(30)
        before = _tree(run)
        assert main(["checkpoint", "prune-universal", str(run), "--all"]) == 2
        assert "a job is converting or loading" in capsys.readouterr().err
        assert _tree(run) == before
    finally:
        done.set()
        job.join(30)
    assert main(["checkpoint", "prune-universal", str(run), "--all"]) == 0  # released


def test_prune_refuses_what_is_not_a_run(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert main(["checkpoint", "prune-universal", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "not an Anneal run directory" in err and str(tmp_path / "x") in err
    run = tmp_path / "fresh"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"run": {}}))
    assert main(["checkpoint", "prune-universal", str(run)]) == 0
    assert "no universal conversions" in capsys.readouterr().out
    assert os.listdir(run) == ["config.json"]
