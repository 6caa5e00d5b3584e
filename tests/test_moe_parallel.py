"""Expert parallelism through DeepSpeed 0.19.8's AutoEP (``--set
ds.expert_parallel.autoep_size=N``), checked against the same run without it.

Slow (real engine, real processes, gloo, fp32 on CPU; a Qwen3-MoE of 2 layers, 4 experts of
which 2 per token, width 64, context 32): EP=2 on 2 ranks logs per-step language-model losses,
aux losses and grad norms over 10 steps within 1e-5 relative of EP=1 on 2 ranks with the same
global batch, at ZeRO-1 and at ZeRO-2, and the same per-expert token counts at every step (the
router saw the same tokens and chose the same experts); a checkpoint of the EP=2 run resumed at
EP=2 continues bitwise, its manifest recording the degree and listing every expert file, and
resumed at EP=1 (through DeepSpeed's universal checkpoint) within 1e-5, with the AdamW state of
the EP=1 run at step 10."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import PARALLEL_STEPS, ROOT, parallel_args, read_metrics, run_recipe, sets
from tests.zero_state import adam_state, assert_same_adam_state

MOE = ROOT / "recipes" / "pretrain_moe_tiny.py"
STEPS = PARALLEL_STEPS
EXPERTS = sets("model.num_experts=4", "model.expert_intermediate_size=32", "train.log_every=1")
"""The tiny-moe preset at the parallel tests' shape: 4 experts of width 32, top-2; a moe row
(each step's token counts) at every step."""


def _args(data, out, *, ep: int, stage: int, extra=()) -> list[str]:
    """conftest's parallel_args (micro-batch 2, accumulation 2: 8 samples per step on 2
    ranks) at expert-parallel degree ``ep``."""
    layout = f"ds.expert_parallel.autoep_size={ep}"
    return parallel_args(
        data, out, layout=layout, accum=2, stage=stage, extra=[*EXPERTS, *extra], save_every=5
    )


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """EP=1 and EP=2 on 2 ranks at ZeRO-1 and ZeRO-2, and the ZeRO-2 EP=2 run resumed from its
    step-5 checkpoint in a new directory; two launches at a time, one thread per process."""
    tmp = tmp_path_factory.mktemp("ep")
    launches = {
        f"ep{ep}_z{stage}": dict(
            args=_args(tiny_data, tmp / f"ep{ep}_z{stage}", ep=ep, stage=stage)
        )
        for stage in (1, 2)
        for ep in (1, 2)
    }
    tag = tmp / "ep2_z2" / "checkpoints" / "step00000005"
    launches["resumed"] = dict(
        args=_args(tiny_data, tmp / "resumed", ep=2, stage=2) + ["--resume", str(tag)]
    )
    launches["resumed_ep1"] = dict(
        args=_args(tiny_data, tmp / "resumed_ep1", ep=1, stage=2) + ["--resume", str(tag)]
    )
    one_thread = {"OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(2) as pool:
        started = {}
        for name, launch in launches.items():
            if name.startswith("resumed"):
                started["ep2_z2"].result()  # its checkpoint first
            started[name] = pool.submit(
                run_recipe, **launch, ranks=2, recipe=str(MOE), extra_env=one_thread
            )
        return tmp, {name: future.result() for name, future in started.items()}


def _train(out) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out, "train")}


def _counts(out) -> dict[int, list]:
    """Each step's token counts per layer and expert: the ``moe`` rows' (written every
    log_every = 1 steps), or the train rows' ``moe_counts`` where a run has no moe rows."""
    moe = read_metrics(out, "moe")
    if moe:
        return {r["step"]: r["counts"] for r in moe}
    return {r["step"]: r["moe_counts"] for r in read_metrics(out, "train")}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_expert_parallel_equals_the_run_without_it(runs, stage):
    """Slow: 4 launches of 2 ranks (shared with the resume test). Losses, aux losses, z-losses
    and grad norms within 1e-5 relative at each of the 10 steps, the token counts per expert
    equal, and the final validation loss within 1e-5."""
    tmp, done = runs
    ref, ep = _train(tmp / f"ep1_z{stage}"), _train(tmp / f"ep2_z{stage}")
    assert sorted(ref) == sorted(ep) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "aux_loss", "z_loss", "grad_norm"):
            assert ep[step][key] == pytest.approx(ref[step][key], rel=1e-5), (step, key)
        assert ep[step]["moe_max_mean"] == pytest.approx(ref[step]["moe_max_mean"], rel=1e-9)
    assert len({r["loss"] for r in ref.values()}) == STEPS  # the data moved on every step
    counts_ref, counts_ep = _counts(tmp / f"ep1_z{stage}"), _counts(tmp / f"ep2_z{stage}")
    assert counts_ref == counts_ep and len(counts_ref) == STEPS
    # 8 samples x 32 tokens per step, each routed to 2 of the 4 experts of each of 2 layers
    assert all(sum(layer) == 8 * 32 * 2 for c in counts_ref.values() for layer in c)
    val_ref, val_ep = (
        read_metrics(tmp / f"ep1_z{stage}", "val")[-1],
        read_metrics(tmp / f"ep2_z{stage}", "val")[-1],
    )
    assert val_ep["val_loss"] == pytest.approx(val_ref["val_loss"], rel=1e-5)
    config = json.loads((tmp / f"ep2_z{stage}" / "config.json").read_text())
    assert config["launch"]["expert_parallel_size"] == 2
    assert config["ds_config"]["expert_parallel"]["preset_model"] == "qwen3_moe"
    assert "each rank holds 2 experts of every layer" in done[f"ep2_z{stage}"].stdout


@pytest.mark.slow
def test_resume_at_the_same_expert_parallel_degree_is_exact(runs):
    """Slow (shares ``runs``): steps 6-10 after resuming the EP=2 run's step-5 checkpoint are
    bitwise those of the run that went on, router losses included; the manifest records the
    degree and lists (and hashes) each layer's expert files."""
    tmp, done = runs
    tag = tmp / "ep2_z2" / "checkpoints" / "step00000005"
    manifest = json.loads((tag / "manifest.json").read_text())
    assert manifest["expert_parallel_size"] == 2
    experts = [f for f in manifest["files"] if "_expert_" in f]
    assert len(experts) == 2 * 4  # layers x experts, each its own file
    assert f"resumed from {tag} at step 5" in done["resumed"].stdout
    full, resumed = _train(tmp / "ep2_z2"), _train(tmp / "resumed")
    assert sorted(resumed) == list(range(6, STEPS + 1))
    for step in resumed:
        for key in ("loss", "aux_loss", "z_loss", "grad_norm", "lr", "tokens"):
            assert resumed[step][key] == full[step][key], (step, key)


@pytest.mark.slow
def test_resume_at_another_expert_parallel_degree_goes_through_the_universal_checkpoint(runs):
    """Slow (shares ``runs``): the EP=2 run's step-5 checkpoint resumed at EP=1 on the same 2
    ranks is converted once to DeepSpeed's universal format under the resuming run's own
    ``checkpoints/.universal/`` (AutoEP's expert states consolidated by DeepSpeed's converter)
    and loaded from there: steps 6-10 match the EP=2 run that went on within 1e-5 relative
    (losses, router losses, grad norms) with the same token counts per expert, and the learning
    rate and tokens exactly. Its AdamW state at step 10 (each group's hyperparameters and Adam
    step, master weights and moments, the experts' group included) is that of the EP=1 run that
    never stopped, whose files have the same layout: the EP=2 state loaded at step 5, stepped 5
    times (a reset or misplaced moment, or a step counted from 0, would show)."""
    tmp, done = runs
    tag = tmp / "ep2_z2" / "checkpoints" / "step00000005"
    assert f"resumed from {tag} at step 5" in done["resumed_ep1"].stdout
    assert "at expert-parallel degree 2, this job has 2 at degree 1" in done["resumed_ep1"].stderr
    cache = tmp / "resumed_ep1" / "checkpoints" / ".universal"
    assert f"loading its universal form {cache}/step00000005-" in done["resumed_ep1"].stderr
    assert (
        not (tag / "zero").exists() and [p for p in cache.iterdir() if p.is_dir()] == []
    )  # gone at the next save
    full, resumed = _train(tmp / "ep2_z2"), _train(tmp / "resumed_ep1")
    assert sorted(resumed) == list(range(6, STEPS + 1))
    for step in resumed:
        for key in ("loss", "aux_loss", "z_loss", "grad_norm"):
            assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-5), (step, key)
        for key in ("lr", "tokens"):
            assert resumed[step][key] == full[step][key], (step, key)
    counts_full, counts_resumed = _counts(tmp / "ep2_z2"), _counts(tmp / "resumed_ep1")
    assert {s: counts_full[s] for s in resumed} == {s: counts_resumed[s] for s in resumed}
    manifest = json.loads(
        (tmp / "resumed_ep1" / "checkpoints" / "step00000010" / "manifest.json").read_text()
    )
    assert manifest["expert_parallel_size"] == 1 and manifest["zero_stage"] == 2
    got, want = adam_state(tmp / "resumed_ep1", STEPS), adam_state(tmp / "ep1_z2", STEPS)
    assert [g["hyper"]["name"] for g in want] == ["decay", "no_decay", "ep_size_1"]
    assert_same_adam_state(got, want, step=float(STEPS), moved=STEPS)
