"""The training benchmark compares like with like: the plain reference loop (bench/reference.py)
and the recipe compute the same losses and gradient norms from the same weights and batches."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_train  # noqa: E402

STEPS = 2
# Micro 4 x accumulation 2 x 64 tokens, on conftest's SMALL shapes and its tiny corpus.
SETS = [
    "optim.global_batch_tokens=512",
    "train.eval_samples=0",
    "model.seq_len=64",
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.intermediate_size=176",
    "model.num_attention_heads=4",
]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    scratch = tmp_path_factory.mktemp("bench")
    out = {}
    sides = [("plain", "plain", None), ("zero0", "recipe", 0), ("zero3", "recipe", 3)]
    for name, kind, stage in sides:
        d = scratch / name
        d.mkdir()
        cmd = bench_train.command(
            kind, 1, stage, data=str(tiny_data), steps=STEPS, out=d, sets=SETS
        )
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        out[name] = bench_train.step_rows(kind, d)
    return out


def test_both_sides_run_the_same_steps(runs):
    assert [len(r) for r in runs.values()] == [STEPS] * 3
    assert all("time" in row for rows in runs.values() for row in rows)


@pytest.mark.parametrize("stage", ["zero0", "zero3"])
def test_step_one_loss_and_grad_norm_equal_the_plain_loop(runs, stage):
    ref, rec = runs["plain"][0], runs[stage][0]
    assert rec["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert rec["lr"] == pytest.approx(ref["lr"], rel=1e-12)


@pytest.mark.parametrize("stage", ["zero0", "zero3"])
def test_step_two_sees_the_same_update(runs, stage):
    # Step 2's loss depends on step 1's clipped AdamW update and LR: a different optimizer,
    # clip or schedule on either side would move it by far more than this.
    ref, rec = runs["plain"][1], runs[stage][1]
    assert abs(ref["loss"] - runs["plain"][0]["loss"]) > 1e-3  # the update changed the loss
    assert rec["loss"] == pytest.approx(ref["loss"], abs=1e-4)


def test_an_arm_adds_a_recipe_run_with_its_overrides(tmp_path):
    label, stage, sets = bench_train.parse_arm("overlap=2:ds.zero_optimization.overlap_comm=true")
    group = bench_train.plan_group(2, [2], [(label, stage, sets)])
    assert [g[0] for g in group] == ["torch DDP (gloo)", "recipe ZeRO-2", "recipe ZeRO-2 overlap"]
    arm = group[-1]
    cmd = bench_train.command(
        "recipe", 2, arm[3], data="d", steps=3, out=tmp_path, sets=[*SETS, *arm[4]]
    )
    assert "--set=ds.zero_optimization.overlap_comm=true" in cmd
    assert "--set=ds.zero_optimization.stage=2" in cmd
    # Without --stages the group's own stages run; --smoke keeps the reference and the last.
    assert [g[3] for g in bench_train.plan_group(1, None, [])] == [None, 0, 1, 3]
    assert [g[3] for g in bench_train.plan_group(2, None, [], smoke=True)] == [None, 3]


@pytest.mark.parametrize(
    "bad", ["overlap", "overlap=2", "overlap=5:a=b", "overlap=2:a", "=2:a=b", "x=12:a=b"]
)
def test_a_malformed_arm_says_what_it_takes(bad):
    with pytest.raises(SystemExit, match="LABEL=STAGE:KEY=VALUE"):
        bench_train.parse_arm(bad)


def test_the_report_names_the_command_that_reruns_it():
    import argparse

    arm = [("overlap", 2, ["a.b=true", "c=1"])]
    args = argparse.Namespace(
        models=["tiny"], ranks=[2], repeats=4, steps=24, small_steps=10, skip=3, stages=[2], arm=arm
    )
    row = {
        "model": "tiny",
        "ranks": 2,
        "run": "recipe ZeRO-2 overlap",
        "tokens_per_s": 1000,
        "min": 900,
        "max": 1100,
        "ratio": 0.9,
        "mfu": 0.5,
        "peak_rss_mib": 100,
        "step1_loss_diff": 0.0,
    }
    text = bench_train.report(args, {"peak_flops": 1e11, "rows": [row]})
    assert "--models tiny --ranks 2 --repeats 4" in text
    assert '--stages 2 --arm "overlap=2:a.b=true;c=1"`' in text
    assert "| tiny | 2 | recipe ZeRO-2 overlap | 1,000 (900-1,100) | 0.90x |" in text
