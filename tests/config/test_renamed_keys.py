"""Renamed config keys and flags still work and say their new name once per process: validation
is ``val`` (``train.val_every``, ``train.val_samples``, ``--val-every``), and the old ``eval``
names reach the same field through ``--set``, a recipe's ``TrainConfig``, the recipe flag and
the ``config.json`` of an older run (which compares equal to the same run launched today)."""

import dataclasses
import logging

import pytest

from anneal.cli.recipe import config_from_args
from anneal.config import run as runlib
from anneal.config.run import RunConfig, TrainConfig
from anneal.config.run_checks import apply_overrides
from anneal.config.run_compare import config_differences
from anneal.run_record import RunRecord


@pytest.fixture
def warnings_seen(monkeypatch, caplog):
    """A fresh process's record of warned names, and the warnings logged."""
    monkeypatch.setattr(runlib, "_warned", set())
    caplog.set_level(logging.WARNING, logger=runlib.log.name)
    return lambda: [r.getMessage() for r in caplog.records if "renamed" in r.getMessage()]


def _cfg() -> RunConfig:
    return RunConfig(out="runs/x", ds_config="cpu.json")


@pytest.mark.parametrize(
    "old, new, field",
    [
        ("train.eval_every", "train.val_every", "val_every"),
        ("train.eval_samples", "train.val_samples", "val_samples"),
    ],
)
def test_an_old_set_key_sets_the_new_field_and_warns_once(warnings_seen, old, new, field):
    cfg = apply_overrides(_cfg(), [f"{old}=7"])
    assert getattr(cfg.train, field) == 7
    cfg = apply_overrides(cfg, [f"{old}=8", f"{old}=9"])  # the same process: no second warning
    assert getattr(cfg.train, field) == 9
    assert warnings_seen() == [
        f"{old} is renamed {new}; the old name still works for now: use {new}"
    ]


def test_the_new_keys_warn_nothing(warnings_seen):
    cfg = apply_overrides(_cfg(), ["train.val_every=3", "train.val_samples=0"])
    assert (cfg.train.val_every, cfg.train.val_samples) == (3, 0)
    assert warnings_seen() == []


def test_a_recipe_written_with_the_old_keywords_still_builds(warnings_seen):
    train = TrainConfig(eval_every=50, eval_samples=16)
    assert (train.val_every, train.val_samples) == (50, 16)
    assert TrainConfig(eval_every=20).val_every == 20  # said once already
    assert sorted(warnings_seen()) == [
        "train.eval_every is renamed train.val_every; the old name still works for now: use "
        "train.val_every",
        "train.eval_samples is renamed train.val_samples; the old name still works for now: use "
        "train.val_samples",
    ]
    assert "eval_every" not in RunConfig(out="o", ds_config="c", train=train).to_dict()["train"]
    assert train.eval_samples == 16  # a script that reads the old name reads the new field
    moved = dataclasses.replace(train, val_every=7)  # replace knows only the new names
    assert (moved.val_every, moved.eval_every, moved.val_samples) == (7, 7, 16)
    assert TrainConfig(eval_every=1, val_every=2).val_every == 2  # both given: the new name's
    with pytest.raises(TypeError):
        TrainConfig(eval_everyy=1)


def test_the_old_flag_sets_val_every_and_warns_once(warnings_seen):
    common = dict(prog="recipes/pretrain_tiny.py", preset="tiny", ds_config="cpu.json")
    cfg, _ = config_from_args(["--eval-every", "5"], **common)
    assert cfg.train.val_every == 5
    cfg, _ = config_from_args(["--eval-every", "6"], **common)
    assert cfg.train.val_every == 6
    assert warnings_seen() == [
        "--eval-every is renamed --val-every; the old name still works for now: use --val-every"
    ]
    cfg, _ = config_from_args(["--val-every", "4"], **common)
    assert cfg.train.val_every == 4


def test_an_older_runs_config_json_is_the_same_run():
    """config.json written before the rename (``run.train.eval_every``) against today's launch
    of the same run: no difference; another value still differs, under the new name."""
    new = {"run": _cfg().to_dict()}
    old = {"run": _cfg().to_dict()}
    old["run"]["train"] = {
        ("eval_" + k[4:] if k in ("val_every", "val_samples") else k): v
        for k, v in old["run"]["train"].items()
    }
    assert "eval_every" in old["run"]["train"] and "val_every" not in old["run"]["train"]
    assert config_differences(old, new) == []
    old["run"]["train"]["eval_every"] = 3
    assert config_differences(old, new) == ["run.train.val_every: 3 -> 100"]


def test_the_cooldowns_parent_key_and_section_still_read(warnings_seen):
    """``train.branch_from`` (``--set``, a recipe) is ``train.cooldown_from``; an older cooldown
    run's ``branch`` section reads as its ``cooldown`` and compares equal to it."""
    cfg = apply_overrides(_cfg(), ["train.branch_from=runs/parent"])
    assert cfg.train.cooldown_from == "runs/parent"
    assert TrainConfig(branch_from="runs/p").cooldown_from == "runs/p"
    assert warnings_seen() == [
        "train.branch_from is renamed train.cooldown_from; the old name still works for now: "
        "use train.cooldown_from"
    ]
    start = {"parent_run": "/runs/parent", "step": 40, "from_ratio": 1.0}
    assert RunRecord({"branch": start}).cooldown == start
    assert RunRecord({"cooldown": start}).cooldown == start
    assert RunRecord({"run": {}}).cooldown is None
    old = {"branch": start, "run": _cfg().to_dict()}
    old["run"]["train"]["branch_from"] = old["run"]["train"].pop("cooldown_from")
    new = {"cooldown": start, "run": _cfg().to_dict()}
    assert config_differences(old, new) == []
    assert config_differences(old, {**new, "cooldown": {**start, "step": 41}}) == [
        "cooldown.step: 40 -> 41"
    ]
