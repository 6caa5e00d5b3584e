"""The parallel-layout rules once (anneal/model/layout_rules.py): the launch's pre-flight check
(``anneal.resolution.parallel.layout`` on the ds_config the launch resolves, its AutoEP section
filled in) and ``anneal estimate``'s check (``anneal.planning.memory_layout.check``, which
``memory.estimate`` runs first, on the ``ZeroSetup`` and ``Workload`` the command builds from the
same ds_config) give every layout the same verdict: both accept it, or both refuse it by the
same rule, each in its own words (the launch's naming ``--set ds....``, the estimate's its own
flags). The layouts cross TP, SP and EP degrees, ZeRO stages, dense and sparse models, grouped
query heads, ``reduce_scatter``, a sliding attention window and offload, among them those on
which the two drifted apart before the rules were one (the estimate accepted Ulysses at ZeRO-3
without reduce_scatter and on a sliding window, and offload sections whose device is "none"
with experts; the launch accepted an expert-parallel degree on a dense model). No launch, no
training: each verdict is a pure check."""

from __future__ import annotations

import dataclasses
import json

import pytest

from anneal import cli
from anneal.config.ds_schema import Degrees, degrees
from anneal.errors import UserError
from anneal.model import get_preset
from anneal.model import layout_rules as rules
from anneal.planning import memory, memory_layout
from anneal.resolution import parallel
from anneal.resolution.ds import find_ds_config, load_ds_config
from anneal.resolution.expert_layout import fill_expert_parallel

DENSE, SPARSE = get_preset("7b"), get_preset("olmoe-1b-7b")
GQA = dataclasses.replace(DENSE, num_key_value_heads=8)
MISTRAL = dataclasses.replace(GQA, hf_config={"model_type": "mistral", "sliding_window": 1024})
QWEN2 = dataclasses.replace(GQA, hf_config={"model_type": "qwen2", "sliding_window": 1024})


def ds(stage: int, *, tp: int = 1, sp: int = 1, ep: int | None = None, **zero_keys) -> dict:
    """A ds_config of ZeRO ``stage`` with these degrees and ``zero_optimization`` keys."""
    doc = load_ds_config(find_ds_config("zero2_bf16.json"))
    doc = {**doc, "zero_optimization": {**doc["zero_optimization"], "stage": stage, **zero_keys}}
    if tp > 1:
        doc["tensor_parallel"] = {"autotp_size": tp}
    if sp > 1:
        doc["sequence_parallel_size"] = sp
    if ep is not None:
        doc["expert_parallel"] = {"autoep_size": ep}
    return doc


CPU = {"device": "cpu"}
NONE = {"device": "none"}
# name: (model, ds_config, ranks, the rule that refuses it or None)
LAYOUTS = {
    "dense_zero0": (DENSE, ds(0), 8, None),
    "dense_zero3_offload": (DENSE, ds(3, offload_optimizer=CPU), 8, None),
    "tp2_zero1": (DENSE, ds(1, tp=2), 8, None),
    "tp8_zero3": (DENSE, ds(3, tp=8), 8, None),
    "tp3_ranks": (DENSE, ds(2, tp=3), 8, rules.TP_GROUPS),
    "tp16_gqa_heads": (GQA, ds(2, tp=16), 16, rules.TP_HEADS),
    "tp8_gqa": (GQA, ds(2, tp=8), 16, None),
    "tp2_sp2": (DENSE, ds(3, tp=2, sp=2), 8, rules.TP_WITH_SP),
    "sp2_zero1": (DENSE, ds(1, sp=2), 8, rules.SP_STAGE),
    "sp2_zero0": (DENSE, ds(0, sp=2), 8, rules.SP_STAGE),
    "sp2_zero2": (DENSE, ds(2, sp=2), 8, None),
    "sp4_zero3": (DENSE, ds(3, sp=4), 8, None),
    "sp2_zero3_no_reduce_scatter": (
        DENSE,
        ds(3, sp=2, reduce_scatter=False),
        8,
        rules.SP_REDUCE_SCATTER,
    ),
    "sp2_zero2_no_reduce_scatter": (DENSE, ds(2, sp=2, reduce_scatter=False), 8, None),
    "sp2_zero3_reduce_scatter_on": (DENSE, ds(3, sp=2, reduce_scatter=True), 8, None),
    "sp8_ranks": (DENSE, ds(3, sp=8), 12, rules.SP_GROUPS),
    "sp16_gqa_heads": (GQA, ds(3, sp=16), 16, rules.SP_HEADS),
    "sp8_gqa": (GQA, ds(3, sp=8), 16, None),
    "sp2_sequence_4100": (dataclasses.replace(DENSE, seq_len=4100), ds(3, sp=2), 8, None),
    "sp4_sequence": (dataclasses.replace(DENSE, seq_len=4098), ds(3, sp=4), 8, rules.SP_SEQUENCE),
    "sp2_sliding_window": (MISTRAL, ds(3, sp=2), 8, rules.SP_WINDOW),
    "sp2_window_as_long": (dataclasses.replace(MISTRAL, seq_len=1024), ds(3, sp=2), 8, None),
    "sp2_qwen2_window_off": (QWEN2, ds(3, sp=2), 8, None),
    "sp1_sliding_window": (MISTRAL, ds(3), 8, None),
    "sp2_zero3_offload": (DENSE, ds(3, sp=2, offload_optimizer=CPU), 8, None),
    "dense_ep2": (DENSE, ds(2, ep=2), 8, rules.EXPERTS_ON_DENSE),
    "sparse_zero2": (SPARSE, ds(2), 8, None),
    "sparse_ep8_zero1": (SPARSE, ds(1, ep=8), 8, None),
    "sparse_ep4_zero3": (SPARSE, ds(3, ep=4), 8, None),
    "sparse_ep3": (SPARSE, ds(2, ep=3), 8, rules.EXPERTS_UNEVEN),
    "sparse_ep16_ranks": (SPARSE, ds(2, ep=16), 8, rules.EXPERT_GROUPS),
    "sparse_ep2_tp2": (SPARSE, ds(2, ep=2, tp=2), 8, rules.EXPERTS_WITH_TP_SP),
    "sparse_sp2_zero3": (SPARSE, ds(3, sp=2), 8, rules.EXPERTS_WITH_TP_SP),
    "sparse_offload_cpu": (SPARSE, ds(3, offload_param=CPU), 8, rules.EXPERTS_WITH_OFFLOAD),
    "sparse_offload_none": (SPARSE, ds(2, offload_optimizer=NONE), 8, rules.EXPERTS_WITH_OFFLOAD),
}


def launch_verdict(preset, doc: dict, ranks: int) -> str | None:
    """The launch's pre-flight: the message that refuses the layout, or None."""
    filled = fill_expert_parallel(doc, preset, device_type="cuda", source="ds.json")
    try:
        parallel.layout(filled, preset, world_size=ranks, source="ds.json")
    except UserError as e:
        return str(e)
    return None


def estimate_verdict(preset, doc: dict, ranks: int) -> str | None:
    """``anneal estimate``'s check on what it reads of the same ds_config, or None."""
    d = degrees(doc)
    work = memory.Workload(
        micro_batch=1, seq_len=preset.seq_len, n_gpus=ranks, tp=d.tp, sp=d.sp, ep=d.ep
    )
    try:
        memory_layout.check(preset, memory.ZeroSetup.from_ds_config(doc), work)
    except UserError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_launch_and_the_estimate_give_the_same_verdict(name):
    """Both accept, or both refuse by the rule the table names; each message is one line, the
    launch's naming the ds_config key with ``--set ds.`` or the key, the estimate's its flag."""
    preset, doc, ranks, rule = LAYOUTS[name]
    found = rules.refusal(
        preset, rules.Setup.from_ds_config(doc, world_size=ranks, seq_len=preset.seq_len)
    )
    assert (found and found.rule) == rule
    launch, estimate = launch_verdict(preset, doc, ranks), estimate_verdict(preset, doc, ranks)
    assert (launch is None) == (estimate is None) == (rule is None), (launch, estimate)
    if rule is not None:
        assert launch.startswith("ds.json: ") and "\n" not in launch
        flag = {"tp": "--tp", "sp": "--sp", "ep": "--ep"}[found.degree]
        assert estimate.startswith(("--tp ", "--sp ", "--ep ")) and "\n" not in estimate
        assert flag in estimate


def test_the_table_reaches_every_rule_a_launch_can_break():
    """Every rule but the two a resolved ds_config cannot break (a degree below 1, which the
    schema and ``degrees`` keep out; eager attention, an estimate-only flag) refuses a layout of
    the table above, so the test covers each."""
    reached = {rule for *_, rule in LAYOUTS.values()}
    assert reached == set(rules.RULES) - {rules.DEGREE_BELOW_ONE, rules.SP_EAGER} | {None}


def test_the_drifted_layouts_are_refused_by_anneal_estimate(tmp_path, capsys):
    """The command itself on the layouts it used to accept: Ulysses at ZeRO-3 without
    reduce_scatter, and a sparse model with an offload section whose device is "none"."""
    for argv, doc, says in [
        (["--model", "7b", "--sp", "2"], ds(3, reduce_scatter=False), "reduce_scatter false"),
        (["--model", "olmoe-1b-7b"], ds(2, offload_optimizer=NONE), "with ZeRO offload"),
    ]:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(doc))
        assert cli.main(["estimate", *argv, "--ds-config", str(path)]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1


def test_eager_attention_and_degrees_below_one_are_the_estimates_own():
    """The estimate's flags can break the two rules no ds_config reaches: ``--eager-attention``
    under Ulysses, and a degree below 1 (``degrees`` reads DeepSpeed's 0 as off)."""
    zero = memory.ZeroSetup.from_ds_config(ds(3))
    work = memory.Workload(micro_batch=1, seq_len=4096, n_gpus=8)
    eager = dataclasses.replace(work, sp=2, eager_attention=True)
    with pytest.raises(UserError, match="never eager"):
        memory.estimate(DENSE, zero, eager)
    for flag in ("tp", "sp", "ep"):
        with pytest.raises(UserError, match=f"--{flag} 0: .* must be at least 1"):
            memory.estimate(DENSE, zero, dataclasses.replace(work, **{flag: 0}))
    assert degrees({"tensor_parallel": {"autotp_size": 0}}) == Degrees(tp=1, sp=1, ep=1)
    assert degrees(ds(3, tp=2, sp=4, ep=8)) == Degrees(tp=2, sp=4, ep=8)
