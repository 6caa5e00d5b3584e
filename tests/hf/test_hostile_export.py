"""Hostile input to `anneal export` and `anneal generate`: each case exits 2 with one paragraph
that names the flag, file or key and the fix, with no traceback, and changes no file outside the
command's own output (the trees around it are hashed before and after).

Proved here: `--out` never deletes what export did not write (`.`, the run, its checkpoints, the
data, a foreign directory, a `.NAME.partial` already there); a checkpoint whose bytes differ from
its manifest (same-size bit rot) is refused before conversion; a `__reduce__` payload planted in a
checkpoint (manifest rewritten to match) is refused by torch's weights-only loader before the
export's reader opens the file, and never runs; the verification's own reader refuses it too;
`--tag` names a checkpoint of this run only; a manifest that names files outside its directory is
refused; a broken config.json, frozen parameters, another model's shapes, a `--shard-size` or
`--dtype` typo, and bad sampling values or an over-long prompt for generate, are refused clearly; a
checkpoint missing a tensor-parallel rank's files is named with those files and the fix (copy the
whole tag directory), not "train it first"; a data directory whose tokenizer.json disagrees with
its tokenizer.model is named, by its meta.json's hashes before anything is written, or (prepared
before those) by the export's tokenizer check, in a paragraph.

The run exported is the session's one tiny run (conftest's `tiny_run`, shared with the hostile
cases of resume: 10-20 s, paid once); the rest takes about 10 s: everything runs in-process
through `anneal.cli.main` or `anneal.hf.export.export`, and only one test converts a checkpoint
(twice, without verification).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import tree

TAG = "step00000002"


class Payload:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def run(tiny_run, tmp_path) -> Path:
    """A copy of the tiny run, for a test that damages it or that might delete it."""
    return Path(shutil.copytree(tiny_run, tmp_path / "run", symlinks=True))


def cli(capsys, *argv) -> tuple[int, str, str]:
    """`anneal ARGV` in-process: (exit code, stdout, stderr)."""
    from anneal.cli import main

    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def refused(capsys, *argv, names: list[str], untouched: list[Path]) -> str:
    """Run `anneal ARGV`; assert exit 2, a message holding each of ``names``, and no file
    under ``untouched`` changed. Returns the message."""
    before = tree(*untouched)
    rc, out, err = cli(capsys, *argv)
    assert rc == 2, (rc, out, err)
    for name in names:
        assert name in err, (name, err)
    assert "verified" not in out
    assert tree(*untouched) == before
    return err


def rehash(tag_dir: Path) -> None:
    """Rewrite the manifest to match the files as they are now (what an attacker does)."""
    from anneal.resilience.checkpoint import file_hash

    path = tag_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    for name, entry in manifest["files"].items():
        entry.update(size=(tag_dir / name).stat().st_size, xxh3_128=file_hash(tag_dir / name))
    path.write_text(json.dumps(manifest, indent=2))


def plant(path: Path, marker: Path) -> None:
    """Add a payload to a checkpoint file, read here without running anything."""
    from anneal.resilience.safeload import safe_globals

    with torch.serialization.safe_globals(safe_globals()):
        state = torch.load(path, weights_only=True)
    state["extra"] = Payload(marker)
    torch.save(state, path)
    rehash(path.parent)


# --- item 1 and 9: --out never deletes what export did not write ----------------------------


def test_out_dot_the_run_its_checkpoints_and_the_data_are_refused(
    run, tiny_data, tmp_path, capsys, monkeypatch
):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    keep = [work, run, tiny_data]
    refused(
        capsys,
        "export",
        run,
        "--out",
        ".",
        "--force",
        names=["--out .", "working directory"],
        untouched=keep,
    )
    ckpt = run / "checkpoints"
    for out in (
        run,
        ckpt,
        ckpt / TAG,
        ckpt / "new",
        run / "config.json",
        tiny_data,
        tiny_data / "hf",
        tmp_path,
    ):
        refused(
            capsys, "export", run, "--out", out, "--force", names=[f"--out {out}"], untouched=keep
        )
    # inside the run, only RUN/hf and below: not its plots, not a new directory beside them
    for out in (run / "plots", run / "exported"):
        refused(
            capsys,
            "export",
            run,
            "--out",
            out,
            "--force",
            names=[f"--out {out}", "hf"],
            untouched=keep,
        )


def test_force_replaces_only_an_earlier_export_and_leaves_a_partial_alone(run, tmp_path, capsys):
    from anneal.hf.export import export, read_marker

    foreign = tmp_path / "models"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"someone's model")
    refused(
        capsys,
        "export",
        run,
        "--out",
        foreign,
        "--force",
        names=[f"--out {foreign}", "not a model exported by anneal export"],
        untouched=[foreign, run],
    )
    # the conventional place inside the run works, and --force replaces an export there
    hf = run / "hf"
    stray = run / ".hf.partial"
    stray.mkdir()
    (stray / "draft.txt").write_text("not export's")
    export(run, out=hf, tag="step00000001", verify=False)
    assert read_marker(hf)["step"] == 1
    assert (stray / "draft.txt").read_text() == "not export's"
    export(run, out=hf, force=True, verify=False)
    assert read_marker(hf)["step"] == 2
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [".hf.partial"]


def test_out_that_is_a_file_or_cannot_be_made(run, tmp_path, capsys):
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"x")
    refused(
        capsys,
        "export",
        run,
        "--out",
        a_file,
        "--force",
        names=[f"--out {a_file}", "file"],
        untouched=[tmp_path],
    )
    under = a_file / "hf"
    refused(
        capsys,
        "export",
        run,
        "--out",
        under,
        names=[f"--out {under}", "writable"],
        untouched=[tmp_path],
    )
    nowhere = Path("/proc/anneal-test-export/hf")
    refused(
        capsys, "export", run, "--out", nowhere, names=[f"--out {nowhere}"], untouched=[tmp_path]
    )
    assert not nowhere.exists()
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        refused(
            capsys, "export", run, "--out", locked / "hf", names=["writable"], untouched=[tmp_path]
        )


def test_every_save_claims_its_directory(run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(run)
    refused(capsys, "export", run, "--every-save", "--out", ".", names=["--out ."], untouched=[run])
    refused(
        capsys, "export", run, "--every-save", "--out", run, names=[f"--out {run}"], untouched=[run]
    )
    taken = run / "hf" / "step00000001"
    taken.mkdir(parents=True)
    (taken / "notes.txt").write_text("mine")
    refused(
        capsys,
        "export",
        run,
        "--every-save",
        "--out",
        run / "hf",
        names=[str(taken)],
        untouched=[run],
    )


# --- item 4: the manifest's hashes are checked before conversion -----------------------------


def test_same_size_bit_rot_is_refused_naming_the_file(run, tmp_path, capsys):
    optim = run / "checkpoints" / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one low bit of an fp32 weight or moment
    optim.write_bytes(bytes(data))
    out = tmp_path / "hf"
    err = refused(
        capsys,
        "export",
        run,
        "--out",
        out,
        names=[optim.name, "manifest.json", "hash", "--tag", "step00000001"],
        untouched=[run],
    )
    assert "differ" in err
    assert "(--tag; intact by size: step00000001)" in err  # not the damaged tag it refuses
    assert not out.exists() and not list(tmp_path.glob(".hf.partial*"))


# --- item 10: a planted payload never runs ----------------------------------------------------


def test_planted_payload_is_named_and_never_runs(run, tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    model_file = run / "checkpoints" / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    plant(model_file, marker)
    out = tmp_path / "hf"
    refused(
        capsys,
        "export",
        run,
        "--out",
        out,
        names=[str(model_file), "system", "trust"],
        untouched=[run],
    )
    assert not marker.exists()
    assert not out.exists() and not list(tmp_path.glob(".hf.partial*"))


def test_verification_reader_refuses_a_payload_even_without_the_check(run, tmp_path):
    """The independent reader of the verification loads with weights_only=True: a payload that
    slipped past the check before it is refused there too, at every ZeRO stage's path."""
    from anneal.errors import UserError
    from anneal.hf.zero import reference_state_dict

    marker = tmp_path / "payload-ran"
    tag_dir = run / "checkpoints" / TAG
    optim = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    plant(optim, marker)
    with pytest.raises(UserError, match=f"{optim}.*weights_only=True"):
        reference_state_dict(tag_dir, 3)
    model_file = tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    plant(model_file, marker)
    with pytest.raises(UserError, match=f"{model_file}.*weights_only=True"):
        reference_state_dict(tag_dir, 0)
    assert not marker.exists()


# --- item 14: --tag and the manifest's names are confined -------------------------------------


def test_tag_names_a_checkpoint_of_this_run_only(run, tiny_run, tmp_path, capsys):
    other = Path(shutil.copytree(tiny_run, tmp_path / "other"))
    out = tmp_path / "hf"
    keep = [run, other]
    for tag in (
        f"../../other/checkpoints/{TAG}",
        "../..",
        "..",
        str(other / "checkpoints" / TAG),
        f"{TAG}/",
        f"./{TAG}",
        "latest",
    ):  # an empty --tag is refused by name where argparse reads it (test_hostile_values.py)
        refused(
            capsys,
            "export",
            run,
            "--tag",
            tag,
            "--out",
            out,
            names=[f"--tag {tag}", "step00000001, step00000002"],
            untouched=keep,
        )
        assert not out.exists()
    (run / "checkpoints" / "elsewhere").symlink_to(other / "checkpoints" / TAG)
    refused(
        capsys,
        "export",
        run,
        "--tag",
        "elsewhere",
        "--out",
        out,
        names=["--tag elsewhere", "no such checkpoint"],
        untouched=keep,
    )


@pytest.mark.parametrize("where", ["../../outside.bin", "/etc/passwd", "a/../../../x"])
def test_manifest_naming_files_outside_its_directory_is_refused(run, tmp_path, capsys, where):
    tag_dir = run / "checkpoints" / TAG
    target = (tag_dir / where).resolve() if not where.startswith("/") else Path(where)
    if where == "../../outside.bin":
        target.write_bytes(b"0123456789")  # present with the size listed: it looks intact
    manifest = json.loads((tag_dir / "manifest.json").read_text())
    size = target.stat().st_size if target.is_file() else 10
    manifest["files"][where] = {"size": size, "xxh3_128": "0" * 32}
    (tag_dir / "manifest.json").write_text(json.dumps(manifest))
    for tag in (TAG, None):
        args = ["--tag", tag] if tag else []
        refused(
            capsys,
            "export",
            run,
            *args,
            "--out",
            tmp_path / "hf",
            names=[str(tag_dir / "manifest.json"), repr(where)],
            untouched=[run],
        )


def test_a_missing_tensor_parallel_rank_is_named_not_train_it_first(run, tmp_path, capsys):
    """Every checkpoint's manifest made that of a tensor-parallel degree 2 save whose rank 1
    files (listed, as every rank's files are) did not come along with the copy: the export,
    with --tag or without, names the checkpoint and rank 1's files and says to copy the whole
    tag directory or export an intact checkpoint, not to train the run first."""
    for tag_dir in sorted((run / "checkpoints").glob("step*")):
        path = tag_dir / "manifest.json"
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        for name in [n for n in files if "mp_rank_00" in n]:
            files[name.replace("mp_rank_00", "mp_rank_01")] = files[name]
        path.write_text(json.dumps({**manifest, "tensor_parallel_size": 2}))
    for tag in (TAG, None):
        err = refused(
            capsys,
            "export",
            run,
            *(["--tag", tag] if tag else []),
            "--out",
            tmp_path / "hf",
            names=[
                str(run / "checkpoints" / TAG),
                "missing tensor-parallel rank files",
                "mp_rank_01_model_states.pt",
                "Copy the whole tag directory",
                "export an intact checkpoint",
            ],
            untouched=[run],
        )
        assert "Train it first" not in err and "\n" not in err.strip(), err


def test_a_tokenizer_json_that_disagrees_with_the_data_is_a_paragraph(
    run, tiny_data, tmp_path, capsys
):
    """Two ids swapped in the tokenizer.json of a copy of the run's prepared data (its
    tokenizer.model, the ids the run trained on, unchanged): the export names the data
    directory and tokenizer.json before it writes anything. The same directory as an older
    Anneal prepared it (meta.json without ``tokenizer_files``) gets through to the export's
    check of the shipped tokenizer, which names the data directory and its files in one
    paragraph instead of a traceback that blames the exporter. Nothing is left behind."""
    from anneal.hf.verify import VERIFY_TEXT
    from tests.data.test_hostile_data import swap_two_ids

    data = Path(shutil.copytree(tiny_data, tmp_path / "data"))
    swap_two_ids(data / "tokenizer.json", VERIFY_TEXT)
    out = tmp_path / "hf"
    args = ["export", run, "--tokenizer", data, "--out", out]
    err = refused(
        capsys,
        *args,
        names=[f"{data}: tokenizer.json differ", f"anneal data verify {data}"],
        untouched=[run, data],
    )
    assert "Nothing was exported" in err and not out.exists(), err
    meta = json.loads((data / "meta.json").read_text())
    del meta["tokenizer_files"]
    (data / "meta.json").write_text(json.dumps(meta))
    err = refused(
        capsys,
        *args,
        names=[f"{data}: AutoTokenizer on its tokenizer.json", "tokenizer.model there"],
        untouched=[run, data],
    )
    assert "Traceback" not in err and "\n" not in err.strip(), err
    assert not out.exists() and not list(tmp_path.glob(".hf.partial*"))


def test_malformed_manifest_is_refused_naming_it(run, tmp_path, capsys):
    path = run / "checkpoints" / TAG / "manifest.json"
    for doc in ([], {"step": 2}, {"step": "2", "files": {}}, {"step": 2, "files": {"a": -1}}):
        path.write_text(json.dumps(doc))
        refused(
            capsys,
            "export",
            run,
            "--tag",
            TAG,
            "--out",
            tmp_path / "hf",
            names=[str(path)],
            untouched=[run],
        )


# --- the run directory, the checkpoint's model, the flags ------------------------------------


def test_broken_run_directory_and_config(run, tmp_path, capsys):
    out = tmp_path / "hf"
    refused(
        capsys,
        "export",
        tmp_path / "nope",
        "--out",
        out,
        names=["no config.json"],
        untouched=[tmp_path],
    )
    config = run / "config.json"
    doc = json.loads(config.read_text())
    for text, names in (
        ("{not json", [str(config), "JSON"]),
        ("[1, 2]", [str(config), "'model'"]),
        (
            json.dumps({**doc, "model": {**doc["model"], "hidden_size": -256}}),
            [str(config), "model.hidden_size", "-256"],
        ),
        (
            json.dumps({**doc, "model": {**doc["model"], "num_attention_heads": 5}}),
            [str(config), "num_attention_heads 5"],
        ),
        (
            json.dumps({**doc, "model": {**doc["model"], "hidden_size": 128}}),
            [str(run / "checkpoints" / TAG), "do not match", "config.json"],
        ),
        (
            json.dumps({k: v for k, v in doc.items() if k != "run"}),
            ["run.data.path", "--tokenizer"],
        ),
    ):
        config.write_text(text)
        refused(capsys, "export", run, "--out", out, names=names, untouched=[run])
    config.unlink()
    refused(
        capsys, "export", run, "--out", out, names=[str(run), "no config.json"], untouched=[run]
    )


def test_frozen_parameters_are_refused_clearly(run, tmp_path, capsys):
    from anneal.resilience.safeload import safe_globals

    path = run / "checkpoints" / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with torch.serialization.safe_globals(safe_globals()):
        state = torch.load(path, weights_only=True)
    state["frozen_param_shapes"] = {"model.embed_tokens.weight": torch.Size([8192, 64])}
    torch.save(state, path)
    rehash(path.parent)
    refused(capsys, "export", run, "--out", tmp_path / "hf", names=[TAG, "frozen"], untouched=[run])


def test_dtype_and_shard_size_typos(tiny_run, tmp_path, capsys):
    from anneal.errors import UserError
    from anneal.hf.export import export

    out = tmp_path / "hf"
    rc, _, err = cli(capsys, "export", tiny_run, "--out", out, "--dtype", "bf61")
    assert rc == 2 and "--dtype" in err and "bf16" in err
    with pytest.raises(UserError, match="--dtype bf61: choose one of bf16, fp32"):
        export(tiny_run, out=out, dtype="bf61")
    for size in ("1.2.3GB", "abc", "0", "-5GB", "5XB", ".", "1e3MB", "0.1B"):
        refused(
            capsys,
            "export",
            tiny_run,
            "--out",
            out,
            f"--shard-size={size}",
            names=[f"--shard-size {size}"],
            untouched=[tiny_run],
        )
    assert not out.exists()


# --- item 9: generate -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_data, tmp_path_factory) -> Path:
    """A randomly initialised model of 16 tokens' context, saved as export saves one."""
    from anneal import model as modellib
    from anneal.hf.writer import write_configs

    preset = modellib.ModelPreset(
        name="t",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        seq_len=16,
        nominal_params=None,
        vocab_size=300,
    )
    out = tmp_path_factory.mktemp("tiny_model")
    torch.manual_seed(0)
    modellib.build_model(preset).save_pretrained(str(out))
    write_configs(out, preset, tiny_data, torch.float32)
    return out


def test_generate_refuses_bad_sampling_values_before_loading(tmp_path, capsys):
    missing = tmp_path / "no-model"  # checked first: the model is never loaded for these
    for flag, value in (
        ("--temperature", "nan"),
        ("--temperature", "inf"),
        ("--temperature", "-1"),
        ("--top-k", "-1"),
        ("--top-p", "0"),
        ("--top-p", "1.5"),
        ("--top-p", "nan"),
        ("--max-new-tokens", "0"),
        ("--max-new-tokens", "-3"),
        ("--seed", str(2**64)),
    ):
        refused(
            capsys,
            "generate",
            missing,
            "--prompt",
            "def ",
            flag,
            value,
            names=[f"{flag} {value}"],
            untouched=[tmp_path],
        )


def test_generate_refuses_a_prompt_longer_than_the_context(tiny_model, capsys, caplog):
    refused(
        capsys,
        "generate",
        tiny_model,
        "--prompt",
        "def main():\n    pass\n" * 20,
        names=["--prompt", "at most 16", "Shorten the prompt"],
        untouched=[tiny_model],
    )
    rc, out, _ = cli(
        capsys,
        "generate",
        tiny_model,
        "--prompt",
        "def ",
        "--max-new-tokens",
        "100",
        "--temperature",
        "0",
    )
    assert rc == 0 and out.startswith("def ")
    assert "at most" in caplog.text and "--max-new-tokens 100" in caplog.text


def test_generate_refuses_what_is_not_an_export(tiny_model, tmp_path, capsys):
    broken = Path(shutil.copytree(tiny_model, tmp_path / "broken"))
    (broken / "config.json").write_text("{not json")
    refused(
        capsys,
        "generate",
        broken,
        "--prompt",
        "def ",
        names=[str(broken), "anneal export"],
        untouched=[tmp_path],
    )
    pickled = Path(shutil.copytree(tiny_model, tmp_path / "pickled"))
    from safetensors.torch import load_file

    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    refused(
        capsys,
        "generate",
        pickled,
        "--prompt",
        "def ",
        names=[str(pickled), "safetensors"],
        untouched=[tmp_path],
    )


# --- issue 44: a save still being written is never exported -------------------------------


def test_a_save_still_being_written_is_never_exported(run, tmp_path, capsys):
    """An asynchronous save in flight leaves a tag with no manifest yet and a file under its
    hidden temporary name (``background_save.write_file``): export's choice of a run's
    checkpoint passes over it for the newest committed one, and ``--tag`` naming it is refused
    in a paragraph, nothing written."""
    from anneal import rundir
    from anneal.hf.source import select_checkpoint

    newest = select_checkpoint(run, None)
    in_flight = rundir.checkpoints_dir(run) / "step00000009"
    shutil.copytree(newest, in_flight)
    (in_flight / "manifest.json").unlink()
    first = sorted(in_flight.glob("*.pt"))[0]
    first.rename(first.with_name(f".{first.name}.partial"))
    assert select_checkpoint(run, None) == newest
    refused(
        capsys,
        "export",
        run,
        *("--out", tmp_path / "hf", "--tag", in_flight.name),
        names=[f"--tag {in_flight.name}: not intact", "interrupted", newest.name],
        untouched=[run, tmp_path],
    )
