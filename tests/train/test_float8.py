"""Float8 training (``train.float8``; docs/throughput.md).

Fast: the layer rule (``anneal.model.float8_rule``) reads a preset's Linear layers exactly as
transformers builds them, and at the 1b shape picks what torchao's thresholds and the kept
first layer and head say; the launch names the choice; the refusals (AutoTP, a sparse model,
torchao missing or too old) are one paragraph before any model is built.

Slow: float8 learns like the run's own precision (fp32 on this CPU) on the real engine, in this
process, at ZeRO-2 and ZeRO-3 (20 steps each way at SMALL's shape, every Linear but the head in
float8 through ``train.float8_layers=all``); and one 2-rank launch with float8 on resumes
exactly and exports a plain Hugging Face model whose validation loss matches the live engine's.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import SMALL, SMALL_OWN_BATCH, refused_tiny, resolve_tiny, sets


def _meta_model(preset):
    from anneal.model import build_model

    with torch.device("meta"):
        return build_model(preset)


@pytest.mark.parametrize("name", ["tiny", "1b"])
def test_the_rule_reads_a_presets_linear_layers_as_transformers_builds_them(name):
    from anneal.model import get_preset
    from anneal.model.float8_rule import dense_linear_shapes
    from anneal.train.float8 import linear_shapes

    preset = get_preset(name)
    assert dense_linear_shapes(preset) == linear_shapes(_meta_model(preset))


def test_at_the_1b_shape_auto_keeps_the_first_layer_the_head_and_what_is_too_small():
    """tensorwise gains from a 2048 x 2048 matrix on (K <= 4096 and N <= 1024 lose); rowwise
    only from the feed-forward's 5504-wide gate and up (N <= 2048 loses): torchao 0.18's
    thresholds. ``all`` takes every layer but the head."""
    from anneal.model import get_preset
    from anneal.model.float8_rule import choose_float8, dense_linear_shapes

    shapes = dense_linear_shapes(get_preset("1b"))  # 18 layers x 7 Linear + the head
    tensorwise = choose_float8(shapes, recipe="tensorwise", layers="auto")
    assert tensorwise.kept == {
        "model.layers.0.self_attn.q_proj": "the first Linear",
        "lm_head": "the output head",
    }
    assert len(tensorwise.converted) == 125
    rowwise = choose_float8(shapes, recipe="rowwise", layers="auto")
    assert {n.split(".", 3)[-1] for n in rowwise.converted} == {"mlp.gate_proj", "mlp.up_proj"}
    assert len(rowwise.converted) == 36
    everything = choose_float8(shapes, recipe="rowwise", layers="all")
    assert everything.kept == {"lm_head": "the output head"}
    odd = [*shapes[:1], type(shapes[0])("model.layers.0.mlp.x", 5500, 2048)]
    assert choose_float8(odd, recipe="tensorwise", layers="all").kept == {
        "model.layers.0.mlp.x": "a dimension not divisible by 16"
    }


def test_the_launch_names_the_float8_layers_and_old_runs_compare_equal(tiny_data, tmp_path):
    from anneal.config.run_compare import config_differences

    args = ["--out", str(tmp_path / "run"), "--data", str(tiny_data), *SMALL]
    launch = resolve_tiny([*args, *sets("train.float8=rowwise")], world_size=1)
    assert (
        "train.float8=rowwise, train.float8_layers=auto; float8 (rowwise): 0 of 15 Linear "
        "layers in float8; kept in high precision, the first Linear: "
        "model.layers.0.self_attn.q_proj; too small to gain"
    ) in launch.describe()
    off = resolve_tiny(args, world_size=1).config_document()
    older = {**off, "run": {**off["run"], "train": dict(off["run"]["train"])}}
    for key in ("float8", "float8_layers", "compile"):
        del older["run"]["train"][key]  # a run an Anneal before issue 45 wrote
    assert config_differences(older, off) == []
    assert config_differences(older, launch.config_document()) == [
        "run.train.float8: 'off' -> 'rowwise'"
    ]


def test_refusals_before_launch(tiny_data, tmp_path, monkeypatch):
    """AutoTP, a sparse model, torchao missing and torchao too old: each one paragraph that
    names the key and the fix, raised while the launch resolves (before any model)."""
    from anneal.errors import UserError
    from anneal.resolution import throughput
    from tests.train.test_moe import _resolve

    args = ["--out", str(tmp_path / "run"), "--data", str(tiny_data), *SMALL]
    tp = refused_tiny(
        [*args, *sets("train.float8=tensorwise", "ds.tensor_parallel.autotp_size=2")],
        world_size=2,
    )
    assert "tensor_parallel.autotp_size=2" in tp and "untested" in tp
    assert "--set train.float8=off" in tp and "\n" not in tp
    with pytest.raises(UserError) as sparse:
        _resolve(tiny_data, tmp_path / "moe", *sets("train.float8=rowwise"))
    assert "sparse model" in str(sparse.value) and "--set train.float8=off" in str(sparse.value)
    for version, words in [(None, "torchao is not installed"), ("0.12.0", "torchao 0.12.0")]:
        monkeypatch.setattr(throughput, "installed_torchao", lambda v=version: v)
        refusal = refused_tiny([*args, *sets("train.float8=tensorwise")], world_size=1)
        assert words in refusal and "pip install 'torchao==0.18.0'" in refusal, refusal
    monkeypatch.setattr(throughput, "installed_torchao", lambda: "0.18.0")
    resolve_tiny([*args, *sets("train.float8=tensorwise")], world_size=1)


STEPS = 20
ONE_WINDOW = ("ds.train_micro_batch_size_per_gpu=1", "ds.gradient_accumulation_steps=1")
"""One window of 64 tokens a step and rank: float8's ``torch._scaled_mm`` on this CPU is a
slow reference kernel (0.55 s for the forward of SMALL's 14 float8 layers on 64 tokens, against
4.1 s on SMALL's 512; measured here, 2026-12-07), and the number of tokens is not what these
tests are about."""


def _losses(launch, data_dir, steps: int) -> tuple[list[float], object]:
    """``steps`` optimizer steps of ``launch``'s engine on the first windows of the train
    split, in order: each step's mean micro-batch loss, and the engine."""
    from anneal.data.stream import PackedSplit
    from anneal.train.engine import build_engine
    from anneal.train.loss import next_token_loss, targets

    torch.manual_seed(launch.cfg.train.seed)
    engine = build_engine(launch)
    split = PackedSplit(data_dir, "train", seq_len=launch.seq_len)
    micro, losses, window = launch.micro_batch, [], 0
    for _ in range(steps):
        total = 0.0
        for _ in range(launch.grad_accum):
            x, y = split.batch(list(range(window, window + micro)))
            window += micro
            with targets(engine.module, y):
                loss = next_token_loss(engine(input_ids=x).logits, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / launch.grad_accum)
    return losses, engine


@pytest.mark.slow
@pytest.mark.parametrize("stage,recipe", [(2, "tensorwise"), (3, "rowwise")])
def test_float8_learns_like_the_runs_own_precision(
    stage, recipe, tiny_data, tmp_path, world_of_one
):
    """The loss after 20 steps with every Linear but the head in float8 is within 3% of the
    same run without float8 (fp32 here), at ZeRO-2 (tensorwise) and ZeRO-3 (rowwise); the
    float8 engine's modules are torchao's ``Float8Linear`` under DeepSpeed (ZeRO-3's
    partitioned weights included). Two in-process engines per stage: 15.5 s (ZeRO-2) and
    11.3 s (ZeRO-3) here, one window a step (``ONE_WINDOW``)."""
    from anneal.train.float8 import float8_layer_names

    args = ["--out", str(tmp_path / "run"), "--data", str(tiny_data), *SMALL_OWN_BATCH]
    args += ["--max-steps", str(STEPS), *sets(f"ds.zero_optimization.stage={stage}", *ONE_WINDOW)]
    plain = resolve_tiny(args, world_size=1)
    f8 = resolve_tiny(
        [*args, *sets(f"train.float8={recipe}", "train.float8_layers=all")], world_size=1
    )
    base, _ = _losses(plain, tiny_data, STEPS)
    ours, engine = _losses(f8, tiny_data, STEPS)
    assert len(float8_layer_names(engine.module)) == 14  # 2 layers x 7; the head kept
    assert base[-1] < 0.5 * base[0]  # it learned
    assert ours[-1] == pytest.approx(base[-1], rel=0.03), (ours, base)
    assert ours != base  # float8 ran: its rounding shows


LAUNCH_STEPS, LAUNCH_STOP = 6, 3
EXPORT_REL = 1e-3
"""The export's validation loss against the live float8 engine's. The export holds the same
weights and computes in fp32, where the engine cast each float8 layer's input and weight to
float8 (e4m3: 3 mantissa bits, each value within 6.25% of its own; the errors average out over
a matrix product's sums and the loss's mean), so the two differ by that rounding alone:
7.3e-5 relative here (4.392885 against 4.392563 at step 6, 2026-12-07); 1e-3 leaves room for
another machine's kernels and still fails any export whose weights are not the run's."""


def _launch_args(data, out, *extra: str) -> list[str]:
    return [
        *("--out", str(out), "--data", str(data), "--max-steps", str(LAUNCH_STEPS)),
        *("--val-every", str(LAUNCH_STEPS), "--save-every", str(LAUNCH_STOP)),
        *SMALL_OWN_BATCH,
        *sets("train.float8=tensorwise", "train.float8_layers=all", *ONE_WINDOW),
        *sets("ds.zero_optimization.stage=3"),
        *extra,
    ]


@pytest.mark.slow
def test_two_ranks_float8_resumes_exactly_and_exports_plain_linear_weights(tiny_data, tmp_path):
    """Two ranks (gloo, ZeRO-3, tensorwise, every Linear but the head in float8): a run stopped
    after step 3 and resumed logs the losses, grad norms and LRs of the run that never stopped
    (``assert_resumed_steps_match``); ``anneal export`` of the full run writes plain Linear
    weights under the usual names, which plain transformers loads as LlamaForCausalLM, and
    its loss on the validation windows is the live engine's last validation loss within
    EXPORT_REL. Three 2-rank launches, two at a time, and one export: 39 s here."""
    from anneal import rundir
    from anneal.cli import main as cli_main
    from anneal.data.stream import PackedSplit, heldout_windows
    from tests.conftest import assert_resumed_steps_match, run_recipe, run_recipes

    full, split = tmp_path / "full", tmp_path / "split"
    stop = sets(f"train.stop_at_step={LAUNCH_STOP}")
    run_recipes(
        [
            dict(args=_launch_args(tiny_data, full), ranks=2),
            dict(args=_launch_args(tiny_data, split, *stop), ranks=2),
        ]
    )
    run_recipe(_launch_args(tiny_data, split), ranks=2, extra_env={"OMP_NUM_THREADS": "1"})
    rows = {
        name: {r["step"]: r for r in rundir.read_metrics(d, "train")}
        for name, d in (("full", full), ("split", split))
    }
    assert_resumed_steps_match(
        {s: r for s, r in rows["split"].items() if s > LAUNCH_STOP},
        rows["full"],
        range(LAUNCH_STOP + 1, LAUNCH_STEPS + 1),
    )
    assert cli_main(["export", str(full), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert {type(m) for m in model.modules() if "Linear" in type(m).__name__} == {torch.nn.Linear}
    val = PackedSplit(tiny_data, "val", seq_len=64)
    windows = heldout_windows([(0, val.n_windows)], 16)  # SMALL: train.val_samples=16
    ids = torch.stack([torch.as_tensor(val.window(j).astype("int64")) for j in windows])
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits
    ours = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:]).item()
    live = rundir.read_metrics(full, "val")[-1]
    assert live["step"] == LAUNCH_STEPS
    assert ours == pytest.approx(live["val_loss"], rel=EXPORT_REL), (ours, live["val_loss"])
