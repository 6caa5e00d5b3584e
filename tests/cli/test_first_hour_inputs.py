"""Bad inputs still open from the earlier sweeps (issue 46): each is one paragraph that names
the flag and a fix that works, exit status 2, no traceback. ``anneal data prepare --out`` where
no directory can be made; ``--data`` a raw corpus (the fix prepares it into a new directory,
not into itself, which prepare refuses); ``anneal plan`` with a target loss that is not a
number, or a budget off by dozens of orders of magnitude; ``--init-from`` an Anneal run or one
of its checkpoints (the fix is ``anneal export``); a ``--set`` value out of range quotes the
value it replaces (the recipe's), not the dataclass default. (The export of a bit-rotted tag no
longer offers that tag among the intact ones: tests/hf/test_hostile_export.py.)"""

from __future__ import annotations

import json

import pytest

from anneal.errors import UserError


def cli(capsys, *argv) -> tuple[int, str]:
    from anneal.cli import main

    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, err


def test_prepare_out_where_no_directory_can_be_made(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("a small document\n" * 20)
    rc, err = cli(capsys, "data", "prepare", "--input", src, "--out", "/proc/anneal-out")
    assert rc == 2 and "--out /proc/anneal-out: cannot create a directory there" in err


def test_data_that_is_a_raw_corpus_is_prepared_into_a_new_directory(tmp_path):
    from anneal.data.checks import check_prepared
    from anneal.eval import next_line

    raw = tmp_path / "corpus"
    raw.mkdir()
    (raw / "a.txt").write_text("my own text\n")
    fix = f"`anneal data prepare --input {raw} --out {raw}-prepared`, then give {raw}-prepared"
    for refuse in (lambda: check_prepared(raw), lambda: next_line.build(raw, tmp_path / "w")):
        with pytest.raises(UserError) as refused:
            refuse()
        assert fix in str(refused.value) and f"--out {raw}`" not in str(refused.value)
    with pytest.raises(UserError) as refused:
        check_prepared(tmp_path / "new")
    assert f"--out {tmp_path / 'new'}`" in str(refused.value)  # a new one: prepared in place


@pytest.mark.parametrize(
    "flag,value,words",
    [
        ("--target-loss", "nan", ["--target-loss nan: not a finite number", "above"]),
        ("--target-loss", "inf", ["--target-loss inf: not a finite number"]),
        ("--params", "1e-30", ["--params 1e-30: outside what a plan can answer", "7e9"]),
        ("--tokens", "1e60", ["--tokens 1e+60: outside what a plan can answer", "2e12"]),
        ("--flops", "1e60", ["--flops 1e+60: outside what a plan can answer"]),
    ],
)
def test_plan_refuses_what_is_no_budget(capsys, flag, value, words):
    rc, err = cli(capsys, "plan", flag, value)
    assert rc == 2 and all(w in err for w in words), err
    assert "impossible" not in err


def test_init_from_an_anneal_run_says_to_export_it_first(tmp_path):
    from anneal.hf.load import read_hf_config

    run = tmp_path / "run"
    tag = run / "checkpoints" / "step00000002"
    tag.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"run": {}, "ds_config": {}}))
    for given, fix in ((run, f"anneal export {run} --out"), (tag, f"{run} --tag {tag.name}")):
        with pytest.raises(UserError) as refused:
            read_hf_config(given)
        assert "not a Hugging Face model directory" in str(refused.value)
        assert fix in str(refused.value) and "model_type" not in str(refused.value)


def test_a_set_value_out_of_range_quotes_the_value_it_replaces():
    import dataclasses

    from anneal.config.run import OptimConfig, RunConfig
    from anneal.config.run_checks import apply_overrides

    recipe = RunConfig(out="x", ds_config="cpu.json", optim=OptimConfig(lr=3e-3))
    assert OptimConfig().lr != 3e-3  # the dataclass default differs from the recipe's
    with pytest.raises(UserError) as refused:
        apply_overrides(recipe, ["optim.lr=nan"])
    text = str(refused.value)
    assert "optim.lr is nan" in text and "keep the value it replaces (0.003)" in text
    assert repr(OptimConfig().lr) not in text
    assert dataclasses.asdict(apply_overrides(recipe, ["optim.lr=1e-3"]).optim)["lr"] == 1e-3
