"""Every stop says what was saved and how to go on (issue 46, point 6): a ``train.stop_at_step``
stop prints the step, the checkpoint it wrote and that the same command resumes (it read like a
crash); the summary says the run stopped early, and shows the last validation with its step, or
when the first comes, never a bare "val loss n/a" where validation runs."""

from __future__ import annotations

import pytest


def test_a_stop_at_step_says_what_it_saved_and_how_to_go_on(shared_runs):
    """The shared ``tiny_run``: stopped after step 2 of 4, checkpoints at steps 1 and 2,
    validation only after the last step (``--val-every 0``). No launch of its own."""
    run, done = shared_runs["tiny_run"]
    out = done.stdout
    assert (
        f"stopped at step 2 of 4 (train.stop_at_step=2): checkpoint "
        f"{run / 'checkpoints' / 'step00000002'} written. To go on, run the same command again "
        f"without train.stop_at_step (or with a later one): it resumes from that checkpoint."
    ) in out, out[-2000:]
    assert "steps 2 of 4 (stopped early: the same command resumes)" in out
    assert "val loss not measured yet (after the last step)" in out and "n/a" not in out


def test_the_summary_shows_the_last_validation_with_its_step():
    from anneal.cli.recipe import format_summary

    base = dict(run_dir="RUN", tokens=1024, train_loss=3.0, tokens_per_s=100.0, val_bpb=1.5)
    earlier = format_summary({**base, "step": 5, "max_steps": 9, "val_loss": 3.2, "val_step": 4})
    assert "steps 5 of 9 (stopped early" in earlier
    assert "val loss 3.2000, val bpb 1.5000 (at step 4)" in earlier
    later = {**base, "step": 2, "max_steps": 9, "val_loss": None, "val_step": None, "val_every": 4}
    assert "val loss not measured yet (every 4 steps and after the last step)" in (
        format_summary(later)
    )
    last = format_summary({**base, "step": 9, "max_steps": 9, "val_loss": 3.1, "val_step": 9})
    assert "steps 9, tokens" in last and "val loss 3.1000, val bpb 1.5000\n" in last
    none = format_summary({**base, "step": 9, "max_steps": 9, "val_loss": None, "val_every": None})
    assert "val loss n/a (no val split)" in none


def test_a_preempted_rank_leaves_without_the_interpreters_shutdown(monkeypatch, tmp_path):
    """The stop bound (issue 46): a rank whose preemption checkpoint is committed destroys its
    process group, freezes the heap (``anneal.cli.recipe.leave_promptly``) and ends through
    ``exit_preempted(75)``: the atexit handlers, then ``os._exit``, without the interpreter's
    shutdown (its collector passes over the heap of torch, DeepSpeed and transformers took
    2.3-2.4 s of each exit here, the rest 0.3 s and more; the seconds from the signal to the
    exit are bounded in tests/resilience/test_stop_mid_step.py). In process: the training,
    already stopped, is ``anneal.train.run`` raising ``Preempted``, and ``exit_preempted``
    (which would end pytest) records its status."""
    import gc

    import anneal.train
    from anneal.cli import recipe
    from anneal.dist import world_of_one_env
    from anneal.resilience.preempt import PREEMPTED_EXIT_CODE, Preempted

    def stopped(cfg, overrides):
        raise Preempted()

    class Exited(Exception):
        pass

    def exit_preempted(status):
        raise Exited(status, gc.get_freeze_count())

    monkeypatch.setattr(anneal.train, "run", stopped)
    monkeypatch.setattr(recipe, "exit_preempted", exit_preempted)
    for key in world_of_one_env():  # main makes this process a world of one: put back after
        monkeypatch.delenv(key, raising=False)
    gc.unfreeze()
    try:
        with pytest.raises(Exited) as info:
            recipe.main(preset="tiny", ds_config="cpu.json", argv=["--out", str(tmp_path / "r")])
        status, frozen = info.value.args
        assert status == PREEMPTED_EXIT_CODE and frozen > 0
    finally:
        gc.unfreeze()
