"""Every recipe loads and builds a valid run config through the real flag parser: its preset
exists, its ds_config validates at several data-parallel sizes, and its flags parse."""

import runpy
from pathlib import Path

import pytest

from anneal import config as cfglib
from anneal import model as modellib
from anneal.recipe import config_from_args

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").glob("pretrain_*.py"))


def recipe(path: Path) -> dict:
    return runpy.run_path(str(path), run_name="recipe_under_test")["RECIPE"]


def test_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert {
        "pretrain_tiny",
        "pretrain_125m",
        "pretrain_350m",
        "pretrain_1b",
        "pretrain_7b",
    } <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
@pytest.mark.parametrize("world", [1, 8, 64])
def test_recipe_config_validates(path, world):
    spec = recipe(path)
    assert path.stem == f"pretrain_{spec['preset']}"
    cfg, overrides = config_from_args(
        ["--out", "runs/x", "--max-steps", "5000", "--set", "train.log_every=5"],
        prog=str(path),
        **spec,
    )
    assert cfg.model.preset == spec["preset"] and cfg.train.max_steps == 5000
    assert cfg.ds_config == spec["ds_config"]
    ds = cfglib.load_ds_config(cfglib.find_ds_config(cfg.ds_config))
    resolved = cfglib.resolve_ds_config(
        ds, source=cfg.ds_config, data_parallel_size=world, max_steps=cfg.train.max_steps
    )
    assert resolved["train_batch_size"] == (
        resolved["train_micro_batch_size_per_gpu"] * resolved["gradient_accumulation_steps"] * world
    )
    assert modellib.count_params(cfg.model.resolve(32000)) > 0


@pytest.mark.parametrize("name", ["1b", "7b"])
def test_big_recipes_checkpoint_activations(name):
    assert recipe(ROOT / "recipes" / f"pretrain_{name}.py")["model"].activation_checkpointing


def test_cpu_machines_get_the_cpu_config():
    spec = recipe(ROOT / "recipes" / "pretrain_tiny.py")
    cfg, _ = config_from_args([], prog="recipes/pretrain_tiny.py", on_cpu=True, **spec)
    assert cfg.ds_config == "cpu.json" and cfg.out == "runs/pretrain_tiny"
    cfg, _ = config_from_args(["--ds-config", "zero2_bf16.json"], prog="x.py", on_cpu=True, **spec)
    assert cfg.ds_config == "zero2_bf16.json"


def test_recipe_flags():
    spec = recipe(ROOT / "recipes" / "pretrain_tiny.py")
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
            "--eval-every",
            "3",
            "--save-every",
            "4",
            "--seed",
            "5",
            "--set",
            "ds.gradient_clipping=0.5",
            "--local_rank",
            "0",
        ],
        prog="x.py",
        **spec,
    )
    assert (cfg.out, cfg.data.path, cfg.ds_config, cfg.resume) == ("o", "d", "cpu.json", "none")
    assert cfg.resume_explicit
    t = cfg.train
    assert (t.max_steps, t.eval_every, t.save_every, t.seed) == (9, 3, 4, 5)
    assert overrides == ["ds.gradient_clipping=0.5"]
