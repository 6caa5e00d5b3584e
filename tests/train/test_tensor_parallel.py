"""Tensor parallelism through DeepSpeed 0.19.8's AutoTP training (``--set
ds.tensor_parallel.autotp_size=N``), checked against the same run without it.

Slow (real engine, real processes, gloo, fp32 on CPU, micro shapes at sequence 32): TP=2 on 2
ranks (ZeRO-2) and TP=2 x DP=2 on 4 ranks (ZeRO-1) log per-step losses over 10 steps equal to a
TP=1 run on 1 rank with the same global batch of 4 samples (within 1e-5 relative), and the same
validation loss; a TP=2 checkpoint resumed at the same topology continues bitwise; `anneal
export` of a TP=2 checkpoint (ZeRO-3, and ZeRO-2 over 2 replicas through
``train.export_every_save``) gives a Hugging Face model whose validation loss is the one the live
engine logged, and whose logits are those of the TP=1 run's weights. Equal losses
also show that every rank of a TP group read the same samples (DeepSpeed asserts it on the first
forward) and that the token stream shards over data-parallel replicas (world / TP).

Fast (in this process, through ``resolve_launch`` and the launcher's pre-flight, as every rank
and the launch host run them): the batch arithmetic counts data-parallel ranks; each bad layout
is one clear UserError before anything starts (a world that does not split into TP groups,
heads that do not divide, a resume at another TP degree or on another number of ranks, unknown
tensor_parallel keys)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from anneal.errors import UserError
from anneal.model import get_preset
from anneal.resilience.manifest import owner_of
from anneal.resolution import parallel
from launcher.__main__ import main as launcher_main
from tests.conftest import (
    PARALLEL_STEPS,
    ROOT,
    assert_resumed_steps_match,
    parallel_args,
    read_metrics,
    refused_tiny,
    resolve_tiny,
    run_recipe,
    sets,
)
from tests.zero_state import adam_state, assert_same_adam_state, assert_same_optimizer_state

TINY = ROOT / "recipes" / "pretrain_tiny.py"
STEPS = PARALLEL_STEPS
_sets = sets


def _args(data, out, *, tp: int, accum: int, stage: int, extra=(), save_every=5) -> list[str]:
    """conftest's parallel_args at tensor-parallel degree ``tp``."""
    layout = f"ds.tensor_parallel.autotp_size={tp}"
    return parallel_args(
        data, out, layout=layout, accum=accum, stage=stage, extra=extra, save_every=save_every
    )


# -- slow: the real engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """The TP=1 reference, TP=2 on 2 ranks, TP=2 x DP=2 on 4 ranks (each 4 samples per step;
    exported at each save, ``train.export_every_save``), the TP=2 run resumed from its step-5
    checkpoint in a new directory, and the TP=2 x DP=2 run's step 5 resumed at DP=4 on 4
    ranks; two launches at a time, each process on one thread (a resume starts as soon as the
    run it resumes has finished)."""
    from concurrent.futures import ThreadPoolExecutor

    tmp = tmp_path_factory.mktemp("tp")
    tag = tmp / "tp2" / "checkpoints" / "step00000005"
    launches = {
        "tp2": dict(args=_args(tiny_data, tmp / "tp2", tp=2, accum=2, stage=3), ranks=2),
        "ref": dict(args=_args(tiny_data, tmp / "ref", tp=1, accum=2, stage=2), ranks=1),
        "resumed": dict(
            args=_args(tiny_data, tmp / "resumed", tp=2, accum=2, stage=3) + ["--resume", str(tag)],
            ranks=2,
        ),
        "tp2dp2": dict(
            args=_args(
                tiny_data,
                tmp / "tp2dp2",
                tp=2,
                accum=1,
                stage=2,
                extra=_sets("train.export_every_save=true"),
            ),
            ranks=4,
        ),
        "dp4": dict(  # TP=2 x DP=2 -> DP=4 at step 5, through the universal checkpoint
            args=_args(tiny_data, tmp / "dp4", tp=1, accum=1, stage=2)
            + _sets("ds.train_micro_batch_size_per_gpu=1")  # 4 replicas x 1: 4 a step
            + ["--resume", str(tmp / "tp2dp2" / "checkpoints" / "step00000005")],
            ranks=4,
        ),
    }
    one_thread = {"OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(2) as pool:
        started = {}
        for name, launch in launches.items():
            if name in ("resumed", "dp4"):  # the checkpoint it resumes first
                started["tp2" if name == "resumed" else "tp2dp2"].result()
            started[name] = pool.submit(run_recipe, **launch, extra_env=one_thread)
        return tmp, {name: future.result() for name, future in started.items()}


def _train(out) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out, "train")}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "tp2dp2"])
def test_losses_equal_the_run_without_tensor_parallelism(runs, name):
    """Slow: 4 launches of up to 4 ranks. Within 1e-5 relative at each of the 10 steps (the
    reductions run in another order), and the final validation loss too."""
    tmp, done = runs
    ref, tp = _train(tmp / "ref"), _train(tmp / name)
    assert sorted(ref) == sorted(tp) == list(range(1, STEPS + 1))
    for step in ref:
        assert tp[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
        assert tp[step]["tokens"] == ref[step]["tokens"] == step * 4 * 32
    assert len({r["loss"] for r in ref.values()}) == STEPS  # the data moved on every step
    val_ref, val_tp = read_metrics(tmp / "ref", "val")[-1], read_metrics(tmp / name, "val")[-1]
    assert val_tp["val_loss"] == pytest.approx(val_ref["val_loss"], rel=1e-5)
    manifest = json.loads(
        (tmp / name / "checkpoints" / "step00000010" / "manifest.json").read_text()
    )
    ranks = 2 if name == "tp2" else 4
    owners = {owner_of(f, ranks, 2) for f in manifest["files"] if "zero_pp_rank" in f}
    assert owners == set(range(ranks))  # each rank hashes the files it wrote
    config = json.loads((tmp / name / "config.json").read_text())
    assert config["launch"]["tensor_parallel_size"] == 2
    assert config["launch"]["data_parallel_size"] == ranks // 2
    assert f"{ranks} ranks = tensor-parallel 2 x data-parallel {ranks // 2}" in done[name].stdout


@pytest.mark.slow
def test_resume_at_the_same_topology_is_exact(runs):
    """Slow (shares ``runs``): steps 6-10 after resuming the TP=2 run's step-5 checkpoint are
    bitwise those of the run that went on; its manifest records the tensor-parallel degree."""
    tmp, done = runs
    tag = tmp / "tp2" / "checkpoints" / "step00000005"
    assert json.loads((tag / "manifest.json").read_text())["tensor_parallel_size"] == 2
    assert f"resumed from {tag} at step 5" in done["resumed"].stdout
    full, resumed = _train(tmp / "tp2"), _train(tmp / "resumed")
    assert sorted(resumed) == list(range(6, STEPS + 1))
    for step in resumed:
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert resumed[step][key] == full[step][key], (step, key)


@pytest.mark.slow
def test_tp2_x_dp2_resumes_at_dp4(runs):
    """Slow (shares ``runs``: one 4-rank launch and its conversion). The TP=2 x DP=2 run's
    step-5 checkpoint, resumed on the same 4 ranks at TP=1 (4 data-parallel replicas,
    micro-batch 1: the same 4 samples a step) through DeepSpeed's universal checkpoint:
    steps 6-10 match the run that never changed (which matches the TP=1 reference within 1e-5,
    above), losses and grad norms within 1e-5 relative, LR and tokens exactly; the AdamW state at
    step 10 is the reference's."""
    tmp, done = runs
    full, resumed = _train(tmp / "tp2dp2"), _train(tmp / "dp4")
    assert_resumed_steps_match(resumed, full, range(6, STEPS + 1))
    assert (
        "saved on 4 ranks, ZeRO-2, tensor-parallel 2, data-parallel 2; this launch is 4 ranks, "
        "ZeRO-2, tensor-parallel 1, data-parallel 4: it is converted once"
    ) in done["dp4"].stderr
    assert "param groups after the universal load: weight_decay [0.1, 0.0]" in done["dp4"].stderr
    # The AdamW state at step 10, the 4 ranks' partitions joined, against the TP=1 reference's
    # on one rank (equal to the TP=2 x DP=2 run's within 1e-5, above): 10 steps apart in
    # reduction order, 4 of them on another layout.
    got, want = adam_state(tmp / "dp4", STEPS), adam_state(tmp / "ref", STEPS)
    assert_same_adam_state(got, want, step=float(STEPS), moved=STEPS)


@pytest.mark.slow
def test_resume_of_a_zero_3_checkpoint_at_another_layout_is_refused(runs, tiny_data, tmp_path):
    """Slow (shares ``runs``): the real TP=2 ZeRO-3 checkpoint, resumed at TP=1 on 2 ranks and
    at TP=2 on 4 ranks, is refused in resolution with the reason and what works."""
    tmp, _ = runs
    tag = tmp / "tp2" / "checkpoints" / "step00000005"
    for tp, world in [(1, 2), (2, 4)]:
        args = _args(tiny_data, tmp_path / f"r{tp}{world}", tp=tp, accum=2, stage=3)
        message = _refused([*args, "--resume", str(tag)], world_size=world)
        assert "at ZeRO-3" in message and "autotp_size=2 on 2 ranks" in message


@pytest.fixture(scope="module")
def round_trip(tiny_data, tmp_path_factory):
    """A TP=2 run at ZeRO-2 on 2 ranks (the reference, saved at steps 5 and 10); its step-5
    checkpoint resumed at TP=1 on the same 2 ranks (2 replicas, accumulation 1: the same 4
    samples a step) up to step 7, and that run's step-7 checkpoint resumed at TP=2 up to step
    10: three 2-rank launches, one after the other."""
    tmp = tmp_path_factory.mktemp("tp_round_trip")
    ref, out = tmp / "ref", tmp / "round_trip"
    tag = ref / "checkpoints" / "step00000005"
    there = _args(tiny_data, out, tp=1, accum=1, stage=2, extra=["--resume", str(tag)])
    there += _sets("train.stop_at_step=7")
    launches = [
        _args(tiny_data, ref, tp=2, accum=2, stage=2),
        there,
        _args(tiny_data, out, tp=2, accum=2, stage=2, extra=["--resume", "auto"]),
    ]
    one_thread = {"OMP_NUM_THREADS": "1"}
    return tmp, [run_recipe(a, ranks=2, extra_env=one_thread) for a in launches][1:]


@pytest.mark.slow
def test_resume_at_another_degree_through_the_universal_checkpoint(round_trip):
    """Slow (three 2-rank launches and two conversions, about 80 s here): TP=2 -> 1 at step
    5 and 1 -> 2 at step 7, at ZeRO-2, each through DeepSpeed's universal checkpoint (its
    converter merges AutoTP's slices by the map the engine saved; its loader cuts them for
    the new degree). Steps 6-10 match the TP=2 run that never changed (losses and grad norms
    within 1e-5 relative, the LR and the tokens exactly), the data position carries over, and
    the optimizer state at step 10 (each rank's AdamW moments, master weights, steps and
    hyperparameters) is that run's."""
    tmp, (there, back) = round_trip
    out = tmp / "round_trip"
    full, resumed = _train(tmp / "ref"), _train(out)
    assert_resumed_steps_match(resumed, full, range(6, STEPS + 1))
    events = [e for e in read_metrics(out, "event") if e["event"] == "resume"]
    assert [(e["step"], e["position"]) for e in events] == [(5, 20), (7, 28)]
    cache = out / "checkpoints" / ".universal"
    for done, (a, b), step in [(there, (2, 1), 5), (back, (1, 2), 7)]:
        assert (
            f"ZeRO-2, tensor-parallel {a}, data-parallel {3 - a}; this launch is 2 ranks, "
            f"ZeRO-2, tensor-parallel {b}, data-parallel {3 - b}: it is converted once"
        ) in done.stderr
        assert f"step{step:08d}: loading its universal form {cache}/step{step:08d}-" in done.stderr
        assert "param groups after the universal load: weight_decay [0.1, 0.0]" in done.stderr
    assert [p for p in cache.iterdir() if p.is_dir()] == []  # each removed by the next save
    assert_same_optimizer_state(
        out / "checkpoints" / "step00000010", tmp / "ref" / "checkpoints" / "step00000010"
    )


@pytest.mark.slow
def test_export_of_a_tensor_parallel_checkpoint(runs, tmp_path):
    """Slow (shares ``runs``; one export here, about 12 s on 2 cores, most of it the
    verification loading transformers' model). The TP=2 ZeRO-3 checkpoint at step 10, exported
    in fp32 by `anneal export` and verified by it (its logits equal those of the ranks' slices
    merged where the model's tp_plan cut them, an independent reader), loaded with
    ``from_pretrained``: the validation loss the live engine logged at step 10 (the same
    held-out windows) within 1e-5 relative, and the logits of the TP=1 run's step-10 weights
    within export's tolerance (1e-4 of the largest logit). The TP=2 x DP=2 ZeRO-2 run exported
    its own step 10 (``train.export_every_save``, bf16 as by default, verified): each weight is
    the TP=1 run's within one bf16 rounding (2^-8 relative) and 1e-5 (the two runs' weights
    differ by up to 2.2e-6 after 10 steps; a misplaced slice moves weights by about 1e-2). A
    manifest naming a third tensor-parallel rank whose files are not there is refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from anneal import model as modellib
    from anneal.data.stream import PackedSplit, heldout_windows
    from anneal.hf.export import export, format_report, read_marker
    from anneal.hf.source import preset_from_record
    from anneal.hf.verify import TOLERANCE
    from anneal.hf.zero import reference_state_dict
    from anneal.rundir import read_record

    tmp, done = runs
    tag = "step00000010"
    report = export(tmp / "tp2", out=tmp_path / "hf", tag=tag, dtype="fp32")
    assert report["tensor_parallel_size"] == 2 and report["zero_stage"] == 3
    assert "tensor-parallel 2" in format_report(report)
    record = read_record(tmp / "ref")
    weights = reference_state_dict(tmp / "ref" / "checkpoints" / tag, 2)
    ref = modellib.build_model(preset_from_record(record)).eval()
    ref.load_state_dict(weights)
    val = PackedSplit(Path(record.data_path), "val", seq_len=32)
    x, y = val.batch(heldout_windows(val.source_windows, 8))  # train.val_samples=8
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits, logits = ref(input_ids=x).logits, hf(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    live = read_metrics(tmp / "tp2", "val")[-1]
    assert live["step"] == 10 and loss == pytest.approx(live["val_loss"], rel=1e-5)
    tol = TOLERANCE["fp32"] * max(1.0, ref_logits.abs().max().item())
    assert (logits - ref_logits).abs().max().item() < tol

    every = read_marker(tmp / "tp2dp2" / "hf" / tag)
    assert (every["tensor_parallel_size"], every["zero_stage"], every["world_size"]) == (2, 2, 4)
    assert every["dtype"] == "bf16" and "verified:" in done["tp2dp2"].stdout
    exported = AutoModelForCausalLM.from_pretrained(tmp / "tp2dp2" / "hf" / tag).state_dict()
    for name, w in weights.items():
        assert exported[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(exported[name].float(), w, rtol=2**-8, atol=1e-5, msg=name)

    # A manifest naming more tensor-parallel ranks than wrote files: one UserError, no output.
    cut = tmp_path / "cut"
    shutil.copytree(tmp / "tp2", cut)
    manifest = cut / "checkpoints" / tag / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "tensor_parallel_size": 3}))
    with pytest.raises(UserError, match=r"no model states of tensor-parallel rank\(s\) 02"):
        export(cut, out=tmp_path / "cut_hf", tag=tag)
    assert not (tmp_path / "cut_hf").exists()


# -- fast: resolution and pre-flight -------------------------------------------------------------


_resolve, _refused = resolve_tiny, refused_tiny


def test_batch_arithmetic_counts_data_parallel_ranks(tiny_data, tmp_path):
    """4 ranks at TP=2 are 2 replicas: a global batch of 8 samples at micro-batch 2 takes 2
    accumulation steps (4 without TP); the plan printed at start says so."""
    args = _args(tiny_data, tmp_path / "run", tp=2, accum=2, stage=2)
    args += _sets("ds.gradient_accumulation_steps=auto", "optim.global_batch_tokens=256")
    launch = _resolve(args, world_size=4)
    assert (launch.layout.tensor_parallel, launch.layout.data_parallel) == (2, 2)
    assert launch.ds_config["train_batch_size"] == 8
    assert launch.ds_config["gradient_accumulation_steps"] == 2
    assert "4 ranks = tensor-parallel 2 x data-parallel 2" in launch.describe()
    assert launch.config_document()["launch"]["data_parallel_size"] == 2
    plain = _resolve([*args, *_sets("ds.tensor_parallel.autotp_size=1")], world_size=4)
    assert plain.ds_config["gradient_accumulation_steps"] == 1  # 8 / (2 x 4)
    assert not (tmp_path / "run").exists()


BAD_LAYOUTS = {
    "world_not_divisible": (3, 2, [], "do not split into tensor-parallel groups of 2"),
    "heads_not_divisible": (8, 8, [], "does not divide the model's num_attention_heads 4"),
    "negative": (2, -1, [], "tensor_parallel.autotp_size is -1"),
    "unknown_key": (2, 2, ["ds.tensor_parallel.vocab_parallel_lm_head=true"], "unknown key"),
}


@pytest.mark.parametrize("case", BAD_LAYOUTS, ids=list(BAD_LAYOUTS))
def test_bad_layouts_are_refused_in_resolution(case, tiny_data, tmp_path):
    world, tp, extra, match = BAD_LAYOUTS[case]
    args = _args(tiny_data, tmp_path / "run", tp=tp, accum=1, stage=2) + _sets(*extra)
    assert match in _refused(args, world_size=world)
    assert not (tmp_path / "run").exists()


def test_key_value_heads_must_divide_too():
    """The recipes' overrides keep kv heads = heads, so a grouped-query shape is checked here:
    32 query heads split over 16 ranks, 8 key-value heads do not."""
    gqa = dataclasses.replace(get_preset("7b"), num_key_value_heads=8)
    with pytest.raises(UserError, match="num_key_value_heads 8") as caught:
        parallel.layout({"tensor_parallel": {"autotp_size": 16}}, gqa, world_size=16, source="x")
    assert "num_attention_heads 32" not in str(caught.value)
    ok = parallel.layout({"tensor_parallel": {"autotp_size": 8}}, gqa, world_size=16, source="x")
    assert (ok.tensor_parallel, ok.data_parallel) == (8, 2)


def test_checkpoint_files_are_hashed_by_the_rank_that_wrote_them():
    """DeepSpeed's TP groups are blocks of consecutive ranks (``deepspeed.utils.groups``: the
    group of data-parallel rank d is ranks d*TP .. d*TP+TP-1) and its file names carry both
    ranks, so the manifest gives each file to its writer (its page cache, its node's disk)."""
    tp, dp = 2, 2
    blocks = [list(range(d * tp, d * tp + tp)) for d in range(dp)]
    for d in range(dp):
        for t in range(tp):
            for kind in ("optim_states", "model_states"):  # ZeRO-1/2 optimizer, ZeRO-3 both
                name = f"zero_pp_rank_{d}_mp_rank_{t:02d}_{kind}.pt"
                assert owner_of(name, tp * dp, tp) == blocks[d][t], name
        assert owner_of(f"mp_rank_{d:02d}_model_states.pt", tp * dp, tp) == blocks[0][d]
    assert owner_of("zero_pp_rank_3_mp_rank_00_optim_states.pt", 4) == 3  # without TP


def _fake_checkpoint(out, *, world_size: int, tp: int):
    """A tag directory that resume takes as intact (a manifest listing no files)."""
    tag = out / "checkpoints" / "step00000005"
    tag.mkdir(parents=True)
    manifest = {"tag": tag.name, "step": 5, "files": {}, "world_size": world_size}
    manifest["tensor_parallel_size"] = tp
    (tag / "manifest.json").write_text(json.dumps(manifest))
    return tag


LAYOUT_CHANGES = [((2, 2), (2, 1)), ((2, 1), (2, 2)), ((4, 2), (2, 2)), ((4, 2), (4, 1))]


@pytest.mark.parametrize("saved,now", LAYOUT_CHANGES)
def test_another_layout_resumes_at_zero_2_and_is_refused_at_zero_3(saved, now, tiny_data, tmp_path):
    """(world, tp) saved -> (world, tp) now. At ZeRO-2 the launch resolves and says the change
    in one line (the checkpoint goes through DeepSpeed's universal checkpoint; the slow round
    trip above runs TP=2 -> 1 -> 2); at ZeRO-3, where DeepSpeed 0.19.8's converter and loader
    fail, and without ZeRO on as many ranks, it is refused with what works, before anything
    is written."""
    out = tmp_path / "run"
    tag = _fake_checkpoint(out, world_size=saved[0], tp=saved[1])

    def args(stage):
        return _args(tiny_data, out, tp=now[1], accum=1, stage=stage) + ["--resume", "auto"]

    notes = "\n".join(_resolve(args(2), world_size=now[0]).notes)
    assert f"was saved on {saved[0]} ranks, tensor-parallel {saved[1]}" in notes
    assert "converted once to DeepSpeed's universal checkpoint" in notes
    message = _refused(args(3), world_size=now[0])
    assert "at ZeRO-3" in message and f"autotp_size={saved[1]} on {saved[0]} ranks" in message
    if saved[0] == now[0]:
        assert "without ZeRO" in _refused(args(0), world_size=now[0])
    assert sorted(p.name for p in out.rglob("*")) == ["checkpoints", "manifest.json", tag.name]


def test_launcher_preflight_refuses_before_starting(tiny_data, tmp_path, capsys, monkeypatch):
    """`python -m launcher run` with 3 ranks at TP=2: one paragraph, exit 2, nothing started."""
    import launcher.__main__ as launcher_cli

    def start(*args, **kwargs):
        raise AssertionError(f"pre-flight let a bad launch start: {args}")

    monkeypatch.setattr(launcher_cli.subprocess, "run", start)
    out = tmp_path / "run"
    args = _args(tiny_data, out, tp=2, accum=1, stage=2)
    code = launcher_main(
        ["run", str(TINY), "--device", "cpu", "--no-ssh-check", "--num-gpus", "3", "--", *args]
    )
    printed = capsys.readouterr()
    assert code == 2, printed.out + printed.err
    assert "tensor-parallel groups of 2" in printed.err
    assert len(printed.err.strip().splitlines()) == 1
    assert not out.exists()


def test_export_reads_the_tp_plan_as_deepspeed_does():
    """The export's reference reader (anneal/hf/tp_merge.py) cuts where DeepSpeed's own reading
    of the model's Hugging Face tp_plan shards: Llama's q, k, v, gate, up and LM head along dim
    0, o and down along dim 1, the embedding and norms whole; a column-wise layer's bias (Qwen2's
    q, k, v: ``LinearLayer`` splits weight and bias alike) along dim 0. Models on the meta
    device; no weights are made."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from anneal.hf.tp_merge import _plan_dim, _plan_dims

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, vocab_size=300)
    small |= dict(num_attention_heads=4, num_key_value_heads=2)
    want = {
        "model.layers.0.self_attn.q_proj.weight": 0,
        "model.layers.0.self_attn.k_proj.weight": 0,
        "model.layers.0.self_attn.o_proj.weight": 1,
        "model.layers.0.mlp.gate_proj.weight": 0,
        "model.layers.0.mlp.down_proj.weight": 1,
        "lm_head.weight": 0,
        "model.embed_tokens.weight": None,
        "model.layers.0.input_layernorm.weight": None,
        "model.norm.weight": None,
    }
    for kind, extra in (("llama", {}), ("qwen2", {"model.layers.0.self_attn.v_proj.bias": 0})):
        config = AutoConfig.for_model(kind, tie_word_embeddings=False, **small)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        cut = _plan_dims(model)
        names = {name for name, _ in model.named_parameters()}
        for name, dim in {**want, **extra}.items():
            assert name in names and _plan_dim(cut, name) == dim, (kind, name)
