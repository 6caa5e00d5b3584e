"""DeepSpeed JSON (anneal.resolution.ds, ds_schema, ds_resolve) is read strictly: typos, wrong
types, duplicate keys and broken JSON are errors that name the file and key; ``--set ds.*``
overrides go through the same schema. The run-dependent values written ``"auto"`` are filled
from the run config by the documented rules (batch from the recipe's global batch, LR from the
recipe, warmup capped at a share of the run), explicit values in the file are kept, and a warmup
longer than the run is an error that says how to fix it."""

import json
import math

import pytest

from anneal.config.ds_schema import DS_SCHEMA
from anneal.config.run import OptimConfig
from anneal.errors import UserError
from anneal.resolution import ds as dslib

OPTIM = OptimConfig(lr=6e-4, global_batch_tokens=2**19, warmup_tokens=375_000_000)


def write(tmp_path, cfg, name="c.json"):
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg, indent=2))
    return path


@pytest.fixture
def base():
    return json.loads((dslib.DS_CONFIG_DIR / "zero3_bf16.json").read_text())


def resolve(cfg, *, world=16, max_steps=5000, seq_len=2048, optim=OPTIM, optim_set=()):
    return dslib.resolve_ds_config(
        cfg,
        source="c.json",
        data_parallel_size=world,
        max_steps=max_steps,
        seq_len=seq_len,
        optim=optim,
        optim_set=frozenset(optim_set),
    )


def test_auto_values_are_filled_from_the_run(tmp_path, base):
    cfg = dslib.load_ds_config(write(tmp_path, base))
    resolved, sources = resolve(cfg, world=16, max_steps=100_000)
    # 2**19 tokens / 2048 = 256 samples = micro 4 x 16 ranks x 4 accumulation steps
    assert resolved["train_batch_size"] == 256 and resolved["gradient_accumulation_steps"] == 4
    assert resolved["optimizer"]["params"]["lr"] == 6e-4
    sched = resolved["scheduler"]["params"]
    assert sched["total_num_steps"] == 100_000
    assert sched["warmup_num_steps"] == math.ceil(375_000_000 / 2**19) == 716  # GPT-3's tokens
    assert cfg["train_batch_size"] == "auto"  # the loaded dict is not modified
    assert "recipe" in sources["optimizer.params.lr"]
    assert "auto" in sources["scheduler.params.warmup_num_steps"]


@pytest.mark.parametrize(
    "max_steps,expect", [(5, 0), (20, 2), (200, 20), (7159, 715), (10**6, 716)]
)
def test_auto_warmup_is_capped_at_a_share_of_the_run(tmp_path, base, max_steps, expect):
    cfg = dslib.load_ds_config(write(tmp_path, base))
    resolved, _ = resolve(cfg, max_steps=max_steps)
    warm = resolved["scheduler"]["params"]["warmup_num_steps"]
    assert warm == expect == min(math.ceil(375e6 / 2**19), math.floor(0.1 * max_steps))
    assert warm <= max_steps


def test_explicit_file_values_are_kept(tmp_path, base):
    base["optimizer"]["params"]["lr"] = 1e-4
    base["gradient_accumulation_steps"] = 2
    base["scheduler"]["params"]["warmup_num_steps"] = 50
    cfg = dslib.load_ds_config(write(tmp_path, base))
    resolved, sources = resolve(cfg, world=8)
    assert resolved["optimizer"]["params"]["lr"] == 1e-4
    assert resolved["train_batch_size"] == 4 * 2 * 8
    assert resolved["scheduler"]["params"]["warmup_num_steps"] == 50
    assert "ds_config" in sources["optimizer.params.lr"]


@pytest.mark.parametrize(
    "key,field",
    [
        (("optimizer", "params", "lr"), "lr"),
        (("gradient_accumulation_steps",), "global_batch_tokens"),
        (("scheduler", "params", "warmup_num_steps"), "warmup_tokens"),
    ],
)
def test_set_optim_beside_an_explicit_file_value_is_an_error(tmp_path, base, key, field):
    node = base
    for k in key[:-1]:
        node = node[k]
    node[key[-1]] = 2
    cfg = dslib.load_ds_config(write(tmp_path, base))
    with pytest.raises(UserError, match=f"--set optim.{field} would have no effect"):
        resolve(cfg, optim_set=[field])


def test_warmup_longer_than_the_run_is_an_error_with_the_fix(tmp_path, base):
    base["scheduler"]["params"]["warmup_num_steps"] = 2000
    cfg = dslib.load_ds_config(write(tmp_path, base))
    with pytest.raises(UserError) as e:
        resolve(cfg, max_steps=200)
    msg = str(e.value)
    assert "warmup_num_steps (2000) exceeds --max-steps (200)" in msg
    assert '"auto"' in msg and "--set ds.scheduler.params.warmup_num_steps" in msg


def test_recipe_global_batch_rounds_up(tmp_path, base):
    """2,048 tokens / 256 = 8 samples on 16 ranks x micro 4: rounded up to 64, saying so."""
    cfg = dslib.load_ds_config(write(tmp_path, base))
    resolved, sources = resolve(
        cfg, world=16, seq_len=256, optim=OptimConfig(global_batch_tokens=2048)
    )
    assert resolved["train_batch_size"] == 64 and resolved["gradient_accumulation_steps"] == 1
    assert (
        "= 8 samples, rounded up to a multiple of micro 4 x 16 ranks" in sources["train_batch_size"]
    )
    assert sources.messages == [
        "global batch rounded up from 8 to 64 samples (16,384 tokens per step): a multiple of "
        "micro-batch 4 x 16 data-parallel ranks (optim.global_batch_tokens sets it)"
    ]


def test_mismatched_train_batch_size(tmp_path, base):
    base["train_batch_size"] = 100
    base["gradient_accumulation_steps"] = 8
    cfg = dslib.load_ds_config(write(tmp_path, base))
    with pytest.raises(UserError) as e:
        resolve(cfg, world=2)
    assert "train_batch_size is 100" in str(e.value) and "= 64" in str(e.value)


def test_explicit_train_batch_size_sets_the_accumulation(tmp_path, base):
    base["train_batch_size"] = 64
    cfg = dslib.load_ds_config(write(tmp_path, base))
    resolved, _ = resolve(cfg, world=2)
    assert resolved["train_batch_size"] == 64 and resolved["gradient_accumulation_steps"] == 8


def test_total_steps_must_match_the_run(tmp_path, base):
    base["scheduler"]["params"]["total_num_steps"] = 10
    cfg = dslib.load_ds_config(write(tmp_path, base))
    with pytest.raises(UserError, match='total_num_steps is 10 .* Set it to "auto"'):
        resolve(cfg, max_steps=20)


def test_top_level_typo_is_an_error_with_a_suggestion(tmp_path, base):
    base["gradient_clipp1ng"] = base.pop("gradient_clipping")
    with pytest.raises(UserError) as e:
        dslib.load_ds_config(write(tmp_path, base))
    msg = str(e.value)
    assert "c.json" in msg and "'gradient_clipp1ng'" in msg and "gradient_clipping" in msg


def test_nested_typo_names_the_dotted_key(tmp_path, base):
    base["zero_optimization"]["stgae"] = 3
    with pytest.raises(UserError, match=r"zero_optimization\.stgae.*did you mean 'stage'"):
        dslib.load_ds_config(write(tmp_path, base))


def test_zero_keys_outside_the_schema_are_checked_by_deepspeeds_own_model(tmp_path, base):
    """DeepSpeed checks ``zero_optimization`` itself (its pydantic model forbids unknown keys),
    so a real ZeRO option that DS_SCHEMA does not list is taken as written and reaches
    DeepSpeed; a bad value for it is refused before any model is built; a typo is still refused,
    with DeepSpeed's names as the suggestion."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    key = "stage3_use_all_reduce_for_fetch_params"  # an alias of use_all_reduce_for_fetch_params
    assert key not in DS_SCHEMA["zero_optimization"]
    base["zero_optimization"]["zero_hpz_partition_size"] = 2  # a field name, no alias
    cfg = dslib.load_ds_config(write(tmp_path, base))
    over = dslib.override_ds_config(cfg, [(["zero_optimization", key], "true")], source="c")
    zero = DeepSpeedZeroConfig(**over["zero_optimization"])
    assert zero.use_all_reduce_for_fetch_params is True and zero.zero_hpz_partition_size == 2

    with pytest.raises(UserError, match=rf"refuses it: zero_optimization\.{key}: Input should"):
        dslib.override_ds_config(cfg, [(["zero_optimization", key], "maybe")], source="c")
    # DeepSpeed's checks that tie keys together run too: this one is for stage 1 or 2 only.
    no_norm = [(["zero_optimization", "compute_grad_norm"], "false")]
    with pytest.raises(UserError, match="compute_grad_norm=false is supported only with ZeRO"):
        dslib.override_ds_config(cfg, no_norm, source="c")
    stage1 = [*no_norm, (["zero_optimization", "stage"], "1")]
    stage1 = dslib.override_ds_config(cfg, stage1, source="c")
    assert stage1["zero_optimization"]["compute_grad_norm"] is False
    with pytest.raises(UserError, match=rf"did you mean '{key}'\?\). DeepSpeed would refuse it"):
        dslib.override_ds_config(cfg, [(["zero_optimization", key[:-1]], "true")], source="c")
    # Only that section: a typo one level down (offload_param) is Anneal's to refuse as before.
    with pytest.raises(UserError, match=r"'zero_optimization\.offload_param\.devcie'"):
        dslib.override_ds_config(
            cfg, [(["zero_optimization", "offload_param", "devcie"], "cpu")], source="c"
        )


@pytest.mark.parametrize(
    "path,value,expect",
    [
        (("train_micro_batch_size_per_gpu",), "4", "an integer"),
        (("gradient_clipping",), True, "a number"),
        (("bf16", "enabled"), "yes", "true or false"),
        (("zero_optimization",), 3, "an object"),
        (("train_batch_size",), 12.5, 'an integer or "auto"'),
        (("optimizer", "params", "lr"), "fast", 'a number or "auto"'),
        (("scheduler", "params", "warmup_num_steps"), 1.5, 'an integer or "auto"'),
    ],
)
def test_wrong_types(tmp_path, base, path, value, expect):
    node = base
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    with pytest.raises(UserError) as e:
        dslib.load_ds_config(write(tmp_path, base))
    assert f"'{'.'.join(path)}'" in str(e.value) and expect in str(e.value)


def test_not_json_gives_line_and_column(tmp_path):
    text = '{\n  "train_micro_batch_size_per_gpu": 4,\n  "bf16": {"enabled": tru}\n}'
    path = write(tmp_path, text)
    with pytest.raises(UserError, match=r"c\.json: not valid JSON at line 3, column 23"):
        dslib.load_ds_config(path)


def test_duplicate_keys_are_errors(tmp_path):
    path = write(tmp_path, '{"gradient_clipping": 1.0, "gradient_clipping": 0.5}')
    with pytest.raises(UserError, match="'gradient_clipping' is set twice"):
        dslib.load_ds_config(path)


def test_missing_required_key(tmp_path, base):
    del base["train_micro_batch_size_per_gpu"]
    with pytest.raises(UserError, match="missing required key 'train_micro_batch_size_per_gpu'"):
        dslib.load_ds_config(write(tmp_path, base))


def test_unknown_file_lists_shipped_configs():
    with pytest.raises(UserError, match="zero3_bf16.json"):
        dslib.find_ds_config("zero9.json")


def test_ds_overrides_revalidate(tmp_path, base):
    cfg = dslib.load_ds_config(write(tmp_path, base))
    over = dslib.override_ds_config(cfg, [(["zero_optimization", "stage"], "2")], source="c")
    assert over["zero_optimization"]["stage"] == 2
    with pytest.raises(UserError, match="unknown key 'gradient_clipp1ng'"):
        dslib.override_ds_config(cfg, [(["gradient_clipp1ng"], "1")], source="c")
    with pytest.raises(UserError, match="must be a number"):
        dslib.override_ds_config(cfg, [(["gradient_clipping"], "big")], source="c")
    with pytest.raises(UserError, match="'gradient_clipping' is a value .* not an object"):
        dslib.override_ds_config(cfg, [(["gradient_clipping", "x"], "1")], source="c")
    with pytest.raises(UserError, match="empty key"):
        dslib.override_ds_config(cfg, [(["optimizer", "", "lr"], "1")], source="c")


@pytest.mark.parametrize("path", sorted(dslib.DS_CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_ds_config_validates_and_leaves_the_run_to_the_recipe(path):
    cfg = dslib.load_ds_config(path)
    for key in ("train_batch_size", "gradient_accumulation_steps"):
        assert cfg[key] == "auto", key
    assert cfg["optimizer"]["params"]["lr"] == "auto"
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == "auto"
    resolved, _ = resolve(
        cfg,
        world=8,
        max_steps=100_000,
        seq_len=256,
        optim=OptimConfig(global_batch_tokens=64 * 256),
    )
    assert resolved["gradient_clipping"] == 1.0
    opt = resolved["optimizer"]["params"]
    assert resolved["optimizer"]["type"] == "AdamW"
    assert opt["betas"] == [0.9, 0.95] and opt["eps"] == 1e-8 and opt["weight_decay"] == 0.1
    sched = resolved["scheduler"]["params"]
    assert sched["warmup_type"] == "linear" and sched["cos_min_ratio"] == 0.1
    assert "bf16" in resolved
    if not path.name.startswith("cpu"):  # cpu.json, cpu_zero2.json: fp32 for CPUs
        assert resolved["bf16"]["enabled"] is True


@pytest.mark.parametrize("path", sorted(dslib.DS_CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_no_shipped_ds_config_needs_an_op_build_for_its_optimizer(path):
    # Without torch_adam DeepSpeed's AdamW is FusedAdam, JIT-built with nvcc, which a pip
    # install of torch does not bring: the first GPU run must not hinge on that build. The
    # offload config's optimizer is DeepSpeed's CPU Adam (a host op), the one exception.
    ds = dslib.load_ds_config(path)
    offloaded = "offload_optimizer" in ds.get("zero_optimization", {})
    assert ds["optimizer"]["params"].get("torch_adam", False) is not offloaded
