"""Muon end to end on 2 ranks (gloo, fp32 on CPU, the SMALL model, tiny data): ZeRO-1, 2 and 3
log the same losses and grad norms within 1e-5 relative at every one of 10 steps (one launch a
stage); a run stopped after step 5 and resumed at ZeRO-1 and at ZeRO-2 logs bitwise the losses,
grad norms and LRs of the run that never stopped, and its optimizer state at step 10 (Muon's
momentum buffers, AdamW's moments, the fp32 masters) equals that run's, bitwise (ZeRO-3:
tests/resilience/test_resume.py). The optimizer state in a checkpoint's files, per parameter of
each half, is the estimator's (``anneal.planning.memory.optimizer_bytes_per_param``): 8 bytes
on Muon's half, 12 on AdamW's (fp32). A spike rewinds a Muon run and halves the LR of both
halves (``guard.lr_scale``). Seven 2-rank launches and one of 1 rank: 201 s here with the
machine loaded (load average 8 on 2 cores, 2026-12-07).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import SMALL, read_metrics, run_recipe, run_recipes, sets

pytestmark = pytest.mark.slow
STEPS, STOP = 10, 5
STAGES = (1, 2, 3)


def _args(data, out, stage: int, *extra: str) -> list[str]:
    return [
        *("--out", str(out), "--data", str(data), "--max-steps", str(STEPS)),
        *("--val-every", "0", "--save-every", str(STOP)),
        *SMALL,
        *sets("optim.optimizer=muon", f"ds.zero_optimization.stage={stage}", "train.val_samples=0"),
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("muon")
    full = {s: tmp / f"zero{s}" for s in STAGES}
    split = {s: tmp / f"split{s}" for s in (1, 2)}
    first = [dict(args=_args(tiny_data, out, s), ranks=2) for s, out in full.items()]
    first += [
        dict(args=_args(tiny_data, out, s, *sets(f"train.stop_at_step={STOP}")), ranks=2)
        for s, out in split.items()
    ]
    run_recipes(first)
    run_recipes([dict(args=_args(tiny_data, out, s), ranks=2) for s, out in split.items()])
    return {"full": full, "split": split}


def _rows(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir, "train")}


def test_zero_stages_agree_within_1e_5(runs):
    rows = {s: _rows(out) for s, out in runs["full"].items()}
    assert all(sorted(r) == list(range(1, STEPS + 1)) for r in rows.values())
    for stage in (2, 3):
        for step in range(1, STEPS + 1):
            for key in ("loss", "grad_norm"):
                want, got = rows[1][step][key], rows[stage][step][key]
                assert got == pytest.approx(want, rel=1e-5), (stage, step, key)
    assert rows[1][STEPS]["loss"] < rows[1][1]["loss"] - 0.5  # it learns


def _optimizer_files(tag):
    return {p.name: torch.load(p, weights_only=False) for p in sorted(tag.glob("*optim_states.pt"))}


@pytest.mark.parametrize("stage", [1, 2])
def test_resume_is_exact_and_momentum_equal(runs, stage):
    full, split = _rows(runs["full"][stage]), _rows(runs["split"][stage])
    assert sorted(split) == sorted(full)
    for step in range(STOP + 1, STEPS + 1):
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert split[step][key] == full[step][key], (step, key)
    tag = f"checkpoints/step{STEPS:08d}"
    a = _optimizer_files(runs["full"][stage] / tag)
    b = _optimizer_files(runs["split"][stage] / tag)
    assert sorted(a) == sorted(b) and a
    buffers = 0
    for name, doc in a.items():
        sa = doc["optimizer_state_dict"]["base_optimizer_state"]["state"]
        sb = b[name]["optimizer_state_dict"]["base_optimizer_state"]["state"]
        assert sorted(sa) == sorted(sb)
        for i, state in sa.items():
            for key, value in state.items():
                buffers += key == "momentum_buffer"
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb[i][key])), (i, key)
    assert buffers == 2 * 2  # two Muon groups on each of the two ranks


def test_checkpoint_optimizer_state_is_the_estimators(runs):
    """At ZeRO-3, summed over the ranks' files: Muon's fp32 partitions and momentum buffers
    take 8 bytes per parameter of its half, AdamW's masters and moments 12 of its, and the
    partitions hold the half's parameters (``split_counts``) and at most a few elements of
    padding per group and rank."""
    import dataclasses

    from anneal.model import PRESETS
    from anneal.model.muon import split_counts
    from anneal.planning.memory import ZeroSetup, optimizer_bytes_per_param

    files = _optimizer_files(runs["full"][3] / f"checkpoints/step{STEPS:08d}")
    state_bytes, elements = {True: 0, False: 0}, {True: 0, False: 0}
    for doc in files.values():
        inner = doc["optimizer_state_dict"]
        groups = inner["optimizer_state_dict"]["param_groups"]
        for i, (group, flat) in enumerate(zip(groups, inner["fp32_flat_groups"], strict=True)):
            state = inner["optimizer_state_dict"]["state"][i]
            tensors = [flat] + [v for v in state.values() if torch.is_tensor(v) and v.dim()]
            state_bytes[group["use_muon"]] += sum(t.numel() * t.element_size() for t in tensors)
            elements[group["use_muon"]] += flat.numel()
    zero = ZeroSetup(stage=3, bf16=False, muon=True)
    for muon in (True, False):
        per_param = optimizer_bytes_per_param(zero, muon=muon)
        assert state_bytes[muon] == per_param * elements[muon], muon
    assert optimizer_bytes_per_param(zero, muon=True) == 8
    shape = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=176, vocab_size=300)
    on_muon, on_adam = split_counts(dataclasses.replace(PRESETS["tiny"], **shape))
    assert 0 <= elements[True] - on_muon <= 2 * 2 * 8
    assert 0 <= elements[False] - on_adam <= 2 * 2 * 8


def test_a_spike_rewinds_a_muon_run_and_halves_its_lr(runs, tiny_data, tmp_path):
    """1 rank, ZeRO-3, 8 samples a step: a bad sample at step 7 rewinds to the step-5
    checkpoint, and the LR from there is half the schedule's (the train row's is AdamW's
    group; the Muon groups follow the same ``WarmupDecay.scale_peak``, as
    tests/train/test_muon_engine.py shows on the real optimizer); the loss comes back."""
    out = tmp_path / "run"
    args = _args(tiny_data, out, 3, *sets("guard.min_history=3", "guard.lr_scale=0.5"))
    run_recipe(args, extra_env={"ANNEAL_FAULTS": "spike@sample=50"}, timeout_s=400)
    events = [e for e in read_metrics(out, "event") if e["event"] in ("spike", "rewind")]
    assert [(e["event"], e["step"]) for e in events] == [("spike", 7), ("rewind", 7)]
    assert events[1]["to_step"] == STOP
    rows, schedule = _rows(out), _rows(runs["full"][3])
    assert sorted(rows) == list(range(1, STEPS + 1))
    for step in range(STOP + 1, STEPS + 1):
        assert rows[step]["lr"] == pytest.approx(0.5 * schedule[step]["lr"], rel=1e-12), step
    assert rows[STEPS]["loss"] < rows[1]["loss"]


def test_export_of_a_muon_checkpoint_is_unchanged(runs, tmp_path):
    """``anneal export``'s library call on the ZeRO-2 and ZeRO-3 runs' last checkpoints: each
    verifies (its logits against the checkpoint's own weights), and the two exports' weights
    agree as the runs' losses do."""
    from safetensors.torch import load_file

    from anneal.hf.export import export

    weights = {}
    for stage in (2, 3):
        out = tmp_path / f"hf{stage}"
        export(runs["full"][stage], out=out, dtype="fp32")
        weights[stage] = {
            k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()
        }
    assert sorted(weights[2]) == sorted(weights[3]) and weights[2]
    for name, a in weights[2].items():
        b = weights[3][name]
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item() + 1e-6, name


def test_a_muon_resume_elsewhere_or_with_adamw_is_refused_before_launch(runs, tiny_data, tmp_path):
    """On 1 rank, or at ZeRO-3, a checkpoint saved by 2 ranks at ZeRO-2 would go through
    DeepSpeed's universal checkpoint, which does not convert Muon's state
    (bench/repro/muon_universal.py); with AdamW, the state is another optimizer's. Each is
    one paragraph before anything is written."""
    from tests.conftest import refused_tiny

    tag = runs["full"][2] / "checkpoints" / f"step{STEPS:08d}"
    for stage, ranks in ((2, 1), (3, 2)):
        out = tmp_path / f"moved{stage}{ranks}"
        args = [*_args(tiny_data, out, stage), "--resume", str(tag)]
        text = refused_tiny(args, world_size=ranks)
        assert "a Muon run saved on 2 rank" in text and "KeyError" in text, text
        assert "muon_universal.py" in text and not out.exists()
    adamw = [
        "optim.optimizer=adamw" if a == "optim.optimizer=muon" else a
        for a in _args(tiny_data, tmp_path / "adamw", 2)
    ]
    text = refused_tiny([*adamw, "--resume", str(tag)], world_size=2)
    assert "saved with optimizer Muon and this launch runs AdamW" in text
