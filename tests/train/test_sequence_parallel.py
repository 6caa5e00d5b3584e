"""Ulysses sequence parallelism through DeepSpeed 0.19.8 (``--set ds.sequence_parallel_size=N``,
anneal/train/sequence.py), checked against the same run without it.

Slow (real engine, real processes, gloo, fp32 on CPU, micro shapes at sequence 32): SP=2 on 2
ranks with ZeRO-2 and with ZeRO-3 log per-step losses and gradient norms over 10 steps equal to
an SP=1 run on 1 rank with the same global batch of 4 samples (within 1e-5 relative), and the
same validation loss and bits per byte; an SP=2 checkpoint resumed at the same topology
continues bitwise. Equal gradient norms show that each rank back-propagates the right share of
the loss for each ZeRO stage's reduction (equal losses alone would not: AdamW and clipping
forgive a gradient off by a constant factor); equal losses also show that the ranks of a group
read the same samples, each its own slice with its positions, and that validation adds the
slices' sums. Slow because it launches 4 runs, two at a time (the resume after the ZeRO-3 run
that saves its checkpoint): 123-139 s here on 2 cores shared with four other workers (load
8-15), 96 s of CPU (user + sys, all processes).

Fast (in this process, through ``resolve_launch`` and the launcher's pre-flight, as every rank
and the launch host run them): the batch arithmetic counts world / SP replicas; each bad layout
is one clear UserError before anything starts (a world, sequence length or head count that does
not divide, SP with TP, ZeRO-1, ZeRO-3 without reduce_scatter, a sliding-window model, a resume
at another SP degree); recipes/long_context_1b.py resolves on the GPU path at 8 and 16 GPUs (its
own defaults, as tests/resolution/test_recipes.py resolves the pretrain recipes). Anneal trains
with SDPA (or, masking documents on a GPU with flash-attn, its varlen kernel:
``anneal.model.attention``) and has no setting for eager attention, which DeepSpeed's Ulysses
refuses. Masked runs under Ulysses: tests/train/test_document_mask.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from anneal.cli.recipe import config_from_args, load_recipe
from anneal.errors import UserError
from anneal.model import get_preset
from anneal.resolution import parallel
from anneal.resolution.resolve import resolve_launch
from launcher.__main__ import main as launcher_main
from tests.conftest import (
    PARALLEL_STEPS,
    ROOT,
    assert_resumed_steps_match,
    parallel_args,
    read_metrics,
    refused_tiny,
    resolve_tiny,
    run_recipes,
    sets,
)
from tests.zero_state import assert_same_optimizer_state

TINY = ROOT / "recipes" / "pretrain_tiny.py"
STEPS = PARALLEL_STEPS
_sets = sets


def _args(data, out, *, sp: int, stage: int, accum: int = 2, extra=()) -> list[str]:
    """conftest's parallel_args at sequence-parallel degree ``sp``, saved at steps 5 and 10."""
    layout = f"ds.sequence_parallel_size={sp}"
    return parallel_args(data, out, layout=layout, accum=accum, stage=stage, extra=extra)


# -- slow: the real engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """The SP=1 reference (1 rank), SP=2 at ZeRO-3 and at ZeRO-2 (2 ranks; each 4 samples a
    step), and the ZeRO-3 run resumed from its step-5 checkpoint in a new directory."""
    tmp = tmp_path_factory.mktemp("sp")
    tag = tmp / "z3" / "checkpoints" / "step00000005"
    first = {
        "z3": dict(args=_args(tiny_data, tmp / "z3", sp=2, stage=3), ranks=2),
        "ref": dict(args=_args(tiny_data, tmp / "ref", sp=1, stage=2), ranks=1),
    }
    then = {
        "z2": dict(args=_args(tiny_data, tmp / "z2", sp=2, stage=2), ranks=2),
        "resumed": dict(
            args=_args(tiny_data, tmp / "resumed", sp=2, stage=3, extra=["--resume", str(tag)]),
            ranks=2,
        ),
    }
    done = dict(zip(first, run_recipes(list(first.values())), strict=True))
    done |= dict(zip(then, run_recipes(list(then.values())), strict=True))
    return tmp, done


def _train(out) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out, "train")}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z2", "z3"])
def test_losses_and_gradients_equal_the_run_without_sequence_parallelism(runs, name):
    """Slow (4 launches, shared): within 1e-5 relative at each of the 10 steps (the reductions
    run in another order), and the final validation figures too."""
    tmp, done = runs
    ref, sp = _train(tmp / "ref"), _train(tmp / name)
    assert sorted(ref) == sorted(sp) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "grad_norm"):
            assert sp[step][key] == pytest.approx(ref[step][key], rel=1e-5), (step, key)
        assert sp[step]["tokens"] == ref[step]["tokens"] == step * 4 * 32
    assert len({r["loss"] for r in ref.values()}) == STEPS  # the data moved on every step
    val_ref, val_sp = read_metrics(tmp / "ref", "val")[-1], read_metrics(tmp / name, "val")[-1]
    for key in ("val_loss", "val_bpb"):
        assert val_sp[key] == pytest.approx(val_ref[key], rel=1e-5), key
    config = json.loads((tmp / name / "config.json").read_text())
    assert config["launch"]["sequence_parallel_size"] == 2
    assert config["launch"]["data_parallel_size"] == 1
    assert "2 ranks = sequence-parallel 2 x data-parallel 1" in done[name].stdout


@pytest.mark.slow
def test_resume_at_the_same_topology_is_exact(runs, tiny_data, tmp_path):
    """Slow (shares ``runs``): steps 6-10 after resuming the ZeRO-3 SP=2 run's step-5
    checkpoint are bitwise those of the run that went on; its manifest records the degree, and
    a resume of it at SP=1 is refused in resolution with the reason."""
    tmp, done = runs
    tag = tmp / "z3" / "checkpoints" / "step00000005"
    assert json.loads((tag / "manifest.json").read_text())["sequence_parallel_size"] == 2
    assert f"resumed from {tag} at step 5" in done["resumed"].stdout
    full, resumed = _train(tmp / "z3"), _train(tmp / "resumed")
    assert sorted(resumed) == list(range(6, STEPS + 1))
    for step in resumed:
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert resumed[step][key] == full[step][key], (step, key)
    args = _args(tiny_data, tmp_path / "r", sp=1, stage=3, extra=["--resume", str(tag)])
    assert "Resume on 2 ranks" in _refused(args, world_size=1)


@pytest.fixture(scope="module")
def round_trip(runs, tiny_data):
    """The ZeRO-2 SP=2 run's step-5 checkpoint resumed at SP=1 on the same 2 ranks (2 replicas
    of micro-batch 2, accumulation 1: the same 4 samples a step) up to step 7, and that run's
    step-7 checkpoint resumed at SP=2 (accumulation 2) up to step 10: two launches, one after
    the other."""
    tmp, _ = runs
    out, tag = tmp / "round_trip", tmp / "z2" / "checkpoints" / "step00000005"
    there = _args(tiny_data, out, sp=1, stage=2, accum=1, extra=["--resume", str(tag)])
    there += _sets("train.stop_at_step=7")
    back = _args(tiny_data, out, sp=2, stage=2, extra=["--resume", "auto"])
    return out, [run_recipes([dict(args=a, ranks=2)])[0] for a in (there, back)]


@pytest.mark.slow
def test_resume_at_another_degree_on_as_many_ranks(runs, round_trip):
    """Slow (two 2-rank launches, about 25 s, after ``runs``): SP=2 -> 1 at step 5 and 1 -> 2
    at step 7, each loading the files as saved (ZeRO partitions over both ranks at either
    degree; no universal conversion). Steps 6-10 match the ZeRO-2 SP=2 run that never changed
    (losses and grad norms within 1e-5 relative, the LR and the tokens exactly), the data
    position carries over, and the optimizer state at step 10 (each rank's AdamW moments,
    master weights, steps and hyperparameters) is that run's."""
    tmp, _ = runs
    out, (there, back) = round_trip
    full, resumed = _train(tmp / "z2"), _train(out)
    assert_resumed_steps_match(resumed, full, range(6, STEPS + 1))
    events = [e for e in read_metrics(out, "event") if e["event"] == "resume"]
    assert [(e["step"], e["position"]) for e in events] == [(5, 20), (7, 28)]
    for done, (a, b) in [(there, (2, 1)), (back, (1, 2))]:
        assert (
            f"ZeRO-2, sequence-parallel {a}, data-parallel {3 - a}; this launch is 2 ranks, "
            f"ZeRO-2, sequence-parallel {b}, data-parallel {3 - b}: its files load as saved"
        ) in done.stderr
        assert "loading its universal form" not in done.stderr
    assert not (out / "checkpoints" / ".universal").exists()
    assert_same_optimizer_state(
        out / "checkpoints" / "step00000010", tmp / "z2" / "checkpoints" / "step00000010"
    )


# -- fast: resolution and pre-flight -------------------------------------------------------------


_resolve, _refused = resolve_tiny, refused_tiny


def test_batch_arithmetic_counts_replicas_of_sequence_parallel_groups(tiny_data, tmp_path):
    """4 ranks at SP=2 are 2 replicas: a global batch of 8 samples at micro-batch 2 takes 2
    accumulation steps (1 without SP); the plan printed at start says so."""
    args = _args(tiny_data, tmp_path / "run", sp=2, stage=2)
    args += _sets("ds.gradient_accumulation_steps=auto", "optim.global_batch_tokens=256")
    launch = _resolve(args, world_size=4)
    layout = launch.layout
    assert (layout.sequence_parallel, layout.tensor_parallel, layout.data_parallel) == (2, 1, 2)
    assert launch.ds_config["train_batch_size"] == 8
    assert launch.ds_config["gradient_accumulation_steps"] == 2
    assert "4 ranks = sequence-parallel 2 x data-parallel 2" in launch.describe()
    assert launch.config_document()["launch"]["data_parallel_size"] == 2
    plain = _resolve([*args, *_sets("ds.sequence_parallel_size=1")], world_size=4)
    assert plain.ds_config["gradient_accumulation_steps"] == 1  # 8 / (2 x 4)
    assert not (tmp_path / "run").exists()


BAD_LAYOUTS = {
    "world_not_divisible": (3, 2, [], "do not split into sequence-parallel groups of 2"),
    "sequence_not_divisible": (3, 3, [], "does not divide the sequence length 32"),
    "heads_not_divisible": (8, 8, [], "does not divide the model's num_attention_heads 4"),
    "with_tensor_parallel": (4, 2, ["ds.tensor_parallel.autotp_size=2"], "Use one"),
    "zero1": (2, 2, ["ds.zero_optimization.stage=1"], "with ZeRO stage 1"),
    "zero3_without_reduce_scatter": (
        2,
        2,
        ["ds.zero_optimization.stage=3", "ds.zero_optimization.reduce_scatter=false"],
        "reduce_scatter false",
    ),
    "zero": (2, 0, [], "sequence_parallel_size is 0"),
}


@pytest.mark.parametrize("case", BAD_LAYOUTS, ids=list(BAD_LAYOUTS))
def test_bad_layouts_are_refused_in_resolution(case, tiny_data, tmp_path):
    world, sp, extra, match = BAD_LAYOUTS[case]
    args = _args(tiny_data, tmp_path / "run", sp=sp, stage=2, accum=1) + _sets(*extra)
    assert match in _refused(args, world_size=world)
    assert not (tmp_path / "run").exists()


def test_key_value_heads_and_sliding_windows():
    """Grouped-query shapes: 32 query heads split over 16 ranks, 8 key-value heads do not. A
    Mistral checkpoint's sliding window shorter than the sequence is refused (Ulysses attends
    over the whole sequence); one as long as the sequence changes nothing and passes."""
    ds = {"sequence_parallel_size": 16, "zero_optimization": {"stage": 3}}
    gqa = dataclasses.replace(get_preset("7b"), num_key_value_heads=8)
    with pytest.raises(UserError, match="num_key_value_heads 8") as caught:
        parallel.layout(ds, gqa, world_size=16, source="x")
    assert "num_attention_heads 32" not in str(caught.value)
    ok = parallel.layout({**ds, "sequence_parallel_size": 8}, gqa, world_size=16, source="x")
    assert (ok.sequence_parallel, ok.data_parallel) == (8, 2)
    ds8 = {**ds, "sequence_parallel_size": 8}
    for window, refused in [(1024, True), (gqa.seq_len, False)]:
        mistral = dataclasses.replace(
            gqa, hf_config={"model_type": "mistral", "sliding_window": window}
        )
        if refused:
            with pytest.raises(UserError, match="sliding window of 1024 tokens"):
                parallel.layout(ds8, mistral, world_size=16, source="x")
        else:
            assert parallel.layout(ds8, mistral, world_size=16, source="x") == ok


def _fake_checkpoint(out, *, world_size: int, sp: int):
    """A tag directory that resume takes as intact (a manifest listing no files)."""
    tag = out / "checkpoints" / "step00000005"
    tag.mkdir(parents=True)
    manifest = {"tag": tag.name, "step": 5, "files": {}, "world_size": world_size}
    manifest["sequence_parallel_size"] = sp
    (tag / "manifest.json").write_text(json.dumps(manifest))
    return tag


def test_resume_at_another_degree_on_other_ranks_is_refused(tiny_data, tmp_path):
    """Saved at SP=1 on 2 ranks: resumed at SP=2 on those 2 ranks it resolves, with the
    change in one line (the slow round trip above runs it); on 4 ranks, which goes through
    DeepSpeed's universal checkpoint, it is refused before anything is written."""
    out = tmp_path / "run"
    tag = _fake_checkpoint(out, world_size=2, sp=1)
    args = _args(tiny_data, out, sp=2, stage=3) + ["--resume", "auto"]
    notes = "\n".join(_resolve(args, world_size=2).notes)
    assert "sequence-parallel 1, data-parallel 2; this launch is 2 ranks" in notes
    message = _refused(args, world_size=4)
    assert "Resume on 2 ranks" in message and "--init-from" in message
    assert sorted(p.name for p in out.rglob("*")) == ["checkpoints", "manifest.json", tag.name]


def test_launcher_preflight_refuses_before_starting(tiny_data, tmp_path, capsys, monkeypatch):
    """`python -m launcher run` with 2 ranks at SP=2 and a sequence of 33: one paragraph,
    exit 2, nothing started."""
    import launcher.__main__ as launcher_cli

    def start(*args, **kwargs):
        raise AssertionError(f"pre-flight let a bad launch start: {args}")

    monkeypatch.setattr(launcher_cli.subprocess, "run", start)
    out = tmp_path / "run"
    args = _args(tiny_data, out, sp=2, stage=2) + _sets("model.seq_len=33")
    code = launcher_main(
        ["run", str(TINY), "--device", "cpu", "--no-ssh-check", "--num-gpus", "2", "--", *args]
    )
    printed = capsys.readouterr()
    assert code == 2, printed.out + printed.err
    assert "does not divide the sequence length 33" in printed.err
    assert len(printed.err.strip().splitlines()) == 1
    assert not out.exists()


LONG = ROOT / "recipes" / "long_context_1b.py"


@pytest.mark.parametrize("world", [8, 16])
def test_the_long_context_recipe_resolves_on_gpus(world, stdlib_data, tmp_path):
    """recipes/long_context_1b.py on the GPU path with its own defaults, as
    tests/resolution/test_recipes.py
    resolves every pretrain recipe: 32K tokens over groups of 8 GPUs, RoPE base 500,000, its
    global batch split exactly over world / 8 replicas; fewer GPUs than a group are refused."""
    spec = load_recipe(LONG)
    argv = ["--data", str(stdlib_data), "--out", str(tmp_path / "run")]
    cfg, overrides = config_from_args(argv, prog=str(LONG), on_cpu=False, **spec)
    launch = resolve_launch(cfg, overrides, world_size=world, device_type="cuda")
    ds = launch.ds_config
    assert (launch.seq_len, launch.preset.rope_theta, launch.preset.name) == (32768, 5e5, "1b")
    assert (launch.layout.sequence_parallel, launch.layout.data_parallel) == (8, world // 8)
    assert ds["train_batch_size"] * launch.seq_len == spec["optim"].global_batch_tokens
    assert ds["train_batch_size"] == ds["gradient_accumulation_steps"] * (world // 8)
    assert launch.bf16 and ds["zero_optimization"]["stage"] == 3
    assert not launch.cfg.model.activation_checkpointing
    with pytest.raises(UserError, match="sequence-parallel groups of 8"):
        resolve_launch(cfg, overrides, world_size=4, device_type="cuda")
