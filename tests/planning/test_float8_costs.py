"""float8 in the plan (anneal/planning/float8_costs.py): the layers and FLOPs of the 1b preset
by float8_rule against a count by hand, the estimate's memory difference against its closed
form (model states and activations unchanged; the casts in flight; at ZeRO-3 the gathered
weights held to backward), the forecast's step at the float8 peak with MFU against the bf16
peak, and `anneal estimate`'s float8 lines and levers. Slow (torchao's import): what torchao's
Float8Linear saves for backward, in this process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from anneal import cli
from anneal.model import flops_per_token, get_preset
from anneal.planning import float8_costs, forecast, memory
from anneal.planning.float8_costs import Float8Setting

H, INTER, LAYERS = 2048, 5504, 18  # the 1b preset
TOKENS = 4 * 2048  # zero3_bf16.json's micro-batch 4 x the preset's 2,048 context
TENSORWISE = Float8Setting(recipe="tensorwise")
ROWWISE = Float8Setting(recipe="rowwise")


def _zero(stage: int) -> memory.ZeroSetup:
    return memory.ZeroSetup(stage=stage)


def _work(setting: Float8Setting, n_gpus: int = 8) -> memory.Workload:
    return memory.Workload(micro_batch=4, seq_len=2048, n_gpus=n_gpus, float8=setting)


def test_the_1b_layers_and_flops_are_float8_rules():
    """tensorwise: every hidden matrix but the first (q_proj of layer 0); rowwise: only the
    MLP's gate and up projections (N 5504 > 4096, K 2048 > 1024); 6 N K FLOPs a token each."""
    preset = get_preset("1b")
    layer = 4 * H * H + 3 * H * INTER
    tensorwise = float8_costs.converted_linears(preset, TENSORWISE)
    assert len(tensorwise) == 7 * LAYERS - 1
    assert float8_costs.float8_flops_per_token(preset, TENSORWISE) == 6 * (LAYERS * layer - H * H)
    assert len(float8_costs.converted_linears(preset, ROWWISE)) == 2 * LAYERS
    assert float8_costs.float8_flops_per_token(preset, ROWWISE) == 6 * 2 * LAYERS * H * INTER
    assert float8_costs.converted_linears(preset, Float8Setting()) == []


@pytest.mark.parametrize(
    "stage, compiled, n_gpus", [(3, False, 8), (3, True, 8), (2, False, 8), (3, False, 1)]
)
def test_the_memory_difference_is_the_closed_form(stage, compiled, n_gpus):
    """The largest cast point is the gate/up projection's second cast of its output gradient
    (T x 5504): eager ``10 T I + I h`` (one float8 copy held, the second with its two fp32
    temporaries, the weight), compiled ``2 T I + I h + T h`` (all four operands). At ZeRO-3
    over 8 ranks every converted weight is held in bf16 until backward."""
    preset, setting = get_preset("1b"), dataclasses.replace(TENSORWISE, compiled=compiled)
    off = memory.estimate(preset, _zero(stage), _work(Float8Setting(), n_gpus))
    on = memory.estimate(preset, _zero(stage), _work(setting, n_gpus))
    casts = 2 * TOKENS * INTER + INTER * H + TOKENS * H if compiled else 10 * TOKENS * INTER
    casts += 0 if compiled else INTER * H
    held = 2 * (LAYERS * (4 * H * H + 3 * H * INTER) - H * H) if stage == 3 and n_gpus > 1 else 0
    assert on.forward_backward - off.forward_backward == casts + held
    assert (on.model_state, on.activations, on.logits) == (
        off.model_state,
        off.activations,
        off.logits,
    )


def test_forecast_counts_float8_matmuls_at_the_float8_peak():
    """An H100's float8 peak is twice its bf16 one: the step is ``1 - s + s / 2`` of the bf16
    step with s the converted layers' share of the FLOPs; without a float8 peak, unchanged."""
    preset = get_preset("1b")
    common = dict(
        preset=preset,
        ds_config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}},
        tokens_per_step=524_288,
        world_size=8,
        max_steps=100,
        start_step=0,
        mfu=0.4,
        peak_flops=989e12,
    )
    base = forecast.make(**common)
    on = forecast.make(float8=TENSORWISE, fp8_peak_flops=1979e12, **common)
    share = 6 * (LAYERS * (4 * H * H + 3 * H * INTER) - H * H) / flops_per_token(preset)
    assert on.step_s / base.step_s == pytest.approx(1 - share + share * 989 / 1979)
    assert forecast.make(float8=TENSORWISE, **common).step_s == base.step_s
    assert f"MFU {0.4 / on.float8_step_factor:.0%} against the bf16 peak" in forecast.describe(on)


def test_estimate_prints_float8_and_its_levers(capsys):
    """The chosen setting's line, float8 switched off as a lever with its memory, and compile
    switched on (float8's casts fused); the verdict line for the chosen settings."""
    assert cli.main(["estimate", "--model", "1b", "--float8", "tensorwise"]) == 0
    out = capsys.readouterr().out
    assert "train.float8=tensorwise (eager: casts unfused): 125 of 127 Linear layers" in out
    assert "0.60x the step time" in out and "lever train.float8=off: peak 16.10 GiB" in out
    assert "lever train.compile=torch: float8's casts fused" in out
    assert "fits in H100 SXM 80GB" in out
    assert cli.main(["estimate", "--model", "1b"]) == 0
    assert "lever train.float8=tensorwise: peak 18.21 GiB (+2.12 GiB)" in capsys.readouterr().out


def test_estimate_refuses_float8_on_a_sparse_model_as_the_launch_does(capsys):
    """`anneal estimate --float8` on a sparse preset: exit 2 and one paragraph that names the
    flag and the fix, with the launch's own reason (``float8_rule.sparse_refusal``)."""
    from anneal.model.float8_rule import sparse_refusal

    assert cli.main(["estimate", "--model", "tiny-moe", "--float8", "rowwise"]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith(
        "anneal estimate: error: --float8 rowwise with the sparse model tiny-moe: "
    )
    assert sparse_refusal(get_preset("tiny-moe")) in said and "--float8 off" in said
    assert "\n" not in said
    assert sparse_refusal(get_preset("1b")) is None
    assert cli.main(["estimate", "--model", "tiny-moe"]) == 0


@pytest.mark.slow
def test_float8_linear_saves_its_high_precision_input_and_the_weights_storage():
    """What the estimate's memory terms rest on: torchao 0.18's Float8Linear saves for
    backward the input as it came (no float8 copy) and a view of the weight, whose storage
    outlives the parameter's release (ZeRO-3's ``param.data = torch.empty(0)``) and serves
    backward after the parameter is gathered again into a new buffer (zeros here: the input's
    gradient would be zero if backward read it). Slow only for torchao's import: about 2 s of
    CPU, which the fast suite, over its budget, cannot take."""
    from anneal.train.float8 import import_torchao

    import_torchao()
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    plain = torch.nn.Linear(64, 32, bias=False)
    layer = Float8Linear.from_float(plain, Float8LinearConfig.from_recipe_name("tensorwise"))
    x = torch.randn(16, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    storage = layer.weight.untyped_storage().data_ptr()
    layer.weight.data = torch.empty(0)  # as ZeRO-3 releases a gathered weight
    assert [t.dtype for t in saved] == [torch.float32, torch.float32]
    assert saved[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert saved[1].untyped_storage().data_ptr() == storage and saved[1].numel() == 64 * 32
    layer.weight.data = torch.zeros(32, 64)  # gathered again, into another buffer
    y.sum().backward()
    assert x.grad.abs().sum() > 0 and layer.weight.grad.shape == (32, 64)


def test_estimate_takes_a_runs_float8_and_compile_unless_a_flag_says(tmp_path, capsys):
    """``--model RUN/config.json``: the run's ``train.float8`` and ``train.compile``; a flag
    wins over them."""
    import json

    from anneal.resolution.ds import find_ds_config, load_ds_config

    run = tmp_path / "config.json"
    doc = {
        "run": {"train": {"float8": "rowwise", "compile": "torch"}},
        "ds_config": load_ds_config(find_ds_config("zero3_bf16.json")),
        "model": dataclasses.asdict(get_preset("1b")),
    }
    run.write_text(json.dumps(doc))
    assert cli.main(["estimate", "--model", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["float8"]["recipe"], out["float8"]["compiled"]) == ("rowwise", True)
    assert out["float8"]["converted_layers"] == 2 * LAYERS and "float8 casts" in out["buffers"]
    assert cli.main(["estimate", "--model", str(run), "--json", "--float8", "off"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["float8"]["recipe"] == "off" and "float8 casts" not in out["buffers"]
