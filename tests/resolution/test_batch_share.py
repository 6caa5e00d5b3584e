"""A global batch that is a large share of the train split (issue 46, point 1): the continued-
pretraining recipe's 4M tokens a step passed 2.7 times over a small corpus in one step, for
ten minutes on CPU, without a word. One step over a tenth of the split is a note with the
numbers and the ``--set`` that gives about a hundredth; one step over the whole split is
refused, by the ranks and by the launcher's pre-flight, before anything is written.
tiny_data's train split holds 83,983 tokens; the tiny recipe's step is 64 x 256 tokens."""

from __future__ import annotations

import pytest

from anneal.errors import UserError
from anneal.resolution.batch_share import check_batch_share, suggested_tokens
from tests.conftest import resolve_tiny


def _launch(tiny_data, tmp_path, *sets: str):
    args = ["--data", str(tiny_data), "--out", str(tmp_path / "run")]
    for item in sets:
        args += ["--set", item]
    return resolve_tiny(args, world_size=1)


def test_a_step_over_a_tenth_of_the_split_is_a_note_with_the_fix(tiny_data, tmp_path):
    launch = _launch(tiny_data, tmp_path)
    split = launch.meta["splits"]["train"]["tokens"]
    before = list(launch.notes)
    check_batch_share(launch)
    [note] = launch.notes[len(before) :]
    assert note.startswith(
        f"one optimizer step is 16,384 tokens (64 sequences of 256 tokens: micro-batch 4 x 16 "
        f"accumulation steps x 1 data-parallel ranks), {16384 / split:.0%} of the train split"
    )
    assert f"a pass over the data every {split / 16384:.1f} steps" in note
    assert "give --set optim.global_batch_tokens=1024" in note  # 1%: 839 -> one micro-batch


def test_a_batch_the_ds_config_fixes_is_fixed_there(tiny_data, tmp_path):
    launch = _launch(tiny_data, tmp_path, "ds.gradient_accumulation_steps=64")
    check_batch_share(launch)
    assert "give --set ds.gradient_accumulation_steps=1" in launch.notes[-1]


def test_a_small_batch_says_nothing_and_one_over_the_split_is_refused(tiny_data, tmp_path):
    launch = _launch(tiny_data, tmp_path, "optim.global_batch_tokens=2048")
    before = list(launch.notes)
    check_batch_share(launch)
    assert launch.notes == before
    launch = _launch(tiny_data, tmp_path, "optim.global_batch_tokens=131072")
    with pytest.raises(UserError) as refused:
        check_batch_share(launch)
    text = str(refused.value)
    assert refused.value.every_rank
    assert f"--data {tiny_data}: one optimizer step is 131,072 tokens" in text
    assert "more than the whole train split (83,983 tokens)" in text
    assert "give --set optim.global_batch_tokens=1024, or prepare more data" in text


def test_the_launchers_preflight_refuses_it_before_anything_starts(tiny_data, tmp_path, capsys):
    from launcher.__main__ import main as launcher_main

    out = tmp_path / "run"
    argv = ["run", "recipes/pretrain_tiny.py", "--num-gpus", "1", "--device", "cpu", "--dry-run"]
    argv += ["--", "--out", str(out), "--data", str(tiny_data)]
    assert launcher_main([*argv, "--set", "optim.global_batch_tokens=131072"]) == 2
    assert "more than the whole train split" in capsys.readouterr().err and not out.exists()


def test_the_suggestion_is_a_power_of_two_of_about_a_hundredth():
    assert suggested_tokens(3_319_871, least=1024) == 32768
    assert suggested_tokens(1_580_000, least=1024) == 8192
    assert suggested_tokens(50_000, least=1024) == 1024  # never below one micro-batch
