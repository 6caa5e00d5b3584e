"""The training benchmark compares like with like: the plain PyTorch loop and the bare DeepSpeed
engine of bench/reference.py and the recipe compute the same losses, gradient norms and LRs
from the same weights and batches; and bench_train plans, launches and reports its arms as
documented (the pairs of ``--bare``, the ``--arm`` A/B runs, the report's rerun command).

The tests on the three real runs are marked slow (make test-all and CI run them): they check
the benchmark's arms; make test keeps the recipe's step against torch's clip and AdamW in
test_engine_reference, and the planning and reporting of the arms here."""

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import ROOT, env, run_process

sys.path.insert(0, str(ROOT / "bench"))

import bench_train  # noqa: E402
import reference  # noqa: E402
import train_run  # noqa: E402

STEPS = 2
# Micro 4 x accumulation 2 x 64 tokens on conftest's micro shapes and its tiny corpus; the run
# stops after step 2 of 3 so that the recipe skips its end-of-run plots and report.
SETS = [
    "optim.global_batch_tokens=512",
    "train.val_samples=0",
    "model.seq_len=64",
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.intermediate_size=176",
    "model.num_attention_heads=4",
    f"train.stop_at_step={STEPS}",
]
# Both reference loops in one process (one import of torch, DeepSpeed and transformers).
BOTH_REFERENCES = (
    "import json, sys; sys.path.insert(0, 'bench'); import reference; "
    "[reference.main(argv) for argv in json.loads(sys.argv[1])]"
)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """The recipe at ZeRO-0 and at ZeRO-3, and one process running the plain loop and then the
    bare engine at ZeRO-3: three processes side by side, each on one thread.

    Over 10 s: about 16 s on 2 idle cores (30 s of CPU between the three), as each process
    spends 6-8 s importing torch, DeepSpeed and transformers and building its engines before
    two micro steps. Fewer processes would drop an arm: the recipe trains one stage per run, and
    ZeRO-0 (its own clip-norm path) and ZeRO-3 (the CPU default) are both checked against the
    plain loop."""
    scratch = tmp_path_factory.mktemp("bench")
    dirs = {name: scratch / name for name in ("plain", "bare3", "zero0", "zero3")}
    for d in dirs.values():
        d.mkdir()
    common = dict(data=str(tiny_data), steps=STEPS + 1)
    cmds = [
        train_run.command("recipe", 1, stage, out=dirs[f"zero{stage}"], sets=SETS, **common)
        for stage in (0, 3)
    ]
    refs = [
        train_run.command(kind, 1, stage, out=dirs[name], sets=SETS, **common)[2:]
        for kind, stage, name in (("plain", None, "plain"), ("bare", 3, "bare3"))
    ]
    cmds.append([sys.executable, "-c", BOTH_REFERENCES, json.dumps(refs)])
    e = {**env(), "OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(len(cmds)) as pool:
        jobs = [pool.submit(run_process, c, timeout_s=600, cwd=ROOT, env=e) for c in cmds]
        for job in jobs:
            done = job.result()
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    kinds = {"plain": "plain", "bare3": "bare"}
    return {name: train_run.step_rows(kinds.get(name, "recipe"), d) for name, d in dirs.items()}


@pytest.mark.slow  # the bench's three real runs (~15-30 s): make test-all
def test_every_arm_runs_the_same_steps(runs):
    """Over 10 s with the ``runs`` fixture's setup (its docstring says why)."""
    assert [len(r) for r in runs.values()] == [STEPS] * 4
    assert all("time" in row for rows in runs.values() for row in rows)


@pytest.mark.slow  # the bench's three real runs (~15-30 s): make test-all
@pytest.mark.parametrize("stage", ["zero0", "zero3"])
def test_step_one_loss_and_grad_norm_equal_the_plain_loop(runs, stage):
    ref, rec = runs["plain"][0], runs[stage][0]
    assert rec["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert rec["lr"] == pytest.approx(ref["lr"], rel=1e-12)


@pytest.mark.slow  # the bench's three real runs (~15-30 s): make test-all
@pytest.mark.parametrize("stage", ["zero0", "zero3"])
def test_step_two_sees_the_same_update(runs, stage):
    # Step 2's loss depends on step 1's clipped AdamW update and LR: a different optimizer,
    # clip or schedule on either side would move it by far more than this.
    ref, rec = runs["plain"][1], runs[stage][1]
    assert abs(ref["loss"] - runs["plain"][0]["loss"]) > 1e-3  # the update changed the loss
    assert rec["loss"] == pytest.approx(ref["loss"], abs=1e-4)


@pytest.mark.slow  # the bench's three real runs (~15-30 s): make test-all
def test_the_bare_engine_computes_what_the_recipe_computes(runs):
    """The bare DeepSpeed engine (its own config, model partitioned by deepspeed.initialize)
    against the recipe at the same stage: the same first loss, norm and LR, and the same update
    (step 2), so that the --bare ratio compares two loops around one computation."""
    bare, rec = runs["bare3"], runs["zero3"]
    assert bare[0]["loss"] == pytest.approx(rec[0]["loss"], rel=1e-6)
    assert bare[0]["grad_norm"] == pytest.approx(rec[0]["grad_norm"], rel=1e-4)
    assert [r["lr"] for r in bare] == pytest.approx([r["lr"] for r in rec], rel=1e-12)
    assert bare[1]["loss"] == pytest.approx(rec[1]["loss"], abs=1e-4)


def test_the_bare_engine_gets_the_recipes_batch_clip_optimizer_and_stage():
    ds = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "overlap_comm": False},
        "scheduler": {"type": "WarmupCosineLR", "params": {}},
        "bf16": {"enabled": False},
    }
    bare = reference.bare_config(ds, shipped_zero=False)
    assert bare["zero_optimization"] == {"stage": 2}
    assert bare["optimizer"] == ds["optimizer"] and bare["gradient_clipping"] == 1.0
    assert "scheduler" not in bare  # the LR comes from the same formula as the recipe's
    shipped = reference.bare_config(ds, shipped_zero=True)
    assert shipped["zero_optimization"] == ds["zero_optimization"]


def test_bare_pairs_run_back_to_back_in_alternating_order(tmp_path):
    pairs = bench_train.plan_pairs(2, None)
    assert [(b[0], r[0]) for b, r in pairs] == [
        (f"bare ZeRO-{s}", f"recipe ZeRO-{s}") for s in (1, 2, 3)
    ]
    orders = [[x[0] for x in bench_train.round_order([], pairs, r)] for r in range(2)]
    assert orders[0][:4] == ["bare ZeRO-1", "recipe ZeRO-1", "recipe ZeRO-2", "bare ZeRO-2"]
    assert orders[1] == [
        *("bare ZeRO-2", "recipe ZeRO-2", "recipe ZeRO-3", "bare ZeRO-3"),
        *("recipe ZeRO-1", "bare ZeRO-1"),
    ]
    # On 2 ranks both sides go through the deepspeed runner; the reference takes no --local_rank.
    bare, recipe = (
        train_run.command(k, 2, 3, data="d", steps=3, out=tmp_path, sets=[], flags=["--x"])
        for k in ("bare", "recipe")
    )
    assert bare[1:3] == recipe[1:3] == ["--num_gpus", "2"]
    assert "--no_local_rank" in bare and "--no_local_rank" not in recipe
    assert bare[-3:] == ["--engine", "deepspeed", "--x"]
    assert "--set=ds.zero_optimization.stage=3" in bare and "--out" not in bare


def test_smoke_forks_the_ranks_of_the_same_commands(tmp_path):
    """--smoke starts a 2-rank run from tests/scripts/ranks.py (one import forked per rank)
    instead of torchrun or the deepspeed runner: what follows the launcher is the full mode's
    command but for the runner's ``--local_rank`` (ranks.py passes none); one rank is plain
    python either way."""
    common = dict(data="d", steps=3, out=tmp_path, sets=["train.val_samples=0"], flags=["--x"])
    for kind in ("plain", "bare", "recipe"):
        full = train_run.command(kind, 2, 3, **common)
        smoke = train_run.command(kind, 2, 3, forked=True, **common)
        assert smoke[:3] == [sys.executable, str(ROOT / "tests/scripts/ranks.py"), "2"]
        script = next(i for i, a in enumerate(full) if a.endswith(".py") and i > 0)
        assert smoke[3:] == full[script:]
        assert train_run.command(kind, 1, 3, forked=True, **common) == train_run.command(
            kind, 1, 3, **common
        )
    assert train_run.launcher("plain", 2)[1:3] == ["-m", "torch.distributed.run"]


def test_the_bare_report_gives_each_sides_rate_and_the_ratio_per_round():
    def run(tps):
        return {"tokens_per_s": tps, "peak_rss_mib": 1000, "loss": [5.0]}

    pairs = bench_train.plan_pairs(1, [3])
    runs = {"bare ZeRO-3": [run(100), run(200)], "recipe ZeRO-3": [run(99), run(196)]}
    [row] = bench_train.against_bare("tiny", 1, runs, pairs, fpt=1e6, peak=1e9)
    assert row["ratio"] == {"median": pytest.approx(0.985), "min": 0.98, "max": 0.99}
    args = _args(bare=True, bare_zero="shipped", stages=[3], repeats=2)
    text = bench_train.report(args, {"peak_flops": 1e9, "rows": [row]})
    assert "bench_train.py --bare --models tiny" in text
    assert "--bare-zero shipped --stages 3`" in text
    assert "| tiny | 1 | 3 | 150 (100-200) | 148 (99-196) | 0.985x (0.980-0.990) | 15% |" in text


def test_an_arm_adds_a_recipe_run_with_its_overrides(tmp_path):
    label, stage, sets = bench_train.parse_arm("overlap=2:ds.zero_optimization.overlap_comm=true")
    group = bench_train.plan_group(2, [2], [(label, stage, sets)])
    assert [g[0] for g in group] == ["torch DDP (gloo)", "recipe ZeRO-2", "recipe ZeRO-2 overlap"]
    arm = group[-1]
    cmd = train_run.command(
        "recipe", 2, arm[3], data="d", steps=3, out=tmp_path, sets=[*SETS, *arm[4]]
    )
    assert "--set=ds.zero_optimization.overlap_comm=true" in cmd
    assert "--set=ds.zero_optimization.stage=2" in cmd
    # Without --stages the group's own stages run; --smoke keeps the reference and the last.
    assert [g[3] for g in bench_train.plan_group(1, None, [])] == [None, 0, 1, 3]
    assert [g[3] for g in bench_train.plan_group(2, None, [], smoke=True)] == [None, 3]
    # The default comparison rotates the whole group each round.
    order = [g[3] for g in bench_train.round_order(bench_train.plan_group(1, None, []), [], 1)]
    assert order == [0, 1, 3, None]


@pytest.mark.parametrize(
    "bad", ["overlap", "overlap=2", "overlap=5:a=b", "overlap=2:a", "=2:a=b", "x=12:a=b"]
)
def test_a_malformed_arm_says_what_it_takes(bad):
    with pytest.raises(SystemExit, match="LABEL=STAGE:KEY=VALUE"):
        bench_train.parse_arm(bad)


def _args(**kw) -> argparse.Namespace:
    base = dict(models=["tiny"], ranks=[2], repeats=4, steps=24, small_steps=10, skip=3, stages=[2])
    return argparse.Namespace(**{**base, "arm": [], "bare": False, "bare_zero": "defaults", **kw})


def test_the_report_names_the_command_that_reruns_it():
    args = _args(arm=[("overlap", 2, ["a.b=true", "c=1"])])
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


# --- the sparse model (bench_moe.py = bench_train.py --bare --models tiny-moe) ----------------

MOE_RECIPE = "recipes/pretrain_moe_tiny.py"
MOE_SETS = [
    *SETS,
    "model.num_experts=4",
    "model.expert_intermediate_size=32",
    # large router-loss weights, so that a loop that left either loss out would show it
    "model.moe_aux_loss_coef=1.0",
    "model.moe_z_loss_coef=0.1",
]


@pytest.fixture(scope="module")
def moe_runs(tiny_data, tmp_path_factory):
    """The tiny-moe recipe at ZeRO-2 and, in one other process, the bare AutoEP engine at ZeRO-2
    with the recipe's router-loss weights and then with both weights 0; one rank each, side by
    side, one thread each.

    About 6 s on 2 idle cores (measured), more on a loaded machine, as each process imports
    torch, DeepSpeed and transformers and builds its AutoEP engines before two micro steps; the
    bare engine without the router losses is what shows that the equality below can fail."""
    scratch = tmp_path_factory.mktemp("bench-moe")
    dirs = {name: scratch / name for name in ("recipe", "bare", "bare_lm_only")}
    for d in dirs.values():
        d.mkdir()
    common = dict(
        data=str(tiny_data), steps=STEPS + 1, recipe=MOE_RECIPE, ds_config="cpu_zero2.json"
    )
    recipe = train_run.command("recipe", 1, 2, out=dirs["recipe"], sets=MOE_SETS, **common)
    lm_only = [*MOE_SETS, "model.moe_aux_loss_coef=0", "model.moe_z_loss_coef=0"]
    refs = [
        train_run.command("bare", 1, 2, out=dirs[name], sets=s, **common)[2:]
        for name, s in (("bare", MOE_SETS), ("bare_lm_only", lm_only))
    ]
    cmds = [recipe, [sys.executable, "-c", BOTH_REFERENCES, json.dumps(refs)]]
    e = {**env(), "OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(len(cmds)) as pool:
        jobs = [pool.submit(run_process, c, timeout_s=600, cwd=ROOT, env=e) for c in cmds]
        for job in jobs:
            done = job.result()
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    kinds = {"recipe": "recipe"}
    return {name: train_run.step_rows(kinds.get(name, "bare"), d) for name, d in dirs.items()}


@pytest.mark.slow  # two real processes, multi-process DeepSpeed: make test-all
def test_the_bare_autoep_engine_computes_what_the_sparse_recipe_computes(moe_runs):
    """The bare AutoEP engine of bench_moe.py
    against the tiny-moe recipe at ZeRO-2: the same first loss, grad norm (of the objective with
    the aux and z losses) and LRs, and the same update (step 2); without the router losses the
    bare engine's norm is another, so the equal norms say that it does the recipe's work."""
    bare, rec, lm_only = moe_runs["bare"], moe_runs["recipe"], moe_runs["bare_lm_only"]
    assert [len(r) for r in moe_runs.values()] == [STEPS] * 3
    assert bare[0]["loss"] == pytest.approx(rec[0]["loss"], rel=1e-6)
    assert bare[0]["grad_norm"] == pytest.approx(rec[0]["grad_norm"], rel=1e-4)
    assert [r["lr"] for r in bare] == pytest.approx([r["lr"] for r in rec], rel=1e-12)
    assert bare[1]["loss"] == pytest.approx(rec[1]["loss"], abs=1e-4)
    assert lm_only[0]["loss"] == pytest.approx(rec[0]["loss"], rel=1e-6)  # same model, batch
    assert abs(lm_only[0]["grad_norm"] / rec[0]["grad_norm"] - 1) > 1e-3


def test_a_sparse_model_runs_in_triples_at_its_stages_with_its_dense_twin(tmp_path):
    """``--models tiny-moe``: per stage (1 and 2 by default) the bare engine and the recipe at
    expert-parallel degree = ranks, then the tiny dense preset in the same recipe and stage; the
    triple reverses whole every other round, and the commands take the sparse recipe and its
    ZeRO-2 CPU config."""
    triples = bench_train.plan_pairs(2, None, "tiny-moe")
    assert [[x[0] for x in t] for t in triples] == [
        [f"bare ZeRO-{s}", f"recipe ZeRO-{s}", f"dense tiny recipe ZeRO-{s}"] for s in (1, 2)
    ]
    ep = ("ds.expert_parallel.autoep_size=2",)
    assert [x[4] for x in triples[0]] == [ep, ep, ("model.preset=tiny",)]
    orders = [[x[0] for x in bench_train.round_order([], triples, r)] for r in range(2)]
    assert orders[0][:3] == ["bare ZeRO-1", "recipe ZeRO-1", "dense tiny recipe ZeRO-1"]
    assert orders[1][:3] == ["bare ZeRO-2", "recipe ZeRO-2", "dense tiny recipe ZeRO-2"]
    assert orders[1][3:] == ["dense tiny recipe ZeRO-1", "recipe ZeRO-1", "bare ZeRO-1"]
    model = bench_train.MODELS["tiny-moe"]
    cmd = train_run.command(
        "bare",
        2,
        2,
        data="d",
        steps=3,
        out=tmp_path,
        sets=list(ep),
        recipe=model.recipe,
        ds_config=model.ds_config,
    )
    assert "recipes/pretrain_moe_tiny.py" in cmd and "cpu_zero2.json" in cmd
    assert "--set=ds.expert_parallel.autoep_size=2" in cmd
    # a dense model keeps its pairs, and its spec no extra overrides
    assert [len(p) for p in bench_train.plan_pairs(1, [3])] == [2]


@pytest.mark.parametrize(
    "given, says",
    [
        (dict(bare=False, stages=None), "runs only under --bare"),
        (dict(bare=True, stages=[3]), "is benchmarked at ZeRO 1, 2 only"),
        (dict(bare=True, stages=None, models=["huge"]), "choose from tiny, small, tiny-moe"),
    ],
)
def test_a_sparse_model_is_refused_where_it_cannot_run(given, says):
    """Outside --bare (the plain loop has no expert layer), at ZeRO-3, or a model not listed:
    one line saying why, before any process starts."""
    args = _args(**{"models": ["tiny-moe"], **given})
    with pytest.raises(SystemExit, match=says):
        bench_train.check_models(args)


def test_the_sparse_report_reads_each_round_against_the_dense_twin():
    """The rows of a sparse model add its dense twin's tokens/s and the sparse step time over the
    dense one's, per round (equal tokens per step: the inverse ratio of their rates)."""

    def run(tps):
        return {"tokens_per_s": tps, "peak_rss_mib": 1000, "loss": [5.0]}

    triples = bench_train.plan_pairs(1, [2], "tiny-moe")
    runs = {
        "bare ZeRO-2": [run(100), run(110)],
        "recipe ZeRO-2": [run(99), run(100)],
        "dense tiny recipe ZeRO-2": [run(198), run(300)],
    }
    [row] = bench_train.against_bare("tiny-moe", 1, runs, triples, fpt=1e6, peak=1e9)
    assert row["stage"] == 2
    assert row["step_over_dense"] == {"median": pytest.approx(2.5), "min": 2.0, "max": 3.0}
    assert row["dense"]["median"] == 249
    args = _args(bare=True, models=["tiny-moe"], ranks=[1], stages=[2], repeats=2, loss="plain")
    text = bench_train.report(args, {"peak_flops": 1e9, "rows": [row]})
    assert "--models tiny-moe --ranks 1 --repeats 2" in text and "--loss plain --stages 2`" in text
    assert "| dense twin tokens/s | sparse / dense step |" in text
    assert text.rstrip().endswith("| 249 (198-300) | 2.50x (2.00-3.00) |")
