"""DeepSpeed JSON is read strictly: typos, wrong types, duplicate keys, broken JSON and a
train_batch_size that disagrees with micro x accumulation x data-parallel size are errors that
name the file and key. Also the batch arithmetic and the --set overrides."""

import json

import pytest

from anneal import config as cfglib
from anneal.config import RunConfig
from anneal.errors import UserError


def write(tmp_path, cfg, name="c.json"):
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg, indent=2))
    return path


@pytest.fixture
def base():
    return json.loads((cfglib.DS_CONFIG_DIR / "zero3_bf16.json").read_text())


def test_batch_arithmetic():
    assert (
        cfglib.train_batch_size(micro_batch_per_gpu=4, grad_accum_steps=8, data_parallel_size=64)
        == 2048
    )
    with pytest.raises(UserError, match="gradient_accumulation_steps"):
        cfglib.train_batch_size(micro_batch_per_gpu=4, grad_accum_steps=0, data_parallel_size=1)


def test_auto_batch_and_total_steps_are_filled(tmp_path, base):
    cfg = cfglib.load_ds_config(write(tmp_path, base))
    resolved = cfglib.resolve_ds_config(cfg, source="c.json", data_parallel_size=16, max_steps=5000)
    assert resolved["train_batch_size"] == 4 * 8 * 16
    assert resolved["scheduler"]["params"]["total_num_steps"] == 5000
    assert cfg["train_batch_size"] == "auto"  # the loaded dict is not modified


def test_top_level_typo_is_an_error_with_a_suggestion(tmp_path, base):
    base["gradient_clipp1ng"] = base.pop("gradient_clipping")
    with pytest.raises(UserError) as e:
        cfglib.load_ds_config(write(tmp_path, base))
    msg = str(e.value)
    assert "c.json" in msg and "'gradient_clipp1ng'" in msg and "gradient_clipping" in msg


def test_nested_typo_names_the_dotted_key(tmp_path, base):
    base["zero_optimization"]["stgae"] = 3
    with pytest.raises(UserError, match=r"zero_optimization\.stgae.*did you mean 'stage'"):
        cfglib.load_ds_config(write(tmp_path, base))


@pytest.mark.parametrize(
    "path,value,expect",
    [
        (("train_micro_batch_size_per_gpu",), "4", "an integer"),
        (("gradient_clipping",), True, "a number"),
        (("bf16", "enabled"), "yes", "true or false"),
        (("zero_optimization",), 3, "an object"),
        (("train_batch_size",), 12.5, 'an integer or "auto"'),
    ],
)
def test_wrong_types(tmp_path, base, path, value, expect):
    node = base
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    with pytest.raises(UserError) as e:
        cfglib.load_ds_config(write(tmp_path, base))
    assert f"'{'.'.join(path)}'" in str(e.value) and expect in str(e.value)


def test_mismatched_train_batch_size(tmp_path, base):
    base["train_batch_size"] = 100
    cfg = cfglib.load_ds_config(write(tmp_path, base))
    with pytest.raises(UserError) as e:
        cfglib.resolve_ds_config(cfg, source="c.json", data_parallel_size=2, max_steps=10_000)
    assert "train_batch_size is 100" in str(e.value) and "= 64" in str(e.value)


def test_matching_train_batch_size_is_accepted(tmp_path, base):
    base["train_batch_size"] = 64
    cfg = cfglib.load_ds_config(write(tmp_path, base))
    assert (
        cfglib.resolve_ds_config(cfg, source="c", data_parallel_size=2, max_steps=10_000)[
            "train_batch_size"
        ]
        == 64
    )


def test_not_json_gives_line_and_column(tmp_path):
    text = '{\n  "train_micro_batch_size_per_gpu": 4,\n  "bf16": {"enabled": tru}\n}'
    path = write(tmp_path, text)
    with pytest.raises(UserError, match=r"c\.json: not valid JSON at line 3, column 23"):
        cfglib.load_ds_config(path)


def test_duplicate_keys_are_errors(tmp_path):
    path = write(tmp_path, '{"gradient_clipping": 1.0, "gradient_clipping": 0.5}')
    with pytest.raises(UserError, match="'gradient_clipping' is set twice"):
        cfglib.load_ds_config(path)


def test_missing_required_key(tmp_path, base):
    del base["optimizer"]["params"]["lr"]
    with pytest.raises(UserError, match="missing required key 'optimizer.params.lr'"):
        cfglib.load_ds_config(write(tmp_path, base))


def test_unknown_file_lists_shipped_configs():
    with pytest.raises(UserError, match="zero3_bf16.json"):
        cfglib.find_ds_config("zero9.json")


@pytest.mark.parametrize("path", sorted(cfglib.DS_CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_ds_config_validates(path):
    cfg = cfglib.load_ds_config(path)
    resolved = cfglib.resolve_ds_config(
        cfg, source=str(path), data_parallel_size=8, max_steps=100_000
    )
    assert resolved["gradient_clipping"] == 1.0
    opt = resolved["optimizer"]["params"]
    assert resolved["optimizer"]["type"] == "AdamW"
    assert opt["betas"] == [0.9, 0.95] and opt["eps"] == 1e-8 and opt["weight_decay"] == 0.1
    sched = resolved["scheduler"]["params"]
    assert sched["warmup_type"] == "linear" and sched["cos_min_ratio"] == 0.1
    assert "bf16" in resolved
    if path.name != "cpu.json":
        assert resolved["bf16"]["enabled"] is True


def test_overrides_are_typed_and_strict():
    cfg = RunConfig(out="o", ds_config="cpu.json")
    cfg = cfglib.apply_overrides(
        cfg,
        ["train.max_steps=7", "model.activation_checkpointing=true", "ds.gradient_clipping=0.5"],
    )
    assert cfg.train.max_steps == 7 and cfg.model.activation_checkpointing is True
    with pytest.raises(UserError, match="did you mean 'max_steps'"):
        cfglib.apply_overrides(cfg, ["train.max_step=7"])
    with pytest.raises(UserError, match="expected int"):
        cfglib.apply_overrides(cfg, ["train.max_steps=many"])
    with pytest.raises(UserError, match="section.key=value"):
        cfglib.apply_overrides(cfg, ["max_steps"])
    with pytest.raises(UserError, match="one of auto, bf16, fp32"):
        cfglib.apply_overrides(cfg, ["train.precision=fp8"])


def test_ds_overrides_revalidate(tmp_path, base):
    cfg = cfglib.load_ds_config(write(tmp_path, base))
    over = cfglib.override_ds_config(cfg, [(["zero_optimization", "stage"], "2")], source="c")
    assert over["zero_optimization"]["stage"] == 2
    with pytest.raises(UserError, match="unknown key 'gradient_clipp1ng'"):
        cfglib.override_ds_config(cfg, [(["gradient_clipp1ng"], "1")], source="c")
    with pytest.raises(UserError, match="must be a number"):
        cfglib.override_ds_config(cfg, [(["gradient_clipping"], "big")], source="c")


def test_config_differences_ignore_resume_keys():
    a = {
        "run": {"resume": "auto", "train": {"max_steps": 10, "log_every": 1}},
        "launch": {"world_size": 2},
    }
    b = {
        "run": {"resume": "none", "train": {"max_steps": 20, "log_every": 5}},
        "launch": {"world_size": 4},
    }
    assert cfglib.config_differences(a, b) == ["run.train.max_steps: 10 -> 20"]
