"""The run config: typed, strict ``--set`` overrides (malformed ones are one-paragraph errors),
the one batch-arithmetic function, and which config differences block a relaunch."""

import pytest

from anneal.config.run import RunConfig
from anneal.config.run_checks import apply_overrides, optim_keys_set
from anneal.config.run_compare import config_differences
from anneal.errors import UserError
from anneal.resolution.ds_resolve import batch_arithmetic


def test_batch_arithmetic_from_accumulation():
    b = batch_arithmetic(micro_batch_per_gpu=4, grad_accum_steps=8, data_parallel_size=64)
    assert (b.train_batch_size, b.grad_accum_steps) == (2048, 8)
    with pytest.raises(UserError, match="gradient_accumulation_steps must be at least 1"):
        batch_arithmetic(micro_batch_per_gpu=4, grad_accum_steps=0, data_parallel_size=1)


def test_batch_arithmetic_from_global_batch():
    b = batch_arithmetic(micro_batch_per_gpu=8, train_batch_size=256, data_parallel_size=16)
    assert (b.train_batch_size, b.grad_accum_steps) == (256, 2)
    b = batch_arithmetic(micro_batch_per_gpu=4, train_batch_size=64, data_parallel_size=16)
    assert b.grad_accum_steps == 1


@pytest.mark.parametrize("total,micro,world", [(64, 8, 16), (100, 4, 8), (256, 8, 24)])
def test_a_batch_that_does_not_divide_is_an_error(total, micro, world):
    with pytest.raises(UserError) as e:
        batch_arithmetic(
            micro_batch_per_gpu=micro, train_batch_size=total, data_parallel_size=world
        )
    msg = str(e.value)
    assert f"{total} samples" in msg and f"= {micro * world} samples" in msg
    assert "optim.global_batch_tokens" in msg


def test_both_given_must_agree():
    with pytest.raises(UserError, match="train_batch_size is 100 .* = 64"):
        batch_arithmetic(
            micro_batch_per_gpu=4, grad_accum_steps=8, data_parallel_size=2, train_batch_size=100
        )


def test_overrides_are_typed_and_strict():
    cfg = RunConfig(out="o", ds_config="cpu.json")
    cfg = apply_overrides(
        cfg,
        ["train.max_steps=7", "model.activation_checkpointing=true", "ds.gradient_clipping=0.5"],
    )
    assert cfg.train.max_steps == 7 and cfg.model.activation_checkpointing is True
    with pytest.raises(UserError, match="did you mean 'max_steps'"):
        apply_overrides(cfg, ["train.max_step=7"])
    with pytest.raises(UserError, match="expected int"):
        apply_overrides(cfg, ["train.max_steps=many"])
    with pytest.raises(UserError, match="section.key=value"):
        apply_overrides(cfg, ["max_steps"])
    with pytest.raises(UserError, match="one of auto, bf16, fp32"):
        apply_overrides(cfg, ["train.precision=fp8"])


def test_optim_overrides_are_typed():
    cfg = apply_overrides(
        RunConfig(out="o", ds_config="cpu.json"),
        ["optim.lr=6e-4", "optim.global_batch_tokens=1048576"],
    )
    assert cfg.optim.lr == 6e-4 and cfg.optim.global_batch_tokens == 2**20
    assert optim_keys_set(["optim.lr=1", "train.seed=2", "ds.x=3"]) == {"lr"}


@pytest.mark.parametrize(
    "item,expect",
    [
        ("train.max_steps=", "expected int"),
        ("=5", "section.key=value"),
        ("train.=3", "train has no key ''"),
        ("foo.bar=1", "unknown section 'foo'"),
        ("optim.lr=fast", "expected float"),
    ],
)
def test_malformed_set_is_one_paragraph(item, expect):
    with pytest.raises(UserError) as e:
        apply_overrides(RunConfig(out="o", ds_config="cpu.json"), [item])
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_config_differences_ignore_resume_keys():
    a = {
        "run": {"resume": "auto", "train": {"max_steps": 10, "log_every": 1}},
        "launch": {"world_size": 2},
    }
    b = {
        "run": {"resume": "none", "train": {"max_steps": 20, "log_every": 5}},
        "launch": {"world_size": 4},
    }
    assert config_differences(a, b) == ["run.train.max_steps: 10 -> 20"]


def test_the_split_of_the_same_global_batch_over_other_ranks_is_the_same_run():
    """A job resubmitted on fewer nodes accumulates more micro-batches into the same global
    batch: not a different run. Another global batch is."""

    def doc(ranks, batch=16, micro=4):
        accum = batch // (micro * ranks)
        return {
            "ds_config": {
                "train_batch_size": batch,
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": accum,
            },
            "resolved_from": {
                "gradient_accumulation_steps": f"{accum} (auto: {batch} / (micro {micro} x "
                f"{ranks} ranks))"
            },
            "launch": {"world_size": ranks},
        }

    assert config_differences(doc(2), doc(1)) == []
    assert config_differences(doc(2), doc(1, micro=2)) == []
    assert config_differences(doc(2), doc(2, batch=32)) == [
        "ds_config.gradient_accumulation_steps: 2 -> 4",
        "ds_config.train_batch_size: 16 -> 32",
        "resolved_from.gradient_accumulation_steps: '2 (auto: 16 / (micro 4 x 2 ranks))' -> "
        "'4 (auto: 32 / (micro 4 x 2 ranks))'",
    ]
