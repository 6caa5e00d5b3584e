"""``optim.optimizer=muon`` resolved before launch (``anneal.resolution.optimizer``): the
ds_config the engine gets (DeepSpeed's ``"type": "Muon"`` with both LRs, momentum and
Newton-Schulz method written out; ``reduce_scatter: false`` at ZeRO-3 on the CPU and the GPU
path alike, never asked of the user), the summary naming which parameters take Muon, and each
bad setting refused on every rank with one paragraph that names the key and the fix, before
anything is written: Muon with offload, with tensor or sequence parallelism, a Muon LR of 0, a
momentum of 1, an unknown Newton-Schulz method, a file of type Muon beside
``optim.optimizer=adamw``, Muon's keys under AdamW."""

from __future__ import annotations

import pytest

from tests.conftest import refused_tiny, resolve_tiny, sets

MUON = sets("optim.optimizer=muon")


def _args(data, out, *extra):
    return ["--out", str(out), "--data", str(data), *extra]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_muon_resolves_into_deepspeeds_section(tiny_data, tmp_path, device_type):
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.resolution.resolve import resolve_launch
    from tests.conftest import ROOT

    tiny = ROOT / "recipes" / "pretrain_tiny.py"
    args = _args(tiny_data, tmp_path / "run", *MUON, *sets("optim.muon_lr=0.002"))
    cfg, overrides = config_from_args(
        args, prog=str(tiny), on_cpu=device_type == "cpu", **load_recipe(tiny)
    )
    launch = resolve_launch(cfg, overrides, world_size=2, device_type=device_type)
    ds = launch.ds_config
    assert ds["optimizer"]["type"] == "Muon"
    params = ds["optimizer"]["params"]
    assert (params["muon_lr"], params["adam_lr"]) == (0.002, cfg.optim.lr)
    assert (params["momentum"], params["ns_method"]) == (0.95, "gram")
    assert launch.zero_stage == 3 and ds["zero_optimization"]["reduce_scatter"] is False
    text = launch.describe()
    assert "optimizer muon: hidden matrices on Muon; embeddings, lm_head, norms, biases on " in text
    assert "zero_optimization.reduce_scatter = false" in text
    assert not (tmp_path / "run").exists()


def test_adamw_keeps_its_section_and_zero2_keeps_reduce_scatter(tiny_data, tmp_path):
    adamw = resolve_tiny(_args(tiny_data, tmp_path / "a"), world_size=2)
    assert adamw.ds_config["optimizer"]["type"] == "AdamW"
    assert "reduce_scatter" not in adamw.ds_config["zero_optimization"]
    assert "optimizer muon" not in adamw.describe()
    zero2 = resolve_tiny(
        _args(tiny_data, tmp_path / "b", *MUON, *sets("ds.zero_optimization.stage=2")),
        world_size=2,
    )
    assert "reduce_scatter" not in zero2.ds_config["zero_optimization"]
    assert zero2.ds_config["optimizer"]["params"]["muon_lr"] == zero2.cfg.optim.lr


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--ds-config", "zero3_offload_bf16.json"], "zero_optimization.offload_optimizer"),
        (sets("ds.tensor_parallel.autotp_size=2"), "tensor_parallel.autotp_size is 2"),
        (
            sets("ds.sequence_parallel_size=2", "model.num_attention_heads=4"),
            "sequence_parallel_size is 2",
        ),
        (sets("optim.muon_lr=0"), "optim.muon_lr is 0"),
        (sets("ds.optimizer.params.muon_lr=0"), "optimizer.params.muon_lr is 0"),
        (sets("ds.optimizer.params.momentum=1.0"), "optimizer.params.momentum is 1.0"),
        (sets("ds.optimizer.params.ns_method=cubic"), "optimizer.params.ns_method"),
    ],
)
def test_bad_muon_settings_are_one_paragraph_before_launch(tiny_data, tmp_path, extra, match):
    out = tmp_path / "run"
    text = refused_tiny(_args(tiny_data, out, *MUON, *extra), world_size=2)
    assert match in text and "\n" not in text
    assert "--set" in text  # the fix
    assert not out.exists()


def test_a_muon_file_needs_optim_optimizer_muon_and_adamw_refuses_muon_keys(tiny_data, tmp_path):
    text = refused_tiny(
        _args(tiny_data, tmp_path / "a", *sets("ds.optimizer.type=Muon")), world_size=1
    )
    assert 'optimizer.type is "Muon" but the run\'s optim.optimizer is adamw' in text
    assert "--set optim.optimizer=muon" in text
    text = refused_tiny(
        _args(tiny_data, tmp_path / "b", *sets("ds.optimizer.params.momentum=0.9")), world_size=1
    )
    assert "optimizer.params.momentum is Muon's" in text
    ok = resolve_tiny(
        _args(tiny_data, tmp_path / "c", *MUON, *sets("ds.optimizer.type=Muon")), world_size=1
    )
    assert ok.ds_config["optimizer"]["type"] == "Muon"


@pytest.mark.parametrize(
    "item, match",
    [
        ("optim.optimizer=lion", "optim.optimizer must be one of adamw, muon"),
        ("optim.muon_scale=spectral", "optim.muon_scale must be one of rms, deepspeed"),
    ],
)
def test_an_unknown_choice_is_refused_where_set_is_read(tiny_data, tmp_path, item, match):
    from anneal.errors import UserError

    with pytest.raises(UserError, match=match):
        resolve_tiny(_args(tiny_data, tmp_path / "run", *sets(item)), world_size=1)


def test_clipping_is_off_with_zero_and_kept_without(tiny_data, tmp_path):
    """DeepSpeed clips by the norm after Newton-Schulz with ZeRO (docs/training.md, "Muon
    beside AdamW"), by the gradients' without it."""
    for stage, want in ((1, 0.0), (3, 0.0), (0, 1.0)):
        launch = resolve_tiny(
            _args(
                tiny_data,
                tmp_path / f"z{stage}",
                *MUON,
                *sets(f"ds.zero_optimization.stage={stage}"),
            ),
            world_size=1,
        )
        assert launch.ds_config["gradient_clipping"] == want, stage
        assert ("gradient_clipping = 0 (the file's 1 is off under Muon" in launch.describe()) == (
            want == 0.0
        )
