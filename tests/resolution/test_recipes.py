"""Every recipe runs with its own defaults on both kinds of device: for each recipe, on the CPU
path and on the GPU path (resolved here without a GPU, as the ranks will resolve it), at every
data-parallel size the shipped hostfiles give, the whole launch resolves up to the engine:
ds_config, batch arithmetic, schedule, preset and precision. Also `make demo`'s exact command on
a GPU machine, and `python recipes/pretrain_tiny.py --max-steps 5` training on CPU (marked
slow: 75 s of the recipe's own shapes)."""

import importlib.util
from pathlib import Path

import pytest

from anneal.cli.recipe import config_from_args, load_recipe
from anneal.resolution.resolve import resolve_launch
from launcher import hostfile
from tests.conftest import ROOT, read_metrics, run_recipe

RECIPES = sorted((ROOT / "recipes").glob("pretrain_*.py"))
HOSTFILES = sorted((ROOT / "hostfiles").iterdir())
# One process, one 8-GPU node, and each shipped hostfile's total slots.
WORLDS = sorted({1, 8, *(sum(hostfile.parse(p).values()) for p in HOSTFILES)})


def test_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert {
        "pretrain_tiny",
        "pretrain_125m",
        "pretrain_350m",
        "pretrain_1b",
        "pretrain_7b",
    } <= names


def plan_for(path: Path, argv: list[str], *, device: str, world: int):
    spec = load_recipe(path)
    cfg, overrides = config_from_args(argv, prog=str(path), on_cpu=device == "cpu", **spec)
    return spec, resolve_launch(cfg, overrides, world_size=world, device_type=device)


SPARSE_RECIPES = {
    "moe_tiny": "tiny-moe",
    "moe_1b_7b": "olmoe-1b-7b",
    "moe_30b_a3b": "qwen3-30b-a3b",
}
"""The sparse recipes' presets (recipes/pretrain_moe_*.py); every other recipe is named after
its preset."""


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_resolves_with_its_defaults(path, device, world, stdlib_data, tmp_path):
    spec, plan = plan_for(
        path,
        ["--data", str(stdlib_data), "--out", str(tmp_path / "run")],
        device=device,
        world=world,
    )
    ds, optim = plan.ds_config, spec["optim"]
    name = path.stem.removeprefix("pretrain_")
    assert plan.cfg.model.preset == spec["preset"] == SPARSE_RECIPES.get(name, name)
    cpu = spec.get("cpu_ds_config", "cpu.json")  # a sparse recipe's: ZeRO-2 (AutoEP)
    assert plan.cfg.ds_config == (spec["ds_config"] if device == "cuda" else cpu)
    # The recipe's global batch, split exactly across the ranks.
    assert ds["train_batch_size"] * plan.seq_len == optim.global_batch_tokens
    assert ds["train_batch_size"] == (
        ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world
    )
    # The recipe's schedule, fitting the recipe's run.
    sched = ds["scheduler"]["params"]
    assert ds["optimizer"]["params"]["lr"] == optim.lr
    assert sched["total_num_steps"] == plan.cfg.train.max_steps
    assert 0 < sched["warmup_num_steps"] <= plan.cfg.train.max_steps // 10
    # Precision: bf16 on GPUs, fp32 on CPUs (no fast bf16 there).
    assert plan.bf16 is (device == "cuda")
    assert plan.describe().count("\n") >= 5


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_short_smoke_run_resolves(path, device, stdlib_data, tmp_path):
    """The first thing anyone runs on a new cluster: a few steps with the shipped defaults."""
    for steps in (1, 5, 20):
        _, plan = plan_for(
            path,
            ["--data", str(stdlib_data), "--out", str(tmp_path), "--max-steps", str(steps)],
            device=device,
            world=16,
        )
        assert plan.ds_config["scheduler"]["params"]["warmup_num_steps"] <= steps


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


@pytest.mark.parametrize("n_gpus", [1, 8])
def test_make_demo_resolves_on_a_gpu_machine(n_gpus, stdlib_data, tmp_path):
    demo = load_demo()
    cmd = demo.demo_command(
        n_procs=n_gpus, steps=demo.DEFAULT_STEPS, out=str(tmp_path), data=str(stdlib_data), port=1
    )
    recipe = next(a for a in cmd if a.startswith("recipes/"))
    assert cmd[cmd.index("--num_gpus") + 1] == str(n_gpus)
    _, plan = plan_for(ROOT / recipe, cmd[cmd.index(recipe) + 1 :], device="cuda", world=n_gpus)
    assert plan.cfg.ds_config == demo.DS_CONFIG == "zero2_bf16.json" and plan.bf16
    assert plan.cfg.train.max_steps == demo.DEFAULT_STEPS
    assert plan.cfg.train.eval_tasks == (demo.TASK,)  # scored in lockstep on any GPU count


def test_the_demos_extra_sets_come_after_its_own(stdlib_data, tmp_path):
    """``scripts/demo.py --set`` (bench_demo's --smoke: a shorter validation and scoring)
    overrides the demo's own settings of the same key, and leaves the others as shipped."""
    demo = load_demo()
    sets = ("train.val_samples=16", "train.eval_tasks_limit=16")
    cmd = demo.demo_command(
        n_procs=2, steps=2, out=str(tmp_path), data=str(stdlib_data), port=1, sets=sets
    )
    recipe = next(a for a in cmd if a.startswith("recipes/"))
    _, plan = plan_for(ROOT / recipe, cmd[cmd.index(recipe) + 1 :], device="cpu", world=2)
    assert plan.cfg.train.val_samples == 16 != demo.VAL_WINDOWS
    assert plan.cfg.train.eval_tasks_limit == 16 and plan.cfg.train.eval_tasks == (demo.TASK,)


def test_big_recipes_checkpoint_activations():
    for name in ("1b", "7b"):
        assert load_recipe(ROOT / "recipes" / f"pretrain_{name}.py")[
            "model"
        ].activation_checkpointing


def test_recipe_flags():
    spec = load_recipe(ROOT / "recipes" / "pretrain_tiny.py")
    cfg, overrides = config_from_args(
        [
            "--out",
            "o",
            "--data",
            "d",
            "--ds-config",
            "cpu.json",
            "--max-steps",
            "9",
            "--resume",
            "none",
            "--val-every",
            "3",
            "--save-every",
            "4",
            "--seed",
            "5",
            "--set",
            "ds.gradient_clipping=0.5",
            "--set",
            "optim.lr=1e-3",
            "--local_rank",
            "0",
        ],
        prog="x.py",
        **spec,
    )
    assert (cfg.out, cfg.data.path, cfg.ds_config, cfg.resume) == ("o", "d", "cpu.json", "none")
    assert cfg.resume_explicit and cfg.optim.lr == 1e-3
    t = cfg.train
    assert (t.max_steps, t.val_every, t.save_every, t.seed) == (9, 3, 4, 5)
    assert overrides == ["ds.gradient_clipping=0.5", "optim.lr=1e-3"]


@pytest.mark.slow
def test_tiny_trains_on_cpu_with_its_defaults(stdlib_data, tmp_path):
    """Slow (65 s on 2 cores in `make test-all` with five steps, 2026-12-07; two now, the
    compute of a step at these shapes being most of it): the recipe's own shapes and batch
    (7.4M parameters, 64 x 256 tokens a step), two steps and a validation, end to end. The
    fast suite trains the same path on small shapes (test_schedule, test_observe) and resolves
    these defaults above."""
    done = run_recipe(
        ["--max-steps", "2", "--data", str(stdlib_data), "--out", str(tmp_path / "run")]
    )
    assert "no GPU found: using ds_configs/cpu.json" in done.stdout
    assert "warmup_num_steps = 0 (auto" in done.stdout
    rows = read_metrics(tmp_path / "run", "train")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["tokens"] == 2 * 64 * 256
    assert read_metrics(tmp_path / "run", "val")
