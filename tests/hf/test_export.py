"""Hugging Face export: a real 2-rank ZeRO-3 checkpoint (deepspeed runner, tiny shapes) exported
by `anneal export` loads with transformers' Auto classes and reproduces the checkpoint's logits
(checked here against DeepSpeed's own zero_to_fp32, independently of the export's own check,
whose weights_only reader gives exactly zero_to_fp32's weights at ZeRO-1, 2 and 3); the files
are safetensors and JSON only; a tampered export fails verification loudly; --force replaces
only an earlier export; the bad inputs get clear messages (tests/hf/test_hostile_export.py has the
hostile ones); and the conversion's peak memory stays far below the model's size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, SMALL, env, run_process, run_recipe


def anneal(*args: str, check: bool = True, timeout_s: int = 300) -> subprocess.CompletedProcess:
    """``anneal ARGS`` as a process (the slow test's 120M-parameter export, whose memory is
    measured in a process of its own)."""
    return run_process(
        [sys.executable, "-m", "anneal.cli", *args],
        timeout_s=timeout_s,
        check=check,
        cwd=ROOT,
        env=env(),
    )


@pytest.fixture()
def cli(capsys):
    """``anneal ARGS`` run in this process through ``anneal.cli.main``, as the console script
    runs it: (exit code, stdout, stderr). A process start per command (3-5 s here, importing
    torch and transformers) bought these tests nothing; the entry point as a process is
    checked by tests/cli/test_cli.py and, for export, by ExportAfterSave's child below."""
    from anneal.cli import main

    def call(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        out, err = capsys.readouterr()
        if check:
            assert code == 0, f"anneal {' '.join(args)} failed ({code}):\n{out}\n{err}"
        return subprocess.CompletedProcess(args, code, out, err)

    return call


@pytest.fixture(scope="module")
def zero3_run(two_rank_run) -> Path:
    """The session's 2-rank ZeRO-3 run (tests/conftest.py: checkpoints at steps 1 and 2)."""
    return two_rank_run["out"]


def reference_logits(run: Path, tag: str, batch: torch.Tensor, dtype=None) -> torch.Tensor:
    """The training model with the weights DeepSpeed's own zero_to_fp32 consolidates."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from anneal import model as modellib
    from anneal.hf.source import preset_from_record
    from anneal.rundir import read_record

    preset = preset_from_record(read_record(run))
    sd = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"), tag=tag)
    if dtype is not None:
        sd = {k: v.to(dtype).float() for k, v in sd.items()}
    model = modellib.build_model(preset).eval()
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        return model(input_ids=batch).logits


def test_zero3_export_loads_in_transformers_and_matches_logits(zero3_run, tmp_path, cli):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    done = cli(
        "export",
        str(zero3_run),
        "--out",
        str(out),
        "--dtype",
        "fp32",
        "--shard-size",
        "100KB",
        "--json",
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["zero_stage"] == 3 and report["world_size"] == 2 and report["step"] == 2
    assert report["verify"]["max_abs_logit_diff"] <= report["verify"]["tolerance"]

    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in names
    for required in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert required in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    with safe_open(str(out / shards[0]), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys())

    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert model.config.eos_token_id == tok.eos_token_id is not None
    ids = tok("def main():\n    return 0\n", add_special_tokens=False)["input_ids"]
    batch = torch.tensor([ids, ids[::-1]])
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    torch.testing.assert_close(
        logits, reference_logits(zero3_run, "step00000002", batch), rtol=0, atol=1e-4
    )


def test_bf16_export_of_an_older_tag_and_the_out_dir_rules(zero3_run, tmp_path, cli):
    from safetensors import safe_open

    from anneal.errors import UserError
    from anneal.hf.export import export

    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("someone's file")
    refused = cli("export", str(zero3_run), "--out", str(out), check=False)
    assert refused.returncode == 2
    assert "exists and is not empty" in refused.stderr and "--force" in refused.stderr
    assert (out / "keep.txt").is_file()

    # --force replaces only an earlier export, never someone's directory
    with pytest.raises(UserError, match="not a model exported by anneal export"):
        export(zero3_run, out=out, tag="step00000001", force=True)
    assert (out / "keep.txt").read_text() == "someone's file"
    (out / "keep.txt").unlink()
    export(zero3_run, out=out, tag="step00000002", verify=False)
    report = export(zero3_run, out=out, tag="step00000001", force=True)
    assert report["step"] == 1 and report["files"] == ["model.safetensors"]
    v = report["verify"]
    assert v["max_abs_logit_diff"] <= v["tolerance"] and v["dtype_rounding_diff"] > 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_tampered_export_fails_verification(zero3_run, tmp_path):
    from safetensors.torch import load_file, save_file

    from anneal.hf.export import export
    from anneal.hf.source import preset_from_record
    from anneal.hf.verify import ExportMismatch, verify_export
    from anneal.rundir import read_record

    out = tmp_path / "hf"
    report = export(zero3_run, out=out, dtype="fp32", verify=False)
    weights = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name].flip(0).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    preset = preset_from_record(read_record(zero3_run))
    data = Path(json.loads((zero3_run / "config.json").read_text())["run"]["data"]["path"])
    with pytest.raises(ExportMismatch, match="do not ship it"):
        verify_export(
            out,
            tag_dir=Path(report["checkpoint"]),
            zero_stage=3,
            preset=preset,
            dtype="fp32",
            data_tokenizer=data,
        )


def test_verification_reader_matches_deepspeeds_consolidation(zero3_run):
    """The verification's own reader (torch.load with weights_only=True, zero_to_fp32's
    consolidation rewritten) gives exactly DeepSpeed's weights: it is a faithful reference."""
    assert_reference_matches_deepspeed(zero3_run / "checkpoints" / "step00000002", 3)


def assert_reference_matches_deepspeed(tag_dir: Path, stage: int) -> None:
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from anneal.hf.zero import reference_state_dict

    ours = reference_state_dict(tag_dir, stage)
    with contextlib.redirect_stdout(io.StringIO()):
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert torch.equal(ours[name], t.float()), name


def test_every_save_exports_each_checkpoint(zero3_run, tmp_path, cli):
    done = cli("export", str(zero3_run), "--every-save", "--out", str(tmp_path / "all"))
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == [
        "step00000001",
        "step00000002",
    ]
    assert done.stdout.count("verified") == 2


def test_bad_input_messages(zero3_run, tmp_path, cli):
    fresh = tmp_path / "fresh"
    (fresh / "checkpoints").mkdir(parents=True)
    (fresh / "config.json").write_text((zero3_run / "config.json").read_text())
    no_ckpt = cli("export", str(fresh), "--out", str(tmp_path / "a"), check=False)
    assert no_ckpt.returncode == 2 and "no intact checkpoint" in no_ckpt.stderr
    assert "Traceback" not in no_ckpt.stderr

    bad_tag = cli(
        "export", str(zero3_run), "--tag", "step99", "--out", str(tmp_path / "b"), check=False
    )
    assert bad_tag.returncode == 2
    assert "--tag step99: no such checkpoint" in bad_tag.stderr
    assert "step00000001, step00000002" in bad_tag.stderr

    not_a_run = cli("export", str(tmp_path), "--out", str(tmp_path / "c"), check=False)
    assert not_a_run.returncode == 2 and "no config.json" in not_a_run.stderr


@pytest.mark.slow
def test_export_peak_memory_is_far_below_model_size(stdlib_data, tmp_path):
    """A 120M-parameter model (456 MiB in fp32, largest tensor 32 MiB), one ZeRO-3 step on one
    rank: the conversion grows the process by well under a quarter of the model (measured here:
    80 MiB, about 2.5 largest tensors)."""
    run = tmp_path / "big"
    shapes = [
        "--set",
        "model.hidden_size=1024",
        "--set",
        "model.num_hidden_layers=8",
        "--set",
        "model.intermediate_size=2816",
        "--set",
        "model.num_attention_heads=16",
        "--set",
        "model.seq_len=64",
        "--set",
        "train.val_samples=4",
        "--set",
        "ds.train_micro_batch_size_per_gpu=1",
        "--set",
        "ds.gradient_accumulation_steps=1",
        "--set",
        "ds.scheduler.params.warmup_num_steps=1",
    ]
    run_recipe(
        ["--out", str(run), "--data", str(stdlib_data), "--max-steps", "1", *shapes],
        timeout_s=600,
    )
    done = anneal("export", str(run), "--out", str(tmp_path / "hf"), "--json", timeout_s=600)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    model, grew = r["model_bytes_fp32"], r["peak_rss_bytes"] - r["rss_before_bytes"]
    print(
        f"\nexport memory: model {model / 2**20:.0f} MiB fp32, largest tensor "
        f"{r['largest_tensor_bytes_fp32'] / 2**20:.0f} MiB, conversion grew RSS by "
        f"{grew / 2**20:.0f} MiB (peak {r['peak_rss_bytes'] / 2**20:.0f} MiB), "
        f"max |logit diff| {r['verify']['max_abs_logit_diff']:.3g}"
    )
    assert model > 400 * 2**20
    assert grew < 0.25 * model
    # what it grows by is a few of the largest tensor (fp32 read + bf16 copy + allocator slack),
    # independent of the model's size
    assert grew < 4 * r["largest_tensor_bytes_fp32"] + 32 * 2**20


def test_generate_samples_from_the_export(zero3_run, tmp_path, cli):
    out = tmp_path / "hf"
    cli("export", str(zero3_run), "--out", str(out))
    greedy = [
        cli(
            "generate", str(out), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0"
        ).stdout
        for _ in range(2)
    ]
    assert greedy[0].startswith("def ") and greedy[0] == greedy[1]
    sampled = cli(
        "generate",
        str(out),
        "--prompt",
        "import ",
        "--max-new-tokens",
        "8",
        "--top-k",
        "5",
        "--seed",
        "1",
    )
    assert sampled.stdout.startswith("import ")
    bad = cli("generate", str(out), "--prompt", "x", "--max-new-tokens", "0", check=False)
    assert bad.returncode == 2 and "--max-new-tokens 0" in bad.stderr
    missing = cli("generate", str(tmp_path), "--prompt", "x", check=False)
    assert missing.returncode == 2 and "not an exported model directory" in missing.stderr


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16")])
def test_zero1_and_zero2_checkpoints_export_exactly(stdlib_data, tmp_path, stage, precision):
    from anneal.hf.export import export

    run = tmp_path / "run"
    run_recipe(
        [
            "--out",
            str(run),
            "--data",
            str(stdlib_data),
            "--max-steps",
            "2",
            *SMALL,
            "--set",
            f"ds.zero_optimization.stage={stage}",
            "--set",
            f"train.precision={precision}",
        ],
        ranks=2,
    )
    report = export(run, out=tmp_path / "hf", dtype="fp32")
    assert (report["zero_stage"], report["world_size"]) == (stage, 2)
    assert report["verify"]["max_abs_logit_diff"] <= report["verify"]["tolerance"]
    assert_reference_matches_deepspeed(Path(report["checkpoint"]), stage)


def test_checkpoint_index_is_read_without_running_its_code(tmp_path):
    """The export's unpickler builds no tensors and calls nothing outside its allowlist: an
    object whose pickle would run a command comes back as an inert placeholder."""
    from anneal.hf.reader import Archive, LazyTensor

    class Evil:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(tmp_path / "pwned")],))

    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.arange(10.0), "evil": Evil(), "n": 3}, path)
    archive = Archive(path)
    index = archive.index()
    assert not (tmp_path / "pwned").exists() and index["n"] == 3
    assert isinstance(index["w"], LazyTensor) and index["w"].shape == (10,)
    assert index["w"].load().tolist() == list(range(10))
    out = torch.empty(3)
    index["w"].read_into(out, start=4)
    assert out.tolist() == [4.0, 5.0, 6.0]
    archive.close()


def test_failed_export_leaves_the_previous_one(zero3_run, tmp_path, monkeypatch):
    from anneal.hf.export import ExportMismatch, export, read_marker

    out = tmp_path / "hf"
    first = export(zero3_run, out=out, tag="step00000001", verify=False)
    assert read_marker(out)["step"] == first["step"] == 1

    def mismatch(*args, **kwargs):
        raise ExportMismatch("logits differ; do not ship it.")

    monkeypatch.setattr("anneal.hf.export.verify_export", mismatch)
    with pytest.raises(ExportMismatch, match="kept in .*hf.partial"):
        export(zero3_run, out=out, force=True)
    assert read_marker(out)["step"] == 1  # untouched


def test_a_failed_export_at_save_is_logged_not_raised(zero3_run, caplog):
    """During training (``train.export_every_save``) a failed export is logged, never raised:
    the run and its checkpoint are fine. The success path is tests/hf/test_export_every_save.py."""
    from anneal.train import ExportAfterSave

    exports = ExportAfterSave(True)
    exports.on_checkpoint(zero3_run / "checkpoints" / "step99999999")  # no such tag: exit 2
    exports.close()
    assert "export of" in caplog.text and "failed (exit 2" in caplog.text
    assert not (zero3_run / "hf" / "step99999999").exists()
