"""The memory estimator under Ulysses sequence parallelism (anneal/planning/memory_sp.py), and the
estimate against the measured peak memory of a real tensor-parallel run on CPU.

Fast: SP=1 is the estimate as before, bit for bit; at SP=s each rank's activations and logits are
the closed forms at seq/s tokens (Anneal's Llama block keeps ``s b h (22 + 8 f / h)`` bytes per
layer at bf16 with SDPA, the chunked loss ``8 c V + tokens h 2 + V h 6``) while the model states
are plain ZeRO's over all n GPUs (DeepSpeed partitions over the sequence-data-parallel group, the
whole world); the layouts Anneal refuses before launch are refused here too; the SP lever is the
smallest degree that fits; ``--sp`` and a run's ``sequence_parallel_size`` are read, and the
launcher's forecast reads it.

Slow: the estimate against the measured peak RSS of real TP=2 and SP=2 runs on CPU
(``test_estimate_matches_measured_peak_rss_under_tp2_and_sp2``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from anneal import cli
from anneal.errors import UserError
from anneal.model import get_preset
from anneal.planning import forecast, memory, memory_levers
from anneal.planning.memory import GiB
from anneal.resolution.ds import find_ds_config, load_ds_config
from tests.conftest import BIN, free_port
from tests.planning.test_memory import estimate_for, wait_peak_rss

REPO = Path(__file__).resolve().parents[2]


def zero_from(name: str) -> memory.ZeroSetup:
    return memory.ZeroSetup.from_ds_config(load_ds_config(find_ds_config(name)))


def work(seq: int, *, n_gpus: int = 8, micro_batch: int = 1, **kw) -> memory.Workload:
    return memory.Workload(micro_batch=micro_batch, seq_len=seq, n_gpus=n_gpus, **kw)


def test_sp1_is_unchanged_bit_for_bit():
    """The 7b recipe's ZeRO-3 total at micro-batch 4 x 4096 on 8 GPUs, as before SP existed
    (tests/planning/test_memory.py's test_tp1_is_unchanged_bit_for_bit holds the same number)."""
    w = work(4096, micro_batch=4)
    est = memory.estimate(get_preset("7b"), zero_from("zero3_bf16.json"), w)
    assert est.total == 109579977472
    assert est == memory.estimate(
        get_preset("7b"), zero_from("zero3_bf16.json"), dataclasses.replace(w, sp=1)
    )


@pytest.mark.parametrize("sp", [2, 4, 8])
@pytest.mark.parametrize("ckpt", [False, True])
def test_sp_divides_the_sequence_not_the_model_states(sp, ckpt):
    """7b (no GQA: kv = h) at 32768 tokens on 8 GPUs, ZeRO-3 bf16, chunked loss of 512 tokens."""
    preset, zero, seq = get_preset("7b"), zero_from("zero3_bf16.json"), 32768
    h, f, v, n_layers = (
        preset.hidden_size,
        preset.intermediate_size,
        preset.vocab_size,
        preset.num_hidden_layers,
    )
    one = memory.estimate(preset, zero, work(seq, activation_checkpointing=ckpt))
    est = memory.estimate(preset, zero, work(seq, sp=sp, activation_checkpointing=ckpt))
    assert (est.params, est.grads, est.optimizer) == (one.params, one.grads, one.optimizer)
    assert est.buffers == one.buffers and est.step_buffers == one.step_buffers
    tokens = seq // sp  # one rank's slice of the micro-batch's one sequence
    layer = tokens * h * (22 + 8 * f / h)
    kept = n_layers * 2 * tokens * h + layer if ckpt else n_layers * layer
    assert est.activations == int(kept)
    assert est.logits == 8 * 512 * v + tokens * h * 2 + v * h * 6
    assert est.activations < one.activations


BAD = {
    "with_tp": (dict(tp=2, sp=2), "zero3_bf16.json", "tensor and sequence parallelism apart"),
    "zero1": (dict(sp=2), "zero1_bf16.json", "with ZeRO stage 1"),
    "eager": (dict(sp=2, eager_attention=True), "zero3_bf16.json", "never eager"),
    "gpus": (dict(sp=8, n_gpus=12), "zero3_bf16.json", "do not split into groups of 8"),
    "sequence": (dict(sp=8, seq_len=4100), "zero3_bf16.json", "sequence of 4100 tokens"),
    "heads": (dict(sp=64, n_gpus=64), "zero3_bf16.json", "num_attention_heads 32"),
    "zero": (dict(sp=0), "zero3_bf16.json", "at least 1"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_layouts_anneal_refuses_are_refused(case):
    changes, ds, message = BAD[case]
    w = dataclasses.replace(work(4096), **changes)
    with pytest.raises(UserError, match=message):
        memory.estimate(get_preset("7b"), zero_from(ds), w)


def test_levers_suggest_the_smallest_sequence_parallel_degree_that_fits():
    """7b at one sequence of 32768 tokens on 8 H100s (80 GB) does not fit; SP=4 is the smallest
    degree that does, and the lever's total is the estimate at SP=4."""
    preset, zero, cap = get_preset("7b"), zero_from("zero3_bf16.json"), int(79.65 * GiB)
    totals = {s: memory.estimate(preset, zero, work(32768, sp=s)).total for s in (1, 2, 4)}
    assert totals[1] > totals[2] > cap > totals[4]
    found = memory_levers.levers(preset, zero, work(32768), capacity=cap, runtime_bytes=GiB)
    (sp,) = [lever for lever in found if lever.name == "sequence parallel"]
    assert sp.setting == "--set ds.sequence_parallel_size=4" and sp.total == totals[4]
    names = [lever.name for lever in found]
    assert names.index("tensor parallel") < names.index("sequence parallel") < names.index("layers")
    under_tp = memory_levers.levers(
        preset, zero, work(32768, tp=2), capacity=GiB, runtime_bytes=GiB
    )
    (none,) = [lever for lever in under_tp if lever.name == "sequence parallel"]
    assert none.setting is None and none.note == "not with TP"
    under_sp = memory_levers.levers(
        preset, zero, work(32768, sp=2), capacity=GiB, runtime_bytes=GiB
    )
    (none,) = [lever for lever in under_sp if lever.name == "tensor parallel"]
    assert none.setting is None and none.note == "not with SP"


def test_the_sequence_parallel_lever_follows_the_layout_rules():
    """Where the launch refuses Ulysses at every degree (here ZeRO-3 without reduce_scatter) the
    lever suggests none and says why (tests/model/test_layout_rules.py has the rules)."""
    preset, zero, cap = get_preset("7b"), zero_from("zero3_bf16.json"), int(79.65 * GiB)
    for setup, setting, note in [
        (zero, "--set ds.sequence_parallel_size=4", ""),
        (dataclasses.replace(zero, reduce_scatter=False), None, "needs zero_optimization"),
    ]:
        found = memory_levers.levers(preset, setup, work(32768), capacity=cap, runtime_bytes=GiB)
        (sp,) = [lever for lever in found if lever.name == "sequence parallel"]
        assert sp.setting == setting and note in sp.note


def test_cli_and_forecast_read_sp(tmp_path, capsys):
    """``--sp 4``, and ``sequence_parallel_size`` in a run's resolved ds_config (its
    config.json), give the same estimate; the launcher's forecast reads the key too."""
    ds = load_ds_config(find_ds_config("zero3_bf16.json"))
    run = tmp_path / "config.json"
    preset = dataclasses.asdict(get_preset("7b"))
    run.write_text(json.dumps({"model": preset, "ds_config": {**ds, "sequence_parallel_size": 4}}))
    docs = {}
    for key, argv in (("flag", ["--model", "7b", "--sp", "4"]), ("run", ["--model", str(run)])):
        assert cli.main(["estimate", *argv, "--seq", "32768", "--micro-batch", "1", "--json"]) == 0
        docs[key] = json.loads(capsys.readouterr().out)
    expect = memory.estimate(get_preset("7b"), zero_from("zero3_bf16.json"), work(32768, sp=4))
    assert docs["flag"]["sp"] == docs["run"]["sp"] == 4
    assert docs["flag"]["total"] == docs["run"]["total"] == expect.total
    assert cli.main(["estimate", "--model", "7b", "--seq", "32768", "--sp", "4"]) == 0
    assert "32768 tokens (sequence-parallel 4: 8192 a GPU)" in capsys.readouterr().out
    assert cli.main(["estimate", "--model", "7b", "--sp", "3"]) != 0
    assert "groups of 3" in capsys.readouterr().err
    ds = {**ds, "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1}
    kw = dict(
        preset=dataclasses.replace(get_preset("7b"), seq_len=32768),
        tokens_per_step=4 * 32768,  # train_batch_size x seq_len
        world_size=8,
        max_steps=10,
        start_step=0,
        mfu=0.4,
        peak_flops=1e15,
    )
    plain = forecast.make(ds_config=ds, **kw).memory_bytes_per_gpu
    split = forecast.make(ds_config={**ds, "sequence_parallel_size": 4}, **kw)
    assert split.memory_bytes_per_gpu == expect.total < plain


# ---------------------------------------------------------------------------------------------
# CPU: the estimate against the measured peak RSS of a real TP=2 run.

SMALLEST = [  # tests/planning/test_memory.py's, with two heads to split
    "model.hidden_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "model.seq_len=32",
    "ds.train_micro_batch_size_per_gpu=1",
]
MEASURED = [  # tests/planning/test_memory.py's
    "model.hidden_size=768",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=12",
    "model.intermediate_size=2048",
    "model.seq_len=256",
    "ds.train_micro_batch_size_per_gpu=4",
]


def peak_rss_of_a_rank(out: Path, data: Path, sets: list[str], *, ranks: int = 2) -> int:
    """Peak RSS in bytes of the largest process of a 2-step launch of ``ranks`` ranks: the
    kernel's rusage of the deepspeed runner, which takes in its waited-for descendants (the
    ranks), so ``ru_maxrss`` is the largest one's. glibc's mmap threshold is fixed at 128 KiB
    (``MALLOC_MMAP_THRESHOLD_``, as bench/bench_sp.py runs): every block of 128 KiB or more is
    its own mapping, returned when freed, so the RSS follows the live tensors."""
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port())]
    cmd += ["recipes/pretrain_tiny.py", "--out", str(out), "--data", str(data)]
    cmd += ["--max-steps", "2", "--val-every", "0", "--resume", "none"]
    for s in [
        "ds.gradient_accumulation_steps=1",
        "ds.scheduler.params.warmup_num_steps=1",
        "train.val_samples=1",
        "train.loss=plain",
        *sets,
    ]:
        cmd += ["--set", s]
    log = out.parent / f"{out.name}.log"  # a file, not a pipe: nobody reads during wait4
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "131072",
    }
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=stderr, stderr=stderr, start_new_session=True
        )
    return wait_peak_rss(proc, log)


@pytest.mark.alone
@pytest.mark.slow
def test_estimate_matches_measured_peak_rss_under_tp2_and_sp2(tmp_path, stdlib_data):
    """Slow (three launches of 2 ranks at once, 72-102 s on 2 cores shared with four other
    workers; the one check of the estimate against a real run for each layout): fp32 ZeRO-3 on
    2 CPU processes. The peak RSS of a rank of the measured shape at TP=2 and at SP=2, less that
    of the smallest run at TP=2 (Python, torch, DeepSpeed, gloo), against the estimate's
    ``total`` difference: the peak per GPU that ``anneal estimate`` prints, where the phases
    reuse each other's freed memory. With glibc's mmap threshold fixed (``peak_rss_of_a_rank``)
    freed tensors leave the RSS as they leave a GPU's caching allocator, and the peaks are
    reproducible: measured 2026-12-02 three times each (serially, on a shared machine): the base
    501.3-501.5 MiB, TP=2 1291.7-1291.8 (a difference of 790 MiB against 897 estimated, 0.88),
    SP=2 1475.4-1475.5 (974 against 881, 1.11).

    With the threshold left to glibc (its default raises the threshold as mapped blocks are
    freed, so what it keeps depends on the order of frees across threads) the same TP=2
    difference read 1246, 1261, 1182 and, in a CI run, 921 MiB against the 1245 of
    ``total_stacked`` (0.74-1.01): too loose to test. tests/planning/test_memory.py keeps glibc's
    default
    for one process, where the spread is 0.97-1.12. Marked ``alone``: beside another test session
    (``make test-all``'s other shard) the TP=2 difference read 492 MiB, so the peaks are measured
    on a quiet machine."""
    from concurrent.futures import ThreadPoolExecutor

    tp2, sp2 = "ds.tensor_parallel.autotp_size=2", "ds.sequence_parallel_size=2"
    jobs = {"base": [*SMALLEST, tp2], "tp2": [*MEASURED, tp2], "sp2": [*MEASURED, sp2]}
    with ThreadPoolExecutor(3) as pool:
        rss = dict(
            zip(
                jobs,
                pool.map(lambda k: peak_rss_of_a_rank(tmp_path / k, stdlib_data, jobs[k]), jobs),
                strict=True,
            )
        )
    base = estimate_for(SMALLEST, n_gpus=2, tp=2).total
    for name, layout in (("tp2", dict(tp=2)), ("sp2", dict(sp=2))):
        measured = rss[name] - rss["base"]
        expected = estimate_for(MEASURED, n_gpus=2, **layout).total - base
        print(f"{name}: measured {measured / 2**20:.0f} MiB, estimated {expected / 2**20:.0f} MiB")
        assert 0.75 <= measured / expected <= 1.20, name
