"""Expert parallelism through DeepSpeed 0.19.8's AutoEP (``--set
ds.expert_parallel.autoep_size=N``), checked against the same run without it.

Slow (real engine, real processes, gloo, fp32 on CPU; a Qwen3-MoE of 2 layers, 4 experts of
which 2 per token, width 64, context 32): EP=2 on 2 ranks logs per-step language-model losses,
aux losses and grad norms over 10 steps within 1e-5 relative of EP=1 on 2 ranks with the same
global batch, at ZeRO-1 (held to EP=1 at ZeRO-2), ZeRO-2 and ZeRO-3, and the same per-expert
token counts at every step (the router saw the same tokens and chose the same experts); a
checkpoint of the EP=2 run resumed at EP=2 continues bitwise at ZeRO-2 and at ZeRO-3, its
manifest recording the degree and listing every expert file (ZeRO-2) or every rank's partitions
(ZeRO-3), and resumed at EP=1 (through DeepSpeed's universal checkpoint; the ZeRO-3 one at
ZeRO-2) within 1e-5, with the AdamW state of the EP=1 run at step 10; both ZeRO-3 runs, and the
EP=2 ones at ZeRO-1 and 2, export (verified) to a transformers model whose validation loss is
the live engine's."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from anneal.resilience.manifest import HASH
from tests.conftest import PARALLEL_STEPS, ROOT, parallel_args, read_metrics, run_recipe, sets
from tests.zero_state import adam_state, assert_same_adam_state

MOE = ROOT / "recipes" / "pretrain_moe_tiny.py"
KINDS = ("model", "optim")
STEPS = PARALLEL_STEPS
STAGES = (1, 2, 3)
REFERENCE = {1: 2, 2: 2, 3: 3}
"""The ZeRO stage of the EP=1 run that each stage's EP=2 run is held to: ZeRO-1 to ZeRO-2's,
which computes the same steps (the same optimizer, its gradients partitioned), so that the
fixture makes one launch fewer."""
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
    """EP=2 on 2 ranks at ZeRO-1, 2 and 3 and EP=1 at ZeRO-2 and 3 (``REFERENCE``), the ZeRO-2
    EP=2 run resumed from its step-5 checkpoint in a new directory at EP=2 and at EP=1, and the
    ZeRO-3 EP=2 run's at EP=2 and at EP=1 at ZeRO-2: 9 launches, two at a time, one thread per
    process."""
    tmp = tmp_path_factory.mktemp("ep")
    layouts = [(ep, stage) for stage in STAGES for ep in (1, 2) if (ep, stage) != (1, 1)]
    launches = {
        f"ep{ep}_z{stage}": dict(
            args=_args(tiny_data, tmp / f"ep{ep}_z{stage}", ep=ep, stage=stage)
        )
        for ep, stage in layouts
    }
    resumes = {  # name: (ep, stage) of the launch, stage of the EP=2 run it resumes
        "resumed": (2, 2, 2),
        "resumed_ep1": (1, 2, 2),
        "resumed_z3": (2, 3, 3),
        "resumed_z3_ep1": (1, 2, 3),
    }
    for name, (ep, stage, saved) in resumes.items():
        tag = tmp / f"ep2_z{saved}" / "checkpoints" / "step00000005"
        args = _args(tiny_data, tmp / name, ep=ep, stage=stage) + ["--resume", str(tag)]
        launches[name] = dict(args=args)
    one_thread = {"OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(2) as pool:
        started = {}
        for name, launch in launches.items():
            if name in resumes:
                started[f"ep2_z{resumes[name][2]}"].result()  # its checkpoint first
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
@pytest.mark.parametrize("stage", STAGES)
def test_expert_parallel_equals_the_run_without_it(runs, stage):
    """Slow: 5 launches of 2 ranks (shared with the resume and export tests). Losses, aux
    losses, z-losses and grad norms within 1e-5 relative at each of the 10 steps (measured at
    ZeRO-3: 6e-8 at most), the token counts per expert equal, and the final validation loss
    within 1e-5."""
    tmp, done = runs
    reference = tmp / f"ep1_z{REFERENCE[stage]}"
    ref, ep = _train(reference), _train(tmp / f"ep2_z{stage}")
    assert sorted(ref) == sorted(ep) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "aux_loss", "z_loss", "grad_norm"):
            assert ep[step][key] == pytest.approx(ref[step][key], rel=1e-5), (step, key)
        assert ep[step]["moe_max_mean"] == pytest.approx(ref[step]["moe_max_mean"], rel=1e-9)
    assert len({r["loss"] for r in ref.values()}) == STEPS  # the data moved on every step
    counts_ref, counts_ep = _counts(reference), _counts(tmp / f"ep2_z{stage}")
    assert counts_ref == counts_ep and len(counts_ref) == STEPS
    # 8 samples x 32 tokens per step, each routed to 2 of the 4 experts of each of 2 layers
    assert all(sum(layer) == 8 * 32 * 2 for c in counts_ref.values() for layer in c)
    val_ref, val_ep = (
        read_metrics(reference, "val")[-1],
        read_metrics(tmp / f"ep2_z{stage}", "val")[-1],
    )
    assert val_ep["val_loss"] == pytest.approx(val_ref["val_loss"], rel=1e-5)
    config = json.loads((tmp / f"ep2_z{stage}" / "config.json").read_text())
    assert config["launch"]["expert_parallel_size"] == 2
    assert config["ds_config"]["expert_parallel"]["preset_model"] == "qwen3_moe"
    assert "each rank holds 2 experts of every layer" in done[f"ep2_z{stage}"].stdout


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_at_the_same_expert_parallel_degree_is_exact(runs, stage):
    """Slow (shares ``runs``): steps 6-10 after resuming the EP=2 run's step-5 checkpoint are
    bitwise those of the run that went on, router losses included; the manifest records the
    degree and lists (and hashes) each layer's expert files (ZeRO-2), or each rank's model and
    optimizer states, where ZeRO-3 keeps the experts that rank holds."""
    tmp, done = runs
    tag = tmp / f"ep2_z{stage}" / "checkpoints" / "step00000005"
    manifest = json.loads((tag / "manifest.json").read_text())
    assert manifest["expert_parallel_size"] == 2 and manifest["zero_stage"] == stage
    experts = [f for f in manifest["files"] if "_expert_" in f]
    assert len(experts) == (2 * 4 if stage == 2 else 0)  # layers x experts, each its own file
    if stage == 3:
        assert sorted(manifest["files"]) == [
            f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in KINDS
        ]
        assert all(e["size"] and e[HASH] for e in manifest["files"].values())
    name = "resumed" if stage == 2 else "resumed_z3"
    assert f"resumed from {tag} at step 5" in done[name].stdout
    full, resumed = _train(tmp / f"ep2_z{stage}"), _train(tmp / name)
    assert sorted(resumed) == list(range(6, STEPS + 1))
    for step in resumed:
        for key in ("loss", "aux_loss", "z_loss", "grad_norm", "lr", "tokens"):
            assert resumed[step][key] == full[step][key], (step, key)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_at_another_expert_parallel_degree_goes_through_the_universal_checkpoint(
    runs, stage
):
    """Slow (shares ``runs``): the EP=2 run's step-5 checkpoint resumed at EP=1 on the same 2
    ranks at ZeRO-2 (from ZeRO-2, and from ZeRO-3: AutoEP's partitioned experts, and a move of
    stage too) is converted once to DeepSpeed's universal format under the resuming run's own
    ``checkpoints/.universal/`` (AutoEP's expert states consolidated by DeepSpeed's converter)
    and loaded from there: steps 6-10 match the EP=2 run that went on within 1e-5 relative
    (losses, router losses, grad norms; measured from ZeRO-3: 6e-8 at most) with the same token
    counts per expert, and the learning rate and tokens exactly. Its AdamW state at step 10
    (each group's hyperparameters and Adam step, master weights and moments, the experts' group
    included) is that of the EP=1 ZeRO-2 run that never stopped, whose files have the same
    layout: the EP=2 state loaded at step 5, stepped 5 times (a reset or misplaced moment, or a
    step counted from 0, would show)."""
    tmp, done = runs
    name, source = ("resumed_ep1", "ep2_z2") if stage == 2 else ("resumed_z3_ep1", "ep2_z3")
    tag = tmp / source / "checkpoints" / "step00000005"
    assert f"resumed from {tag} at step 5" in done[name].stdout
    assert f"was saved on 2 ranks, ZeRO-{stage}, expert-parallel 2;" in done[name].stderr
    cache = tmp / name / "checkpoints" / ".universal"
    assert f"loading its universal form {cache}/step00000005-" in done[name].stderr
    assert (
        not (tag / "zero").exists() and [p for p in cache.iterdir() if p.is_dir()] == []
    )  # gone at the next save
    full, resumed = _train(tmp / source), _train(tmp / name)
    assert sorted(resumed) == list(range(6, STEPS + 1))
    for step in resumed:
        for key in ("loss", "aux_loss", "z_loss", "grad_norm"):
            assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-5), (step, key)
        for key in ("lr", "tokens"):
            assert resumed[step][key] == full[step][key], (step, key)
    counts_full, counts_resumed = _counts(tmp / source), _counts(tmp / name)
    assert {s: counts_full[s] for s in resumed} == {s: counts_resumed[s] for s in resumed}
    manifest = json.loads(
        (tmp / name / "checkpoints" / "step00000010" / "manifest.json").read_text()
    )
    assert manifest["expert_parallel_size"] == 1 and manifest["zero_stage"] == 2
    got, want = adam_state(tmp / name, STEPS), adam_state(tmp / "ep1_z2", STEPS)
    assert [g["hyper"]["name"] for g in want] == ["decay", "no_decay", "ep_size_1"]
    assert_same_adam_state(got, want, step=float(STEPS), moved=STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("stage,ep", [(1, 2), (2, 2), (3, 1), (3, 2)])
def test_a_run_exports_its_validation_loss(runs, tiny_data, stage, ep, tmp_path):
    """Slow (shares ``runs``; about 3 s each): the step-10 checkpoint of an expert-parallel run
    at ZeRO-1 or 2 (each rank's experts in files of their own, every one listed and hashed by
    the manifest) or of a ZeRO-3 run (AutoEP partitions the experts in each rank's files: over
    the 2 ranks that hold all 4 at EP=1, 2 a rank, whole, at EP=2) passes the checks of a
    resume, and ``anneal export --dtype fp32`` (its verification on: logits equal to an
    independent reader's) then plain transformers gives the live engine's last validation loss
    on the same windows within 1e-5 (measured 2e-9 at ZeRO-3, 4e-8 at ZeRO-1/2)."""
    import torch
    import transformers

    from anneal import rundir
    from anneal.cli import main as cli_main
    from anneal.data.stream import PackedSplit
    from anneal.resilience import checkpoint, safeload

    tmp, _ = runs
    run = tmp / f"ep{ep}_z{stage}"
    tag_dir = checkpoint.intact_checkpoints(rundir.checkpoints_dir(run))[-1]
    files = checkpoint.read_manifest(tag_dir)["files"]
    experts = [f for f in files if "_expert_" in f]
    assert len(experts) == (0 if stage == 3 else 2 * 4)  # layers x experts, each its own file
    assert all(e["size"] and e[HASH] for e in files.values())
    assert not checkpoint.damaged_files(tag_dir)
    safeload.check_checkpoint(tag_dir)
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), "--out", str(out), "--dtype", "fp32"]) == 0
    report = json.loads((out / "anneal_export.json").read_text())
    assert report["zero_stage"] == stage and report["step"] == STEPS
    assert report["verify"]["max_abs_logit_diff"] <= report["verify"]["tolerance"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    val = PackedSplit(tiny_data, "val", seq_len=32)
    windows = [val.window(t * val.n_windows // 8) for t in range(8)]
    ids = torch.stack([torch.as_tensor(w.astype("int64")) for w in windows])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids[:, :-1]).logits
    ours = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:]).item()
    live = rundir.read_metrics(run, "val")[-1]
    assert live["step"] == STEPS and ours == pytest.approx(live["val_loss"], rel=1e-5)
