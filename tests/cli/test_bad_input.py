"""Bad input fails early with one clear paragraph, exit code 2, and loses nothing: a missing
data directory, a ds_config that is not JSON or has a typo, a --resume path that does not
exist, an unknown --set key, and an --out that holds a different run.

One refusal goes through a real recipe process (exit 2, the paragraph on stderr, nothing
written); the others are the same launch resolution run in this process (the recipe's parser,
then ``resolve_launch``, as every rank runs it before its engine), where the UserError that the
entry point prints is caught directly: a process start each (3 s here) bought nothing more.
How the entry point prints a UserError by rank is checked in processes below."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from anneal.cli.recipe import config_from_args, load_recipe
from anneal.errors import UserError
from anneal.resolution.resolve import resolve_launch
from tests.conftest import ROOT, SMALL, run_recipe

TINY = ROOT / "recipes" / "pretrain_tiny.py"


def refused(args) -> str:
    """The message of the UserError that resolving this launch of the tiny recipe (1 rank, CPU)
    raises; any other exception, or none, fails the test."""
    with pytest.raises(UserError) as caught:
        cfg, overrides = config_from_args(args, prog=str(TINY), on_cpu=True, **load_recipe(TINY))
        resolve_launch(cfg, overrides, world_size=1, device_type="cpu")
    return str(caught.value)


def fail(args):
    proc = run_recipe(args, check=False, timeout_s=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stderr


def test_missing_data_directory(tmp_path):
    err = fail(["--out", str(tmp_path / "run"), "--data", str(tmp_path / "nope")])
    assert "--data" in err and "not a prepared data directory" in err
    assert f"anneal data prepare --input YOUR_TEXT --out {tmp_path / 'nope'}" in err
    assert "`--input stdlib` for the embedded demo corpus" in err
    assert not (tmp_path / "run").exists()


def test_ds_config_not_json(tiny_data, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_micro_batch_size_per_gpu": 4,\n  "bf16": {"enabled": true,}\n}\n')
    err = refused(
        ["--out", str(tmp_path / "run"), "--data", str(tiny_data), "--ds-config", str(bad)]
    )
    assert f"{bad}: not valid JSON at line 3, column" in err
    assert not (tmp_path / "run").exists()


def test_ds_config_typo(tiny_data, tmp_path):
    from anneal.resolution.ds import DS_CONFIG_DIR

    cfg = json.loads((DS_CONFIG_DIR / "cpu.json").read_text())
    cfg["gradient_clipp1ng"] = cfg.pop("gradient_clipping")
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(cfg))
    err = refused(
        ["--out", str(tmp_path / "run"), "--data", str(tiny_data), "--ds-config", str(path)]
    )
    assert "unknown key 'gradient_clipp1ng'" in err and "did you mean 'gradient_clipping'" in err


def test_resume_path_that_does_not_exist(tiny_data, tmp_path):
    err = refused(
        [
            "--out",
            str(tmp_path / "run"),
            "--data",
            str(tiny_data),
            "--resume",
            str(tmp_path / "ckpt"),
        ]
    )
    assert f"--resume {tmp_path / 'ckpt'}: no such file or directory" in err


def test_unknown_override(tiny_data, tmp_path):
    err = refused(
        ["--out", str(tmp_path / "run"), "--data", str(tiny_data), "--set", "train.max_step=3"]
    )
    assert "did you mean 'max_steps'" in err


def digest(directory):
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(directory)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.mark.slow
def test_out_with_a_different_run_is_refused(stdlib_data, tmp_path):
    out = tmp_path / "run"
    base = [
        "--out",
        str(out),
        "--data",
        str(stdlib_data),
        "--val-every",
        "2",
        "--save-every",
        "2",
        *SMALL,
    ]
    run_recipe([*base, "--max-steps", "2"])
    before = digest(out)
    err = fail([*base, "--max-steps", "2", "--set", "ds.optimizer.params.lr=0.01"])
    assert f"--out {out} holds a different run" in err
    assert "ds_config.optimizer.params.lr: 0.003 -> 0.01" in err
    assert digest(out) == before  # nothing written, nothing overwritten
    # Asked explicitly, the same directory continues with the new settings.
    proc = run_recipe([*base, "--max-steps", "4", "--resume", "auto"])
    assert "resumed from" in proc.stdout


@pytest.mark.slow
def test_resume_on_data_with_another_tokenizer_is_refused(tmp_path):
    """Same vocabulary size, different tokenizer, original data gone: only the checkpoint's
    record of the tokenizer can tell, and resume refuses."""
    import sysconfig

    from anneal.data.prepare import prepare

    # 60 of the standard library's small modules (under a megabyte, one document each): varied
    # enough text for both tokenizers to reach the same vocabulary, seconds instead of minutes.
    text = tmp_path / "text"
    text.mkdir()
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for module in [m for m in stdlib if m.stat().st_size < 20_000][:60]:
        (text / f"{module.stem}.txt").write_text(module.read_text())
    first, second = tmp_path / "bpe", tmp_path / "unigram"
    kw = dict(vocab_size=2000, val_fraction=0.1, progress=False)
    prepare(inputs=[str(text)], out=first, **kw)
    prepare(inputs=[str(text)], out=second, model_type="unigram", **kw)
    out = tmp_path / "run"
    base = ["--out", str(out), "--max-steps", "4", "--val-every", "2", "--save-every", "2", *SMALL]
    run_recipe([*base, "--data", str(first), "--set", "train.stop_at_step=2"])
    shutil.rmtree(first)
    err = fail([*base, "--data", str(second), "--resume", "auto"])
    assert f"--data {second}: its tokenizer" in err and "step00000002" in err


def test_warmup_longer_than_the_run(tiny_data, tmp_path):
    err = refused(
        [
            "--out",
            str(tmp_path / "run"),
            "--data",
            str(tiny_data),
            "--max-steps",
            "20",
            "--set",
            "ds.scheduler.params.warmup_num_steps=30",
        ]
    )
    assert "warmup_num_steps (30) exceeds --max-steps (20)" in err and '"auto"' in err
    assert len(err.strip().splitlines()) == 1  # one paragraph, no traceback
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "item,expect",
    [
        ("ds.gradient_clipping.x=1", "'gradient_clipping' is a value"),
        ("ds.=1", "empty key"),
        ("train.max_steps", "section.key=value"),
        ("optim.lr=fast", "expected float"),
    ],
)
def test_malformed_set(tiny_data, tmp_path, item, expect):
    err = refused(["--out", str(tmp_path / "run"), "--data", str(tiny_data), "--set", item])
    assert expect in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_entry_point_prints_user_errors_by_rank(rank, monkeypatch, capsys):
    """A UserError becomes one paragraph and exit 2: once for an error every rank sees, by the
    rank that saw it (with its rank) otherwise; anything else keeps its traceback (it leaves
    the entry point, for Python to print). The recipe's entry point runs here, as rank 0 or 1
    of two, with a training that fails at once in place of anneal.train.run."""
    import anneal.train
    from anneal.cli.recipe import main

    for name, value in {"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(name, value)

    def run(cfg, overrides):
        if kind == "user":
            raise UserError("the shard went away")
        if kind == "every":
            raise UserError("bad config", every_rank=True)
        raise ValueError("a bug")

    monkeypatch.setattr(anneal.train, "run", run)

    def call():
        with pytest.raises(SystemExit) as exit:
            main(preset="tiny", ds_config="cpu.json", argv=["--data", "d"])
        return exit.value.code, capsys.readouterr().err

    kind = "user"
    code, err = call()
    assert code == 2
    assert f"error (rank {rank} on " in err and "the shard went away" in err
    kind = "every"
    code, err = call()
    assert code == 2
    assert ("error: bad config" in err) is (rank == "0")
    kind = "bug"
    with pytest.raises(ValueError, match="a bug"):
        main(preset="tiny", ds_config="cpu.json", argv=["--data", "d"])


@pytest.mark.parametrize("ends", ["finished", "refused"])
def test_entry_point_destroys_its_process_group(ends, monkeypatch):
    """A rank that finishes, or refuses with a UserError, leaves no process group for the
    interpreter's shutdown to tear down (gloo's threads then aborted a finished two-rank run now
    and then: exit -6, "terminate called without an active exception", seen in CI). The entry
    point runs here as a world of one with a real gloo group, started by anneal.train.run's
    stand-in the way the trainer starts it."""
    import torch.distributed as dist

    import anneal.train
    from anneal.cli.recipe import main
    from anneal.dist import init_distributed, world_of_one_env

    for name, value in world_of_one_env().items():
        monkeypatch.setenv(name, value)

    def run(cfg, overrides):
        init_distributed(60)
        assert dist.is_initialized()
        if ends == "refused":
            raise UserError("the shard went away", every_rank=True)
        keys = ("train_loss", "val_loss", "val_bpb", "tokens_per_s")
        return {"step": 1, "tokens": 8, "run_dir": "runs/x", **dict.fromkeys(keys)}

    monkeypatch.setattr(anneal.train, "run", run)
    if ends == "refused":
        with pytest.raises(SystemExit) as exit:
            main(preset="tiny", ds_config="cpu.json", argv=["--data", "d"])
        assert exit.value.code == 2
    else:
        assert main(preset="tiny", ds_config="cpu.json", argv=["--data", "d"]) is None
    assert not dist.is_initialized()


def test_data_without_validation_trains_only_with_evaluation_off(shared_runs, tmp_path):
    """A data directory prepared with --val-fraction 0 is refused while validation is on (one
    paragraph, nothing written) and trains with train.val_samples=0 (the session's "noval"
    run, tests/conftest.py: 2 steps on that directory)."""
    from tests.conftest import read_metrics

    data = shared_runs["noval_data"]
    base = ["--out", str(tmp_path / "run"), "--data", str(data), "--max-steps", "2", *SMALL]
    err = refused(base)
    assert "no validation windows" in err and "train.val_samples=0" in err
    assert not (tmp_path / "run").exists()
    run, _ = shared_runs["noval"]
    assert len(read_metrics(run, "train")) == 2
    assert read_metrics(run, "val") == []
