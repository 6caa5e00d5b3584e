"""Sparse models and Hugging Face, both ways (issue 30, item 4).

Out: the checkpoint of a bare DeepSpeed AutoEP engine (``tests/moe_engine.py``: a plain
transformers Qwen3-MoE given to ``deepspeed.initialize`` with an ``"expert_parallel"`` section,
one rank, EP=1) exported by ``anneal export`` (its own verification on) and read back with
plain ``from_pretrained``:

- an engine saved before any step (ZeRO-1, and without ZeRO, whose expert-parallel optimizer
  file the check of every load accepts) gives back the very weights it was built from, every tensor
  equal (the router renamed from AutoEP's ``router.gate``, each expert's gate and up rows fused
  back in transformers' order: a swap of the two would change the logits, checked too);
- an engine trained two steps at ZeRO-2, or at ZeRO-3 (AutoEP's experts in the rank's
  partitions, no expert file), gives the logits the engine computes, within float noise of two
  implementations of the same experts; the map of where ZeRO-3 keeps each expert, on the
  layout of 4 ranks at EP=2 (experts partitioned over 2 ranks each), reads each expert from
  its ranks in partition order and refuses a partition or an expert that no rank holds;
- a pickle planted in an expert file (the manifest rehashed to match) is refused by the export
  and by the check every resume makes, and never runs; an expert file that holds no expert is
  refused.

In: ``--init-from`` a Qwen3-MoE directory that ``save_pretrained`` wrote: the run's model is
sparse (its ``moe`` shape read from config.json, active parameters below the total), and its
validation loss before any update (at ZeRO-1 and at ZeRO-3) equals plain transformers' on the
same windows within 1e-5;
other Mixture-of-Experts architectures (Mixtral, OLMoE, Qwen2-MoE) and a Qwen3-MoE with dense
layers are refused with one paragraph naming what works.

About 10 s on 2 cores: two in-process engines, five exports with their verification. The
recipe's expert-parallel runs (EP=2 at ZeRO-1 and 2, EP=1 and 2 at ZeRO-3) are exported and
checked against the live engine's validation loss in tests/train/test_moe_parallel.py, beside the
launches that compare them.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from anneal.errors import UserError
from anneal.hf.export import export
from anneal.resilience import safeload
from tests import moe_engine, planted
from tests.moe_engine import SEQ, VOCAB

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
STAGE1 = ("--set", "ds.zero_optimization.stage=1")
"""ZeRO-1 instead of recipes/continue_pretraining.py's CPU default, ZeRO-3, which only the
step-0 test runs as well (the expert files of ZeRO-1 are the exporter's other reader)."""


@pytest.fixture(scope="module")
def preset():
    return moe_engine.tiny_preset()


@pytest.fixture(scope="module")
def runs(world_of_one, tiny_data, preset, tmp_path_factory) -> dict:
    """Three runs saved by bare AutoEP engines: ``fresh`` at ZeRO-1 and ``fresh0`` without
    ZeRO, before any step (with the state dict of the model they were built from), and
    ``trained`` at ZeRO-2 after two steps (with the engine's logits on a fixed batch)."""
    root = tmp_path_factory.mktemp("moe_runs")
    weights = {k: v.clone() for k, v in moe_engine.hf_model(preset).state_dict().items()}
    for name, stage in (("fresh", 1), ("fresh0", 0)):
        fresh = moe_engine.bare_engine(moe_engine.hf_model(preset), stage=stage)
        moe_engine.save_as_run(fresh, preset, root / name, tiny_data, "step00000000")
    batch = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    found = {"fresh": root / "fresh", "fresh0": root / "fresh0", "weights": weights}
    for name, stage in (("trained", 2), ("trained3", 3)):
        trained = moe_engine.bare_engine(moe_engine.hf_model(preset, seed=1), stage=stage)
        assert type(trained.module.model.layers[1].mlp).__name__ == "AutoEPMoELayer"
        moe_engine.train_steps(trained, 2)
        with torch.no_grad():
            found[f"{name}_logits"] = trained.module(input_ids=batch).logits.float()
        moe_engine.save_as_run(trained, preset, root / name, tiny_data, "step00000002")
        found[name] = root / name
        trained.destroy()
    return {**found, "batch": batch, "logits": found["trained_logits"]}


def from_pretrained(out: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


@pytest.mark.parametrize("run", ["fresh", "fresh0"])
def test_a_fresh_engine_exports_the_weights_it_was_built_from(runs, tmp_path, run):
    """HF model -> AutoEP engine (ZeRO-1; no ZeRO) -> checkpoint -> export -> HF model: every
    tensor equal, the config a Qwen3-MoE whose loss is the language model's; gate and up
    swapped would not give the same logits (so the equality proves their order)."""
    report = export(runs[run], out=tmp_path / "hf", dtype="fp32")
    assert report["zero_stage"] == {"fresh": 1, "fresh0": 0}[run]
    model = from_pretrained(tmp_path / "hf")
    got = model.state_dict()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert set(got) == set(runs["weights"])
    assert all(torch.equal(got[k], v) for k, v in runs["weights"].items())
    config = model.config
    assert (config.num_experts, config.num_experts_per_tok, config.head_dim) == (4, 2, 32)
    assert (
        json.loads((tmp_path / "hf" / "config.json").read_text())["output_router_logits"] is False
    )
    assert report["verify"]["max_abs_logit_diff"] <= report["verify"]["tolerance"]

    batch = runs["batch"]
    with torch.no_grad():
        before = model(input_ids=batch).logits
        up_gate = got["model.layers.0.mlp.experts.gate_up_proj"].roll(32, dims=1)
        model.model.layers[0].mlp.experts.gate_up_proj.copy_(up_gate)
        assert (model(input_ids=batch).logits - before).abs().max() > 1e-3


@pytest.mark.parametrize("stage", [2, 3])
def test_a_trained_engine_exports_its_logits(runs, tmp_path, stage):
    """Two ZeRO-2 steps, or ZeRO-3 ones (AutoEP's experts then in the rank's partitions, no
    expert file), then export (verified) and from_pretrained: the engine's logits, up to float
    noise (measured: equal); the bf16 export verifies too."""
    name = "trained" if stage == 2 else "trained3"
    report = export(runs[name], out=tmp_path / "hf", dtype="fp32")
    logits = from_pretrained(tmp_path / "hf")(input_ids=runs["batch"]).logits
    want = runs[f"{name}_logits"]
    assert (logits - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
    assert report["step"] == 2 and report["zero_stage"] == stage
    assert any("_expert_" in p.name for p in runs[name].rglob("*.pt")) == (stage == 2)
    bf16 = export(runs[name], out=tmp_path / "bf16", dtype="bf16")["verify"]
    assert bf16["max_abs_logit_diff"] <= bf16["tolerance"] < bf16["dtype_rounding_diff"]


def _zero3_metadata(ranks: int, ep: int, shapes: dict) -> tuple:
    """(param_shapes, each rank's ds_autoep_layers, each rank's ds_zero_partition_groups) of
    one sparse layer of 4 experts at ZeRO-3, as DeepSpeed 0.19.8's AutoEP wrote them on 4 ranks
    at EP=2 (measured: expert-parallel groups [0, 1] and [2, 3], experts partitioned over [0, 2]
    and [1, 3]); a dense group first, partitioned over all ranks."""
    prefix = "model.layers.0.mlp.experts"
    groups, layers = [], []
    for r in range(ranks):
        edp = ranks // ep
        ep_rank, edp_rank = r % ep, r // ep
        layer = {
            "moe_layer_id": 0,
            "module_path": "model.layers.0.mlp",
            "num_experts": 4,
            "expert_key_prefix": prefix,
            "global_expert_start": ep_rank * (4 // ep),
            "expert_data_parallel_rank": edp_rank,
            "expert_data_parallel_world_size": edp,
        }
        layers.append([layer])
        groups.append(
            [
                {"partition_count": ranks, "partition_rank": r},
                {"partition_count": edp, "partition_rank": edp_rank},
            ]
        )
    param_shapes = [{"model.norm.weight": (8,)}, {f"{prefix}.{w}": s for w, s in shapes.items()}]
    return param_shapes, layers, groups


def test_the_zero3_expert_map_of_four_ranks_at_ep2():
    """``autoep_zero3.expert_slices`` on the layout of 4 ranks at EP=2: experts 0-1 of each
    weight are ranks 0 and 2's slices of ``ceil(n / 2)`` elements (in partition order), experts
    2-3 ranks 1 and 3's, each weight's slices following the one before in the rank's flat
    group; a rank whose partition is missing, or an expert no rank holds, is refused."""
    from anneal.hf.autoep_zero3 import Slice, expert_slices
    from anneal.resilience.ds_files import LayoutError

    shapes = {"w1": (2, 3, 5), "w2": (2, 5, 3), "w3": (2, 3, 5)}  # 30 elements: 15 a rank
    weights = expert_slices(*_zero3_metadata(4, 2, shapes))
    got = {(w.weight, w.first): w.slices for w in weights}
    assert got[("w1", 0)] == (Slice(0, 1, 0, 15), Slice(2, 1, 0, 15))
    assert got[("w2", 2)] == (Slice(1, 1, 15, 15), Slice(3, 1, 15, 15))
    assert got[("w3", 0)] == (Slice(0, 1, 30, 15), Slice(2, 1, 30, 15))
    assert len(weights) == 3 * 2 and all(w.shape == shapes[w.weight] for w in weights)
    shapes_, layers, groups = _zero3_metadata(4, 2, shapes)
    layers[2][0]["expert_data_parallel_rank"] = 0  # two ranks claim the same partition
    groups[2][1]["partition_rank"] = 0
    with pytest.raises(LayoutError, match="lacks a partition"):
        expert_slices(shapes_, layers, groups)
    shapes_, layers, groups = _zero3_metadata(2, 1, shapes)
    for layer in layers:
        layer[0]["num_experts"] = 6  # two experts held by no rank
    with pytest.raises(LayoutError, match="holds experts"):
        expert_slices(shapes_, layers, groups)


def test_the_two_sets_of_expert_names_are_inverse(runs, tmp_path):
    """The per-expert tensors of an export (as save_pretrained names them) fused back by
    ``fused_loaders`` (what ``anneal eval`` loads a sparse checkpoint through) and their shapes
    by ``fused_shapes`` (``--init-from``) are the model's own; ``saved_shapes`` is the inverse."""
    from safetensors.torch import load_file

    from anneal.hf.expert_names import fused_loaders, fused_shapes, saved_shapes

    export(runs["fresh"], out=tmp_path / "hf", dtype="fp32", verify=False)
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in saved
    fused = fused_loaders({k: (lambda t=t: t) for k, t in saved.items()})
    want = runs["weights"]
    assert set(fused) == set(want) and all(torch.equal(fused[k](), want[k]) for k in want)
    shapes = {k: tuple(v.shape) for k, v in want.items()}
    assert fused_shapes({k: tuple(t.shape) for k, t in saved.items()}) == shapes
    assert saved_shapes(shapes) == {k: tuple(t.shape) for k, t in saved.items()}


def _copy(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    copy = Path(shutil.copytree(run, tmp_path / "run", symlinks=True))
    return copy, copy / "checkpoints" / "step00000002"


@pytest.mark.parametrize("kind", planted.KINDS)
def test_a_pickle_planted_in_an_expert_file_never_runs(runs, tmp_path, kind):
    """An expert file with a payload (the manifest rehashed): the export and the check of
    every resume refuse it, naming the file; the payload never runs."""
    run, tag_dir = _copy(runs["trained"], tmp_path)
    target = tag_dir / "layer_1_expert_3_mp_rank_00_model_states.pt"
    marker = tmp_path / "ran"
    planted.plant(target, kind, marker)
    with pytest.raises(UserError, match=target.name) as e:
        export(run, out=tmp_path / "hf", dtype="fp32")
    assert "Nothing was exported" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match=target.name):
        safeload.check_checkpoint(tag_dir)
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_an_expert_file_without_an_expert_is_refused(runs, tmp_path):
    """An expert file rewritten as a dict of no expert weights: not what DeepSpeed saves
    there, refused on resume and export; the other files as saved pass the same check."""
    run, tag_dir = _copy(runs["trained"], tmp_path)
    safeload.check_checkpoint(tag_dir)  # as saved: every file, the expert files included
    target = tag_dir / "layer_0_expert_1_mp_rank_00_model_states.pt"
    torch.save({"module": {}}, target)
    planted.rehash(tag_dir)
    with pytest.raises(UserError, match="not a dict of tensors"):
        safeload.check_checkpoint(tag_dir)
    with pytest.raises(UserError, match=target.name):
        export(run, out=tmp_path / "hf", dtype="fp32")


# --- --init-from a Qwen3-MoE directory --------------------------------------------------------


@pytest.fixture(scope="module")
def moe_dir(tiny_data, preset, tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE after two plain-torch AdamW steps, saved with ``save_pretrained``
    beside tiny_data's tokenizer."""
    out = tmp_path_factory.mktemp("hf_moe") / "qwen3_moe"
    model = moe_engine.hf_model(preset, seed=2).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randint(0, VOCAB, (4, 33))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.config.output_router_logits = False  # as the Hub's releases ship it
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        shutil.copyfile(tiny_data / name, out / name)
    return out


@pytest.fixture(scope="module")
def moe_data(moe_dir, tmp_path_factory) -> Path:
    """A corpus prepared with the directory's tokenizer (``--tokenizer DIR``), in this process
    as tests/hf/test_init_from.py prepares its own."""
    from anneal.data import make_tokenizer
    from anneal.data.prepare import prepare

    src = tmp_path_factory.mktemp("moe_src") / "text.txt"
    src.write_text("\n\n".join(f"doc {i}: " + f"the {i % 7} fox jumps " * 30 for i in range(120)))
    out = tmp_path_factory.mktemp("moe_data") / "data"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(make_tokenizer, "_in_child", lambda fn, *args: fn(*args))
        prepare(
            inputs=[str(src)],
            out=out,
            tokenizer=moe_dir,
            val_fraction=0.2,
            workers=1,
            progress=False,
        )
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_init_from_a_qwen3_moe_is_sparse_and_its_step0_loss_is_transformers(
    world_of_one, moe_dir, moe_data, tmp_path, stage
):
    """The run's model is the directory's sparse one, and Anneal's validation loss before any
    update (the engine as training builds it, at ZeRO-1 and at ZeRO-3, where the weights are
    copied in under zero.Init before AutoEP takes the experts) equals plain transformers'
    within 1e-5."""
    from anneal.model import active_params, count_params
    from anneal.train import build_engine, resolve_run, validate
    from anneal.train.trainer import Data
    from tests.hf.test_init_from import config, transformers_loss

    zero = ("--set", f"ds.zero_optimization.stage={stage}")
    cfg, overrides = config(moe_dir, moe_data, tmp_path / "run", *zero)
    launch = resolve_run(cfg, overrides)
    assert launch.preset.moe.num_experts == 4 and launch.preset.moe.top_k == 2
    assert launch.preset.head_dim == 32
    assert active_params(launch.preset) < count_params(launch.preset)
    assert launch.ds_config["expert_parallel"]["enabled"]
    assert launch.preset.hf_config["output_router_logits"] is True  # the objective needs them
    assert launch.preset.moe.aux_loss_coef == 0.01  # config.json's router_aux_loss_coef
    engine = build_engine(launch)
    assert type(engine.module.model.layers[0].mlp).__name__ == "AutoEPMoELayer"
    d = Data.open(launch)
    n, micro = launch.cfg.train.val_samples, launch.micro_batch
    ours = validate(engine, d.val, d.token_bytes, n_samples=n, micro_batch=micro)["val_loss"]
    theirs = transformers_loss(moe_dir, moe_data)
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert abs(ours - math.log(VOCAB)) > 0.01
    assert not (tmp_path / "run").exists()  # nothing written before the loop


def test_init_from_takes_router_weights_and_refuses_expert_shapes(moe_dir, moe_data, tmp_path):
    """``model.moe_aux_loss_coef`` and ``moe_z_loss_coef`` weigh the router of a continued
    sparse model; an expert count, top-k or width is config.json's, so setting one is refused
    (as a hidden size is)."""
    from tests.hf.test_init_from import resolve

    sets = ("--set", "model.moe_aux_loss_coef=0.02", "--set", "model.moe_z_loss_coef=0.001")
    moe = resolve(moe_dir, moe_data, tmp_path / "r", *STAGE1, *sets).preset.moe
    assert (moe.aux_loss_coef, moe.z_loss_coef, moe.num_experts) == (0.02, 0.001, 4)
    with pytest.raises(UserError, match="model.num_experts is set, but the shape"):
        resolve(moe_dir, moe_data, tmp_path / "r", *STAGE1, "--set", "model.num_experts=8")


@pytest.mark.parametrize("top_k", [0, 5])
def test_init_from_a_top_k_outside_its_experts_is_refused_before_launch(
    moe_dir, moe_data, tmp_path, top_k
):
    """config.json's ``num_experts_per_tok`` 0 (on 7ec025f: trained without its experts) or
    above its 4 experts (there: DeepSpeed's ValueError traceback when the engine starts): one
    paragraph naming the file and the key, before anything is written."""
    from tests.hf.test_init_from import resolve

    model = tmp_path / "m"
    shutil.copytree(moe_dir, model)
    doc = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**doc, "num_experts_per_tok": top_k}))
    with pytest.raises(UserError) as caught:
        resolve(model, moe_data, tmp_path / "run", *STAGE1)
    message = str(caught.value)
    assert message.startswith(f"--init-from {model}/config.json: num_experts_per_tok is {top_k}")
    assert "one of 1..4" in message and "\n" not in message
    assert not (tmp_path / "run").exists()


def _config_only(tmp_path: Path, config) -> Path:
    config.save_pretrained(str(tmp_path / "m"))
    return tmp_path / "m"


SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=VOCAB)


@pytest.mark.parametrize(
    "config",
    [
        transformers.MixtralConfig(num_local_experts=4, intermediate_size=32, **SMALL),
        transformers.OlmoeConfig(num_experts=4, intermediate_size=32, **SMALL),
        transformers.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=32, **SMALL),
    ],
    ids=lambda c: c.model_type,
)
def test_other_sparse_architectures_are_refused_naming_qwen3_moe(config, tmp_path):
    """Mixtral, OLMoE and Qwen2-MoE: one paragraph naming the architecture that works, before
    any weight is read (the directory holds none)."""
    from anneal.hf.load import read_hf_config

    with pytest.raises(UserError, match="Mixture-of-Experts architecture") as e:
        read_hf_config(_config_only(tmp_path, config))
    assert config.model_type in str(e.value) and "\n" not in str(e.value)
    assert "with the qwen3_moe preset" in str(e.value)


def test_a_qwen3_moe_with_dense_layers_is_refused(tmp_path):
    """mlp_only_layers: Anneal's sparse counts take every layer as sparse."""
    from anneal.hf.load import read_hf_config

    config = transformers.Qwen3MoeConfig(num_experts=4, mlp_only_layers=[0], **SMALL)
    with pytest.raises(UserError, match="mlp_only_layers"):
        read_hf_config(_config_only(tmp_path, config))


# --- a real run: 2 ranks, EP=2, through Anneal's loop and manifest -----------------------------


@pytest.mark.slow
def test_init_from_trains_with_its_router_losses_and_exports_back(moe_dir, moe_data, tmp_path):
    """Slow (one 1-rank launch of recipes/continue_pretraining.py, about 8 s): two steps from
    the Qwen3-MoE directory at ZeRO-1, each train row with the router's losses; ``anneal
    export --dtype fp32`` (verified) loads back as Qwen3MoeForCausalLM whose loss on the
    validation windows is the live engine's last validation loss within 1e-5, and whose
    weights moved from the directory's."""
    from anneal import rundir
    from anneal.cli import main as cli_main
    from anneal.data.stream import PackedSplit
    from tests.conftest import run_recipe
    from tests.hf.test_init_from import recipe_args

    run = tmp_path / "run"
    steps = ("--max-steps", "2", "--val-every", "2", "--save-every", "2")
    args = recipe_args(moe_dir, moe_data, run, *STAGE1, *steps)
    run_recipe(args, recipe="recipes/continue_pretraining.py", extra_env={"OMP_NUM_THREADS": "1"})
    rows = rundir.read_metrics(run, "train")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["aux_loss"] > 0 and r["z_loss"] > 0 for r in rows)
    assert cli_main(["export", str(run), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    model, start = from_pretrained(tmp_path / "hf"), from_pretrained(moe_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    val = PackedSplit(moe_data, "val", seq_len=SEQ)
    windows = [val.window(t * val.n_windows // 8) for t in range(8)]
    ids = torch.stack([torch.as_tensor(w.astype("int64")) for w in windows])
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits
        assert not torch.equal(logits, start(input_ids=ids[:, :-1]).logits)
    ours = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:]).item()
    assert ours == pytest.approx(rundir.read_metrics(run, "val")[-1]["val_loss"], rel=1e-5)
