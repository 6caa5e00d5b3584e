"""Exact resume on the real engine: 2 ranks, ZeRO-3, fp32 on CPU. A run of 2N steps and a run
stopped after N steps (a preemption drill) and resumed with ``--resume auto`` log bitwise-equal
losses, grad norms and learning rates at every step after N, and the same validation loss:
model, optimizer, scheduler, data position and RNG all continue. The same with bf16 (run here
on tiny shapes) holds within 1e-3 relative. With Muon (``optim.optimizer=muon``, fp32) the
same, bitwise, and the optimizer state at step 2N (Muon's momentum buffers, AdamW's moments, the
fp32 masters) equals the never-stopped run's, bitwise: so it does in fp32 with AdamW. Muon's
first leg does not stop cleanly: every rank is killed with SIGKILL (``ANNEAL_FAULTS``
``kill@step=N+1``) at the start of step N+1, after the step-N checkpoint is committed, so its
resume is one after kill -9 (issue 42), with no launch of its own.

In fp32 the stopped run saves asynchronously (``train.async_save``, issue 44) in both legs, so
that the resume is from a checkpoint written behind the training and the step-2N optimizer files
it writes in the background equal those the never-stopped run saved synchronously, with no
launch of its own; the synchronous resume at 2 ranks stays proven by bf16, Muon and
tests/resilience/test_crash_recovery.py."""

import json
import signal

import pytest

from tests.conftest import SMALL, read_metrics, run_recipe

N = 4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["fp32", "bf16", "muon"])
def runs(request, stdlib_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"resume-{request.param}")
    precision = ["--set", f"train.precision={request.param}"]
    if request.param == "muon":
        precision = ["--set", "train.precision=fp32", "--set", "optim.optimizer=muon"]
    common = [
        "--data",
        str(stdlib_data),
        "--max-steps",
        str(2 * N),
        "--val-every",
        str(N),
        "--save-every",
        str(N),
        *SMALL,
        *precision,
    ]
    run_recipe(["--out", str(tmp / "full"), *common], ranks=2)
    split = ["--out", str(tmp / "split"), *common]
    if request.param == "fp32":
        split += ["--set", "train.async_save=true"]
    if request.param == "muon":  # kill -9 at the start of step N+1, no cleanup, no save
        kill = {"ANNEAL_FAULTS": f"kill@step={N + 1}"}
        first = run_recipe(split, ranks=2, check=False, extra_env=kill)
        assert first.returncode == 128 + signal.SIGKILL, first.stderr[-2000:]
        assert max(r["step"] for r in read_metrics(tmp / "split", "train")) == N
    else:
        first = run_recipe([*split, "--set", f"train.stop_at_step={N}"], ranks=2)
    second = run_recipe(split, ranks=2)
    return tmp / "full", tmp / "split", first, second, request.param


def test_first_leg_stops_at_n_and_second_resumes(runs):
    _, split, first, second, precision = runs
    assert f"resumed from {split / 'checkpoints' / f'step{N:08d}'} at step {N}" in second.stdout
    events = read_metrics(split, "event")
    assert [e["step"] for e in events if e["event"] == "resume"] == [N]
    saves = [(e["step"], e.get("asynchronous")) for e in events if e["event"] == "checkpoint"]
    assert saves == [(N, precision == "fp32"), (2 * N, precision == "fp32")]


def test_losses_after_n_are_equal(runs):
    """Bitwise in fp32; within 1e-3 relative in bf16."""
    full, split, *_, precision = runs
    a = {r["step"]: r for r in read_metrics(full, "train")}
    b = {r["step"]: r for r in read_metrics(split, "train")}
    assert sorted(a) == list(range(1, 2 * N + 1)) and sorted(b) == sorted(a)
    rel = 1e-3 if precision == "bf16" else 0
    for step in range(N + 1, 2 * N + 1):
        for key in ("loss", "grad_norm"):
            assert a[step][key] == pytest.approx(b[step][key], rel=rel, abs=0), (step, key)
        assert (a[step]["lr"], a[step]["tokens"]) == (b[step]["lr"], b[step]["tokens"])
    # the data moved on: no step repeats the batch of another
    assert len({a[s]["loss"] for s in a}) == 2 * N


def test_validation_after_resume_is_equal(runs):
    full, split, *_, precision = runs
    va = [r for r in read_metrics(full, "val") if r["step"] == 2 * N]
    vb = [r for r in read_metrics(split, "val") if r["step"] == 2 * N]
    rel = 1e-3 if precision == "bf16" else 0
    assert va and va[0]["val_loss"] == pytest.approx(vb[0]["val_loss"], rel=rel, abs=0)


def test_checkpoints_have_manifests_and_latest(runs):
    full, *_ = runs
    ckpt = full / "checkpoints"
    assert (ckpt / "latest").read_text() == f"step{2 * N:08d}"
    for step in (N, 2 * N):
        manifest = json.loads((ckpt / f"step{step:08d}" / "manifest.json").read_text())
        assert manifest["step"] == step and manifest["world_size"] == 2
        names = set(manifest["files"])
        for r in (0, 1):  # one optimizer shard per rank (bf16_ prefixed with bf16)
            assert any(n.endswith(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for n in names)


def test_metric_rows_follow_the_contract(runs):
    full, *_ = runs
    train = read_metrics(full, "train")
    for row in train:
        assert {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(row)
    tokens_per_step = train[0]["tokens"]
    assert [r["tokens"] for r in train] == [tokens_per_step * s for s in range(1, 2 * N + 1)]
    config = json.loads((full / "config.json").read_text())
    assert tokens_per_step == config["ds_config"]["train_batch_size"] * 64
    for row in read_metrics(full, "val"):
        assert {"val_loss", "val_ppl", "val_bpb"} <= set(row)


def test_optimizer_state_after_resume_is_the_never_stopped_runs(runs):
    """Every tensor of every rank's optimizer file at step 2N (Muon's momentum buffers under
    Muon), bitwise, in fp32."""
    import torch

    full, split, *_, precision = runs
    if precision == "bf16":
        pytest.skip("bf16 resumes within 1e-3, not bitwise")
    tag = f"checkpoints/step{2 * N:08d}"
    names = sorted(p.name for p in (full / tag).glob("*_optim_states.pt"))
    assert names == sorted(p.name for p in (split / tag).glob("*_optim_states.pt")) and names
    kinds = set()
    for name in names:
        a, b = (
            torch.load(run / tag / name, weights_only=False)["optimizer_state_dict"]
            for run in (full, split)
        )
        state_a, state_b = a["optimizer_state_dict"]["state"], b["optimizer_state_dict"]["state"]
        assert sorted(state_a) == sorted(state_b) and state_a
        for i, tensors in state_a.items():
            for key, value in tensors.items():
                kinds.add(key)
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[i][key])), (
                    name,
                    i,
                    key,
                )
        for x, y in zip(a["fp32_flat_groups"], b["fp32_flat_groups"], strict=True):
            assert torch.equal(x, y), name
    want = {"exp_avg", "exp_avg_sq", "step"} | (
        {"momentum_buffer"} if precision == "muon" else set()
    )
    assert kinds == want
