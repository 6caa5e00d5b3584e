"""The per-GPU memory estimator (anneal/planning/memory.py, `anneal estimate`).

Proves the ZeRO model-state formulas (stage 1 4P+12P/n, stage 2 2P+14P/n, stage 3 16P/n,
offload), agreement with DeepSpeed's own estimators where both count the same thing, the
activation accounting against Korthikanti et al.'s published formula, the loss's logits (plain,
and chunked in closed form), that each suggested lever really fits (and is the largest value
that does; the chunked loss first under the plain one), clear errors for bad input, and, on
CPU, the estimate against the measured peak RSS of real training runs. Tensor parallelism
(memory_tp.py): TP=1 unchanged bit for bit, the sharded model states and Korthikanti's
activation terms divided by t in closed form, the gathered logits, bad layouts, the TP lever,
`--tp` and a ds_config's autotp_size, and the launcher's forecast under TP.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from anneal import cli
from anneal.errors import UserError
from anneal.model import build_model, count_params, get_preset
from anneal.planning import forecast, memory, memory_io, memory_levers, memory_tp
from anneal.planning.memory import GiB
from anneal.resolution.ds import find_ds_config, load_ds_config
from anneal.run_record import RunRecord
from tests.conftest import kill_tree

REPO = Path(__file__).resolve().parents[2]
P7B = count_params(get_preset("7b"))


def zero_from(name: str) -> memory.ZeroSetup:
    return memory.ZeroSetup.from_ds_config(load_ds_config(find_ds_config(name)))


def work(n_gpus: int, **kw) -> memory.Workload:
    return memory.Workload(micro_batch=kw.pop("micro_batch", 1), seq_len=4096, n_gpus=n_gpus, **kw)


def test_7b_on_64_gpus_with_zero3_is_16p_over_64():
    est = memory.estimate(get_preset("7b"), zero_from("zero3_bf16.json"), work(64))
    assert est.model_state == pytest.approx(16 * P7B / 64, abs=3)
    assert (est.params, est.grads, est.optimizer) == pytest.approx(
        (2 * P7B / 64, 2 * P7B / 64, 12 * P7B / 64), abs=1
    )


@pytest.mark.parametrize(
    ("stage", "bytes_per_gpu"),
    [
        (0, lambda p, n: 16 * p),
        (1, lambda p, n: 4 * p + 12 * p / n),
        (2, lambda p, n: 2 * p + 14 * p / n),
        (3, lambda p, n: 16 * p / n),
    ],
)
@pytest.mark.parametrize("n", [1, 8, 512])
def test_model_states_by_zero_stage(stage, bytes_per_gpu, n):
    est = memory.estimate(get_preset("1b"), memory.ZeroSetup(stage=stage), work(n))
    p = count_params(get_preset("1b"))
    assert est.model_state == pytest.approx(bytes_per_gpu(p, n), abs=3)


def test_offload_moves_the_optimizer_state_to_the_host():
    est = memory.estimate(get_preset("7b"), zero_from("zero3_offload_bf16.json"), work(8))
    assert est.optimizer == 0 and est.model_state == pytest.approx(4 * P7B / 8, abs=2)
    assert est.host_bytes == pytest.approx(16 * P7B / 8, abs=2)  # 12P/n + the fp32 gradients
    assert "fp32 gradient partition" not in est.step_buffers
    both = dataclasses.replace(zero_from("zero3_offload_bf16.json"), offload_param=True)
    est = memory.estimate(get_preset("7b"), both, work(8))
    assert est.model_state == pytest.approx(2 * P7B / 8, abs=2)  # gradients only


def test_parameter_counts_match_the_real_model_and_deepspeeds_largest_layer():
    from deepspeed.runtime.zero.stage3 import model_to_params

    for name in ("tiny", "7b"):
        preset = get_preset(name)
        with torch.device("meta"):
            model = build_model(preset)
        assert count_params(preset) == sum(p.numel() for p in model.parameters())
        # (meta tensors share data_ptr 0, so only DeepSpeed's largest-layer count is usable)
        assert memory_tp.largest_layer_params(preset) == model_to_params(model)[1]


@pytest.mark.parametrize("nodes", [1, 8])
def test_zero2_model_states_plus_fp32_gradients_match_deepspeeds_estimate(nodes):
    """DeepSpeed budgets 2P + 18P/n: its 18 itemises 2 (16-bit grads) + 4 (fp32 grads) + 4
    (fp32 weights) + 8 (Adam), so it equals our model states plus our fp32 gradient copy."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    n = nodes * 8
    est = memory.estimate(get_preset("7b"), zero_from("zero2_bf16.json"), work(n))
    _, ds_gpu = estimate_zero2_model_states_mem_needs(
        total_params=P7B, num_gpus_per_node=8, num_nodes=nodes, cpu_offload=False
    )
    ours = est.model_state + est.step_buffers["fp32 gradient partition"]
    assert ours == pytest.approx(ds_gpu, abs=8)


def test_zero3_against_deepspeeds_printed_estimate(capsys):
    """`estimate_zero3_model_states_mem_needs_all_cold` prints 18P/n + 4 x largest layer per
    GPU. Ours is 16P/n of model states; DeepSpeed's extra 2P/n is (part of) the fp32 gradient
    copy we count at the optimizer step, and its 4L bytes the gathered-weights buffer."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold

    preset = get_preset("7b")
    big = memory_tp.largest_layer_params(preset)
    estimate_zero3_model_states_mem_needs_all_cold(
        total_params=P7B, largest_layer_params=big, num_gpus_per_node=8, num_nodes=8
    )
    table = capsys.readouterr().out
    row = re.search(
        r"([\d.]+)GB \|\s+([\d.]+)GB \| offload_param=none, offload_optimizer=none, "
        r"zero_init=1",
        table,
    )
    ds_gpu = float(row.group(2)) * 2**30  # DeepSpeed's "GB" is GiB, printed to 0.01
    est = memory.estimate(preset, zero_from("zero3_bf16.json"), work(64))
    assert est.model_state + 2 * P7B / 64 + 4 * big == pytest.approx(ds_gpu, abs=0.006 * 2**30)
    assert (
        est.model_state
        < ds_gpu
        < est.model_state
        + est.step_buffers["fp32 gradient partition"]
        + est.buffers["gathered weights"]
        + 4 * big
    )


@pytest.mark.parametrize("nodes", [1, 4])
def test_zero3_offload_host_memory_matches_deepspeed(nodes):
    """DeepSpeed's host figure per node with offloaded optimizer (zero_init, no buffer factor)
    is 16P/nodes: our 12P/n of optimizer state + 4P/n of fp32 gradients per GPU, times 8."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    preset = get_preset("7b")
    ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
        total_params=P7B,
        largest_layer_params=memory_tp.largest_layer_params(preset),
        num_gpus_per_node=8,
        num_nodes=nodes,
        cpu_offload=True,
        cpu_offload_params=False,
        zero_init=True,
        additional_buffer_factor=1.0,
    )
    est = memory.estimate(preset, zero_from("zero3_offload_bf16.json"), work(8 * nodes))
    assert est.host_bytes * 8 == pytest.approx(ds_cpu, abs=16)
    # On the GPU DeepSpeed counts the 16-bit weights (2P/n) and one gathered layer (4L);
    # we also keep the 16-bit gradient partition there until it is copied out.
    assert est.params == pytest.approx(ds_gpu - 4 * memory_tp.largest_layer_params(preset), abs=2)


def test_activation_accounting_reproduces_korthikanti_and_counts_llama():
    s, b, h, a = 2048, 2, 4096, 32
    gpt = memory.saved_tensors(
        s=s, b=b, h=h, f=4 * h, a=a, kv=h, bf16=True, eager=True, block="gpt"
    )
    assert sum(n for _, n in gpt) == s * b * h * (34 + 5 * a * s / h)  # their eq. 1

    preset = get_preset("7b")
    w = memory.Workload(micro_batch=b, seq_len=s, n_gpus=8)
    f = preset.intermediate_size
    llama = memory.layer_activation_bytes(preset, w, bf16=True)
    # 2 RMSNorms x 6 + (q, k, v, SDPA output, projection input) x 2 + SwiGLU 4 x 2 f/h
    assert llama == s * b * h * (22 + 8 * f / h)
    eager = memory.layer_activation_bytes(
        preset, dataclasses.replace(w, eager_attention=True), bf16=True
    )
    assert eager - llama == s * b * (6 * a * s - 2 * h)  # + fp32/bf16 scores - SDPA output
    est = memory.estimate(preset, memory.ZeroSetup(stage=3), w)
    assert est.activations == preset.num_hidden_layers * llama
    ckpt = memory.estimate(
        preset, memory.ZeroSetup(stage=3), dataclasses.replace(w, activation_checkpointing=True)
    )
    assert ckpt.activations == preset.num_hidden_layers * 2 * s * b * h + llama


def test_levers_fit_and_are_the_largest_that_do():
    preset, zero = get_preset("7b"), zero_from("zero1_bf16.json")
    w = memory.Workload(micro_batch=8, seq_len=4096, n_gpus=8)
    capacity = 80 * 2**30
    assert memory.estimate(preset, zero, w, capacity=capacity).fits is False
    found = memory_levers.levers(preset, zero, w, capacity=capacity, runtime_bytes=memory.GiB)
    names = [
        "micro-batch",
        "context length",
        "tensor parallel",
        "sequence parallel",  # ZeRO-1: no (Anneal runs Ulysses with ZeRO-2 and 3)
        "layers",
        "width",
    ]
    assert [lever.name for lever in found] == names
    by_name = {lever.name: lever for lever in found}

    def total(p, wk):
        return memory.estimate(p, zero, wk, capacity=capacity).total

    b = int(re.search(r"per_gpu (\d+)", by_name["micro-batch"].setting).group(1))
    assert total(preset, dataclasses.replace(w, micro_batch=b)) <= capacity
    assert total(preset, dataclasses.replace(w, micro_batch=b + 1)) > capacity
    t = int(by_name["context length"].setting.split("=")[1])
    assert total(preset, dataclasses.replace(w, seq_len=t)) <= capacity
    assert total(preset, dataclasses.replace(w, seq_len=t + 128)) > capacity
    n_layers = int(by_name["layers"].setting.split("=")[1])
    assert total(dataclasses.replace(preset, num_hidden_layers=n_layers), w) <= capacity
    assert total(dataclasses.replace(preset, num_hidden_layers=n_layers + 1), w) > capacity
    assert by_name["width"].total <= capacity


def test_chunked_loss_holds_one_chunk_and_two_gradients():
    """The loss's figure in closed form. plain: 4 fp32 (tokens x V) tensors, plus a 16-bit cast
    under bf16 (8.79 GiB for the 7b recipe at micro-batch 4 x 4096). chunked: one chunk's fp32
    logits and their log-softmax, the hidden states' gradient and the head weight's (in fp32,
    and under bf16 a chunk's 16-bit product); a chunk larger than the tokens is all of them.
    The defaults are the run config's."""
    from anneal.config.run import TrainConfig

    p7 = get_preset("7b")
    w = memory.Workload(micro_batch=4, seq_len=4096, n_gpus=8)
    assert (w.loss, w.loss_chunk_tokens) == (TrainConfig.loss, TrainConfig.loss_chunk_tokens)
    plain = memory.logits_bytes(p7, dataclasses.replace(w, loss="plain"), bf16=True)
    assert plain == 4 * 4096 * 32000 * (4 * 4 + 2)
    assert round(plain / memory.GiB, 2) == 8.79
    for bf16, value, head in ((True, 2, 6), (False, 4, 4)):
        expected = 8 * 512 * 32000 + 4 * 4096 * 4096 * value + 32000 * 4096 * head
        assert memory.logits_bytes(p7, w, bf16=bf16) == expected
    short = memory.Workload(micro_batch=2, seq_len=256, n_gpus=1, loss_chunk_tokens=4096)
    assert memory.logits_bytes(p7, short, bf16=False) == 8 * 512 * 32000 + (512 + 32000) * 4096 * 4
    assert memory.logits_bytes(p7, w, bf16=True) * 8 < plain  # 0.98 GiB


def test_levers_suggest_the_chunked_loss_under_the_plain_one():
    """Under train.loss=plain the first lever is the chunked loss, with the estimate it gives
    (here enough alone); under the chunked loss there is no such lever."""
    preset, zero = get_preset("1b"), zero_from("zero3_bf16.json")
    plain = memory.Workload(micro_batch=8, seq_len=4096, n_gpus=8, loss="plain")
    chunked = dataclasses.replace(plain, loss="chunked")
    with_plain = memory.estimate(preset, zero, plain).total
    with_chunked = memory.estimate(preset, zero, chunked).total
    capacity = (with_plain + with_chunked) // 2
    found = memory_levers.levers(preset, zero, plain, capacity=capacity, runtime_bytes=memory.GiB)
    assert found[0].name == "chunked loss" and found[0].total == with_chunked
    assert found[0].setting.startswith("train.loss=chunked")
    names = [
        lever.name
        for lever in memory_levers.levers(
            preset, zero, chunked, capacity=with_chunked - 1, runtime_bytes=memory.GiB
        )
    ]
    assert "chunked loss" not in names
    text = memory_io.format_estimate(
        memory.estimate(preset, zero, plain, capacity=capacity),
        preset=preset,
        zero=zero,
        work=plain,
        capacity_name="x",
        lever_list=found,
    )
    assert "loss plain (full logits)" in text and "chunked loss    train.loss=chunked" in text


def test_a_runs_loss_is_read_from_its_config(tmp_path):
    """``anneal estimate --model RUN/config.json`` counts the loss that run trained with."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"run": {"train": {"loss": "plain", "loss_chunk_tokens": 64}}}))
    assert RunRecord.lenient(config).loss_settings == {"loss": "plain", "loss_chunk_tokens": 64}
    config.write_text(json.dumps({"run": [], "model": {}}))
    assert RunRecord.lenient(config).loss_settings == {}
    assert memory_io.load_model("7b")[1] is None


def test_estimate_reads_a_runs_config_once(tmp_path, capsys, monkeypatch):
    """``anneal estimate --model RUN/config.json`` reads the file once, and takes from that one
    reading the run's model, its resolved ds_config and its loss (it had parsed it three
    times: once for each)."""
    ds = load_ds_config(find_ds_config("zero3_bf16.json"))
    run = tmp_path / "config.json"
    doc = {"run": {"train": {"loss": "plain"}}, "ds_config": ds}
    run.write_text(json.dumps({**doc, "model": dataclasses.asdict(get_preset("7b"))}))
    reads, read_text = [], Path.read_text

    def counted(self, *args, **kwargs):
        reads.append(self)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    assert cli.main(["estimate", "--model", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert reads.count(run) == 1
    assert (out["loss"], out["zero_stage"], out["param_count"]) == ("plain", 3, P7B)


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_estimate_json_and_text(capsys):
    argv = ["estimate", "--model", "7b", "--ds-config", "zero3_bf16.json", "--nodes", "8"]
    code, out, _ = run_cli(capsys, *argv, "--activation-checkpointing", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["model_state"] == pytest.approx(16 * P7B / 64, abs=3)
    assert doc["n_gpus"] == 64 and doc["fits"] is True and doc["levers"] == []
    code, out, _ = run_cli(
        capsys, "estimate", "--model", "7b", "--ds-config", "zero1_bf16.json", "--micro-batch", "8"
    )
    assert code == 0 and "does NOT fit in H100" in out and "micro-batch" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "7b", "--gpu", "tpu"], "--gpu tpu: unknown GPU"),
        (["--model", "13b"], "--model 13b: neither a preset"),
        (["--model", "7b", "--micro-batch", "0"], "--micro-batch 0: must be at least 1"),
        (["--model", "7b", "--nodes", "0"], "must be at least 1"),
        (["--model", "7b", "--ds-config", "nope.json"], "--ds-config nope.json: no such file"),
        (["--model", "7b", "--gpu-mem-gib", "0"], "--gpu-mem-gib 0.0: must be positive"),
    ],
)
def test_bad_estimate_input_is_a_clear_error(capsys, argv, message):
    code, out, err = run_cli(capsys, "estimate", *argv)
    assert code == 2 and message in err


def test_model_file_that_is_not_a_model(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64}))
    code, _, err = run_cli(capsys, "estimate", "--model", str(path))
    assert code == 2 and "no integer intermediate_size" in err
    hf = {
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "vocab_size": 8192,
        "max_position_embeddings": 256,
    }
    path.write_text(json.dumps(hf))
    preset, record = memory_io.load_model(str(path))
    assert record is None
    assert (preset.seq_len, preset.vocab_size, count_params(preset)) == (256, 8192, 1147712)


# ---------------------------------------------------------------------------------------------
# CPU: the estimate against the measured peak RSS of real runs.

SMALLEST = [
    "model.hidden_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=1",
    "model.intermediate_size=64",
    "model.seq_len=32",
    "ds.train_micro_batch_size_per_gpu=1",
    "train.loss=plain",
]
MEASURED = [
    "model.hidden_size=768",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=12",
    "model.intermediate_size=2048",
    "model.seq_len=256",
    "ds.train_micro_batch_size_per_gpu=4",
    "train.loss=plain",
]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def peak_rss(out: Path, data: Path, sets: list[str]) -> int:
    """Peak RSS in bytes of a 2-step recipe run (one process), from the kernel's rusage."""
    cmd = [
        sys.executable,
        "recipes/pretrain_tiny.py",
        "--out",
        str(out),
        "--data",
        str(data),
        "--max-steps",
        "2",
        "--val-every",
        "0",
        "--resume",
        "none",
        "--set",
        "ds.gradient_accumulation_steps=1",
        "--set",
        "ds.scheduler.params.warmup_num_steps=1",
        "--set",
        "train.val_samples=1",
    ]
    for s in sets:
        cmd += ["--set", s]
    log = out.parent / f"{out.name}.log"  # a file, not a pipe: nobody reads during wait4
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    return wait_peak_rss(proc, log)


def wait_peak_rss(proc: subprocess.Popen, log: Path) -> int:
    """Peak RSS in bytes of ``proc`` and its waited-for descendants (the kernel's rusage; the
    largest one's), once it has exited 0; killed with its session after 300 s."""
    watchdog = threading.Timer(300, kill_tree, [proc])  # a hang fails the status check below
    watchdog.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        watchdog.cancel()
    assert status == 0, log.read_text()[-3000:]
    return usage.ru_maxrss * 1024  # KiB on Linux


def estimate_for(sets: list[str], *, n_gpus: int = 1, tp: int = 1, sp: int = 1):
    """The estimate of the measured shape in ``sets`` (the run's --set items), without the
    runtime allowance; the loss from ``train.loss`` (plain if not given), the optimizer from
    ``optim.optimizer`` (AdamW if not given)."""
    kv = dict(s.split("=") for s in sets)
    preset = dataclasses.replace(
        get_preset("tiny"),
        **{
            k.split(".")[1]: int(v)
            for k, v in kv.items()
            if k.startswith("model.") and k != "model.seq_len"
        },
    )
    preset = dataclasses.replace(preset, num_key_value_heads=preset.num_attention_heads)
    w = memory.Workload(
        micro_batch=int(kv["ds.train_micro_batch_size_per_gpu"]),
        seq_len=int(kv["model.seq_len"]),
        n_gpus=n_gpus,
        tp=tp,
        sp=sp,
        loss=kv.get("train.loss", "plain"),
    )
    zero = dataclasses.replace(zero_from("cpu.json"), muon=kv.get("optim.optimizer") == "muon")
    return memory.estimate(preset, zero, w, runtime_bytes=0)


@pytest.mark.alone
@pytest.mark.slow
def test_estimate_matches_measured_peak_rss_on_cpu(tmp_path, stdlib_data):
    """fp32 ZeRO-3 on one CPU process (ds_configs/cpu.json). The runtime (Python, torch,
    DeepSpeed) is taken as the peak RSS of the smallest possible run and subtracted. Host
    memory comes from glibc, which keeps small freed blocks, so the comparison is with
    ``total_stacked``; measured/estimated was 0.97-1.12 over five shapes (docs/planning.md).
    With the plain loss, as those shapes were measured: with the chunked one the measured peak
    read 2005 MiB under load and 1662 MiB on a quiet machine against 1984 estimated, a spread
    this check cannot hold yet. The lower bound is 0.75: inside a full CI session the same run
    (plain loss, same code) read 1669 MiB against 1908 MiB run alone (2053 estimated, 2026-12-02);
    the cause is not found yet, and 0.75 still fails an estimate that is a third too high.
    Muon (``optim.optimizer=muon``, issue 42) at the same shape is held to the same bounds, with
    the same runtime subtracted: its half of the parameters keeps one fp32 buffer where AdamW's
    keeps two (108 MiB less estimated here). Measured 2026-12-07 under load: 1751 MiB against
    1945 (0.90), AdamW 1969 against 2053 (0.96). The bounds are loose: an estimate that ignored
    Muon would read 0.85 and pass too; tests/train/test_muon_layouts.py checks Muon's optimizer
    bytes exactly against the checkpoint's files. One launch more than AdamW alone (about 30 s)."""
    base = peak_rss(tmp_path / "base", stdlib_data, SMALLEST)
    ratios = {}
    for name, sets in (("adamw", MEASURED), ("muon", [*MEASURED, "optim.optimizer=muon"])):
        measured = peak_rss(tmp_path / name, stdlib_data, sets) - base
        expected = estimate_for(sets).total_stacked - estimate_for(SMALLEST).total_stacked
        print(f"{name}: measured {measured / 2**20:.0f} MiB, estimated {expected / 2**20:.0f} MiB")
        ratios[name] = measured / expected
    assert all(0.75 <= r <= 1.20 for r in ratios.values()), ratios


def test_cli_estimate_counts_the_loss(capsys):
    """--loss plain counts the full logits and suggests the chunked loss first."""
    code, out, _ = run_cli(
        capsys, "estimate", "--model", "7b", "--micro-batch", "4", "--loss", "plain", "--json"
    )
    doc = json.loads(out)
    assert code == 0 and doc["loss"] == "plain"
    assert doc["logits"] == 4 * 4096 * 32000 * 18
    assert doc["levers"][0]["name"] == "chunked loss"


# Tensor parallelism (anneal/planning/memory_tp.py): DeepSpeed AutoTP shards q, k, v, o, gate, up,
# down and the LM head over t ranks; embeddings and norms stay whole; ZeRO partitions over n / t.


def test_tp1_is_unchanged_bit_for_bit():
    """The 7b recipe's ZeRO-3 and ZeRO-2 totals at micro-batch 4 x 4096 on 8 GPUs, as the
    estimator printed them before it knew tensor parallelism (commit a4c8675)."""
    w = work(8, micro_batch=4)
    assert memory.estimate(get_preset("7b"), zero_from("zero3_bf16.json"), w).total == 109579977472
    assert memory.estimate(get_preset("7b"), zero_from("zero2_bf16.json"), w).total == 121010060800
    assert memory.estimate(get_preset("7b"), zero_from("zero3_bf16.json"), w) == memory.estimate(
        get_preset("7b"), zero_from("zero3_bf16.json"), dataclasses.replace(w, tp=1)
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tp2_halves_the_sharded_model_states(stage):
    """Closed form from the shapes: per layer q, o (h x h), k, v (h x kv), gate, up, down (h x f),
    and the LM head (V x h) are sharded; the embedding and the norms are not. Then ZeRO's
    formula over the data-parallel group of 8 / 2 = 4."""
    preset, n, t = get_preset("7b"), 8, 2
    h, f, v = preset.hidden_size, preset.intermediate_size, preset.vocab_size
    kv = preset.num_key_value_heads * preset.head_dim
    sharded = preset.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * f) + v * h
    replicated = v * h + preset.num_hidden_layers * 2 * h + h  # embedding, norms, final norm
    assert sharded + replicated == P7B
    p_gpu = replicated + sharded // t
    dp = n // t
    zero = dataclasses.replace(zero_from("zero3_bf16.json"), stage=stage)
    est = memory.estimate(preset, zero, work(n, tp=t))
    assert est.params == int(2 * p_gpu / (dp if stage == 3 else 1))
    assert est.grads == int(2 * p_gpu / (dp if stage >= 2 else 1))
    assert est.optimizer == int(12 * p_gpu / (dp if stage >= 1 else 1))


def test_tp_divides_the_sharded_activations_as_korthikanti():
    """GPT block: s b h (10 + 24/t + 5 a s / (h t)) (Korthikanti et al. 2022, Table 2, tensor
    parallel without sequence parallel). Llama block: only the two RMSNorms' saved tensors
    (6 + 6 bytes per s b h at bf16) stay whole; everything else halves at t = 2."""
    s, b, h, a = 2048, 1, 12288, 96
    for t in (1, 2, 4, 8):
        gpt = memory.saved_tensors(
            s=s, b=b, h=h, f=4 * h, a=a, kv=h, bf16=True, eager=True, block="gpt", t=t
        )
        assert sum(n for _, n in gpt) == pytest.approx(
            s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        )
    preset = get_preset("7b")
    w1, w2 = work(8, micro_batch=2), work(8, micro_batch=2, tp=2)
    one = memory.layer_activation_bytes(preset, w1, bf16=True)
    two = memory.layer_activation_bytes(preset, w2, bf16=True)
    norms = 2 * 6 * 4096 * 2 * preset.hidden_size
    assert two == norms + (one - norms) / 2
    assert memory.activation_bytes(preset, w2, bf16=True) == int(preset.num_hidden_layers * two)


def test_tp_counts_the_gathered_logits_with_the_plain_loss():
    """Under TP the LM head gathers its output and the loss falls back to plain: the full
    logits on every rank, whatever train.loss says."""
    preset, zero = get_preset("7b"), zero_from("zero3_bf16.json")
    plain = memory.estimate(preset, zero, work(8, micro_batch=4, loss="plain")).logits
    assert memory.estimate(preset, zero, work(8, micro_batch=4, tp=2)).logits == plain
    assert plain == 4 * 4096 * preset.vocab_size * 18


@pytest.mark.parametrize(
    ("n_gpus", "tp", "preset_changes", "message"),
    [
        (6, 4, {}, "do not split into tensor-parallel groups of 4"),
        (8, 8, {"num_attention_heads": 12, "num_key_value_heads": 4}, "num_attention_heads 12"),
        (8, 8, {"num_key_value_heads": 4}, "num_key_value_heads 4"),
        (8, 0, {}, "at least 1"),
    ],
)
def test_bad_tensor_parallel_layout_is_one_clear_error(n_gpus, tp, preset_changes, message):
    preset = dataclasses.replace(get_preset("7b"), **preset_changes)
    with pytest.raises(UserError, match=message):
        memory.estimate(preset, zero_from("zero3_bf16.json"), work(n_gpus, tp=tp))


def test_levers_suggest_the_smallest_tensor_parallel_degree_that_fits():
    """7b at micro-batch 4 x 4096 on 8 GPUs: a capacity between the TP=4 and TP=2 totals makes
    the lever TP=4 (TP=2 does not fit), and its total is the estimate at TP=4."""
    preset, zero = get_preset("7b"), zero_from("zero3_bf16.json")
    totals = {
        t: memory.estimate(preset, zero, work(8, micro_batch=4, tp=t)).total for t in (1, 2, 4)
    }
    assert totals[1] > totals[2] > totals[4]
    cap = (totals[2] + totals[4]) // 2
    found = memory_levers.levers(
        preset, zero, work(8, micro_batch=4), capacity=cap, runtime_bytes=GiB
    )
    (tp,) = [lever for lever in found if lever.name == "tensor parallel"]
    assert tp.setting == "--set ds.tensor_parallel.autotp_size=4" and tp.total == totals[4]
    names = [lever.name for lever in found]
    assert names.index("context length") < names.index("tensor parallel") < names.index("layers")
    tight = memory_levers.levers(
        preset, zero, work(8, micro_batch=4), capacity=GiB, runtime_bytes=GiB
    )
    (none,) = [lever for lever in tight if lever.name == "tensor parallel"]
    assert none.setting is None and "2, 4, 8 does not fit" in none.note


def test_cli_estimate_reads_tp_from_the_flag_and_the_ds_config(tmp_path, capsys):
    ds = load_ds_config(find_ds_config("zero3_bf16.json"))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ds, "tensor_parallel": {"autotp_size": 2}}))
    run = tmp_path / "config.json"  # a run's: its model and resolved ds_config
    preset = dataclasses.asdict(get_preset("7b"))
    run.write_text(json.dumps({"model": preset, "ds_config": json.loads(path.read_text())}))
    runs = {}
    for key, extra in (("flag", ["--tp", "2"]), ("ds", ["--ds-config", str(path)]), ("one", [])):
        assert cli.main(["estimate", "--model", "7b", "--seq", "4096", "--json", *extra]) == 0
        runs[key] = json.loads(capsys.readouterr().out)
    assert cli.main(["estimate", "--model", str(run), "--seq", "4096", "--json"]) == 0
    runs["run"] = json.loads(capsys.readouterr().out)
    assert runs["flag"]["tp"] == runs["ds"]["tp"] == runs["run"]["tp"] == 2
    assert runs["one"]["tp"] == 1 and runs["run"]["total"] == runs["ds"]["total"]
    expect = memory.estimate(
        get_preset("7b"),
        zero_from("zero3_bf16.json"),
        work(8, micro_batch=runs["one"]["micro_batch"], tp=2),
    )
    assert runs["flag"]["total"] == runs["ds"]["total"] == expect.total < runs["one"]["total"]
    assert cli.main(["estimate", "--model", "7b", "--tp", "2"]) == 0
    assert "tensor-parallel 2 x ZeRO stage 3 over 4 GPUs" in capsys.readouterr().out
    assert cli.main(["estimate", "--model", "7b", "--tp", "3"]) != 0
    assert "groups of 3" in capsys.readouterr().err


def test_forecast_per_gpu_is_lower_under_tp():
    """The launcher's pre-flight forecast (anneal/planning/forecast.make, given the launch's
    ds_config) reads tensor_parallel.autotp_size: the 7b recipe's shape on 8 GPUs."""
    ds = {
        **load_ds_config(find_ds_config("zero3_bf16.json")),
        "train_batch_size": 32,  # as the launch resolves them
        "train_micro_batch_size_per_gpu": 4,
    }
    kw = dict(
        preset=get_preset("7b"),
        tokens_per_step=32 * get_preset("7b").seq_len,
        world_size=8,
        max_steps=10,
        start_step=0,
        mfu=0.4,
        peak_flops=1e15,
    )
    one = forecast.make(ds_config=ds, **kw).memory_bytes_per_gpu
    two = forecast.make(
        ds_config={**ds, "tensor_parallel": {"autotp_size": 2}}, **kw
    ).memory_bytes_per_gpu
    assert two < one
    assert (
        two
        == memory.estimate(
            get_preset("7b"),
            memory.ZeroSetup.from_ds_config(ds),
            memory.Workload(
                micro_batch=ds["train_micro_batch_size_per_gpu"],
                seq_len=get_preset("7b").seq_len,
                n_gpus=8,
                tp=2,
            ),
        ).total
    )


def test_preflight_forecast_of_a_tp2_launch_is_below_tp1(tiny_data, tmp_path):
    """The launcher's pre-flight (launcher/preflight.py) forecasts through forecast.make with the
    launch's resolved ds_config, and sizes the checkpoint for its disk check by the layout: 2 CPU
    ranks of the tiny recipe, with and without --set ds.tensor_parallel.autotp_size=2."""
    from launcher.preflight import preflight

    def launch(*extra: str):
        args = ["--out", str(tmp_path / "run"), "--data", str(tiny_data), "--max-steps", "10"]
        return preflight(
            recipe="recipes/pretrain_tiny.py",
            recipe_args=[*args, *extra],
            world_size=2,
            device_type="cpu",
            mfu=None,
        )

    one, two = launch(), launch("--set", "ds.tensor_parallel.autotp_size=2")
    assert two.forecast.memory_bytes_per_gpu < one.forecast.memory_bytes_per_gpu
    # The checkpoint the disk check budgets (fp32 on CPU: 4-byte weights + 12 of Adam): each
    # rank of the TP group saves the replicated parameters again beside its slices.
    tiny = one.launch.preset  # the tiny shape at the data's vocabulary
    assert one.checkpoint_bytes == 16 * count_params(tiny)
    assert two.checkpoint_bytes == 16 * 2 * memory_tp.params_per_gpu(tiny, 2) > one.checkpoint_bytes
