"""A model directory from elsewhere (``--init-from DIR``, ``anneal generate DIR``, ``anneal data
prepare --tokenizer DIR``) read as untrusted input; in-process, on the tiny Llama that
tests/hf/test_init_from.py makes.

Proves: safetensors byte ranges that overlap, or bytes past the last tensor, are refused as the
``safetensors`` library refuses them; a NaN or an infinity in any tensor (safetensors or
``.bin``, anywhere in it) stops the load with a paragraph naming the file and the tensor; a
``config.json`` whose sizes the weight headers contradict (a vocabulary of 2**31) is refused
at resolution, naming the key, before anything is allocated; an unknown ``hidden_act`` is one
paragraph, not a transformers traceback; a Hugging Face hub-cache snapshot (links into the
cache's own ``blobs/``) loads the same weights as the plain directory, sharded or not; a link
anywhere else is refused, for a single file as for a shard; and a directory whose tokenizer
or model class exists only as Python code in ``auto_map`` runs nothing, even at a terminal
(a pseudo-terminal answering ``y``): the user gets one paragraph.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch

from anneal.errors import UserError
from tests.hf.test_init_from import SEQ, VOCAB, make_model, resolve


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_data) -> Path:
    return make_model("llama", tmp_path_factory.mktemp("untrusted") / "llama", tiny_data)


def _copy(src: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


def _preset(directory: Path):
    from anneal.config.run import ModelConfig
    from anneal.hf.load import pretrained_preset

    return pretrained_preset(directory, data_vocab=VOCAB, model=ModelConfig(seq_len=SEQ))


def _loaded(directory: Path, preset=None) -> dict[str, torch.Tensor]:
    """The model of ``directory`` (or of ``preset``) with its weights loaded, as a state dict."""
    from anneal import model as modellib
    from anneal.hf.load_weights import load_pretrained_

    model = modellib.build_model(preset or _preset(directory))
    load_pretrained_(model, directory)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _edit_header(path: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header through ``edit(header)``; the data unchanged."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


# --- safetensors headers -----------------------------------------------------------------------

Q0, Q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"


def _overlap(path: Path) -> None:
    """Layer 1's q_proj given layer 0's bytes (its own bytes left in the file, unused)."""

    def edit(header):
        header[Q1]["data_offsets"] = header[Q0]["data_offsets"]

    _edit_header(path, edit)


def _trailing(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(bytes(64))


@pytest.mark.parametrize(
    "damage, message, theirs",
    [
        (_overlap, f"tensor {Q1} .* overlaps the tensor before it", "invalid offset"),
        (_trailing, "64 bytes past its last tensor", "not fully covered"),
    ],
    ids=["overlap", "trailing"],
)
def test_safetensors_ranges_must_tile_the_data(llama, tmp_path, damage, message, theirs):
    """Refused where the ``safetensors`` library refuses the same file: at resolution, and by
    the loader itself (which reads the header again when the engine is built)."""
    from safetensors import SafetensorError, safe_open

    good = _preset(llama)
    directory = _copy(llama, tmp_path)
    weights = directory / "model.safetensors"
    damage(weights)
    with pytest.raises(SafetensorError, match=theirs):
        safe_open(str(weights), "pt")
    with pytest.raises(UserError, match=message) as e:
        _preset(directory)
    assert "model.safetensors" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match=message):
        _loaded(directory, good)


# --- values --------------------------------------------------------------------------------------

DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_a_non_finite_weight_is_refused_naming_file_and_tensor(llama, tmp_path, bad, kind):
    """The value is the last element of a tensor of a later layer: the headers are fine, so
    the launch resolves; the load stops when that tensor is read."""
    from safetensors.torch import load_file, save_file

    good = _preset(llama)
    directory = _copy(llama, tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    state[DOWN].view(-1)[-1] = bad
    (directory / "model.safetensors").unlink()
    if kind == "safetensors":
        name = "model.safetensors"
        save_file(state, str(directory / name), metadata={"format": "pt"})
    else:
        name = "pytorch_model.bin"
        torch.save(state, directory / name)
    _preset(directory)
    with pytest.raises(UserError, match=f"{name}: the tensor {DOWN} holds NaN or infinite") as e:
        _loaded(directory, good)
    assert e.value.every_rank and "\n" not in str(e.value)


def test_the_finite_check_reads_every_chunk(tmp_path, monkeypatch):
    """``check_finite`` goes ``FINITE_CHUNK`` elements at a time, by each chunk's sum: a NaN
    or an infinity in the short last chunk or in a middle one is found; finite values whose
    sum overflows (fp16's 65,504) pass."""
    from anneal.hf import weight_files

    monkeypatch.setattr(weight_files, "FINITE_CHUNK", 7)
    where = (tmp_path, tmp_path / "w.safetensors", "w")
    t = torch.ones(5, 9, dtype=torch.bfloat16)  # 45 elements: six chunks of 7 and one of 3
    weight_files.check_finite(t, *where)
    weight_files.check_finite(torch.full((45,), 6e4, dtype=torch.float16), *where)
    for i, bad_value in ((44, float("nan")), (20, float("-inf"))):
        bad = t.clone()
        bad.view(-1)[i] = bad_value
        with pytest.raises(UserError, match="w.safetensors: the tensor w holds NaN"):
            weight_files.check_finite(bad, *where)


# --- config.json against the headers -------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, fact",
    [
        ("vocab_size", 2**31, "model.embed_tokens.weight has 300 rows"),
        ("hidden_size", 128, "model.embed_tokens.weight is 64 wide"),
    ],
)
def test_sizes_the_headers_contradict_are_refused_before_any_allocation(
    llama, tiny_data, tmp_path, key, value, fact
):
    """A vocabulary of 2**31 rows (1 TiB of fp32 weights at this width, the embedding and the
    head) is refused by the launch's resolution, naming the key, with the process's peak memory
    unmoved."""
    directory = _copy(llama, tmp_path)
    doc = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**doc, key: value}))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(UserError, match=f"config.json gives {key} {value:,} and {fact}") as e:
        resolve(directory, tiny_data, tmp_path / "run")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 * 1024
    assert not (tmp_path / "run").exists() and "\n" not in str(e.value)


def test_an_unknown_activation_is_one_paragraph(llama, tiny_data, tmp_path):
    directory = _copy(llama, tmp_path)
    doc = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**doc, "hidden_act": "swishy"}))
    with pytest.raises(UserError, match=r"config.json gives hidden_act 'swishy', an activation"):
        resolve(directory, tiny_data, tmp_path / "run")


# --- the hub cache and links ---------------------------------------------------------------------


def hub_cache(model_dir: Path, cache: Path, revision: str = "0" * 40) -> Path:
    """``model_dir`` laid out as huggingface_hub downloads it: each file's bytes in
    ``cache/blobs/<sha256>``, ``cache/snapshots/<revision>/<name>`` a relative link to it,
    ``cache/refs/main`` naming the revision. Returns the snapshot directory."""
    snapshot = cache / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (cache / "blobs").mkdir()
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(revision)
    for path in sorted(model_dir.iterdir()):
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, cache / "blobs" / sha)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", sha))
    return snapshot


@pytest.fixture(scope="module")
def sharded(llama, tmp_path_factory) -> Path:
    """The Llama in shards of at most 40 KB, with its tokenizer (save_pretrained's layout)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("sharded") / "llama"
    model = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32)
    model.save_pretrained(str(out), max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(llama / name, out / name)
    return out


def test_a_hub_cache_snapshot_loads_as_the_plain_directory(llama, sharded, tmp_path):
    """Sharded (the index and every shard links into ``blobs/``) and as one file: the same
    model, the same recorded file names and hashes, the same weights."""
    for i, plain in enumerate((sharded, llama)):
        snapshot = hub_cache(plain, tmp_path / f"models--t--llama{i}")
        assert (snapshot / "config.json").is_symlink()
        ours, theirs = _preset(snapshot), _preset(plain)
        assert ours.init_from["files"] == theirs.init_from["files"]
        assert ours.hf_config == theirs.hf_config
        want = _loaded(plain)
        got = _loaded(snapshot)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def _outside_file(tmp_path: Path, src: Path) -> Path:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    return Path(shutil.copyfile(src, elsewhere / src.name))


def test_a_link_out_of_the_directory_or_its_blobs_is_refused(llama, sharded, tmp_path):
    """A single model.safetensors linking to a file elsewhere (refused at resolution and by the
    loader), a tokenizer.json doing the same, and a snapshot shard linking out of the cache's
    blobs/ (to a file elsewhere, and to another cache's blob): each named with where it
    leads."""
    good = _preset(llama)
    single = _copy(llama, tmp_path, "single")
    target = _outside_file(tmp_path, single / "model.safetensors")
    (single / "model.safetensors").unlink()
    (single / "model.safetensors").symlink_to(target)
    message = f"model.safetensors is a link to {target}, outside the directory"
    with pytest.raises(UserError, match=message):
        _preset(single)
    with pytest.raises(UserError, match=message):
        _loaded(single, good)
    tokenizer = _copy(llama, tmp_path, "tokenizer")  # any file of the directory, not only weights
    (tokenizer / "tokenizer.json").unlink()
    (tokenizer / "tokenizer.json").symlink_to(_outside_file(tmp_path, llama / "tokenizer.json"))
    with pytest.raises(UserError, match="tokenizer.json is a link to .*, outside the directory"):
        _preset(tokenizer)

    snapshot = hub_cache(sharded, tmp_path / "models--t--sharded")
    other = hub_cache(sharded, tmp_path / "models--t--other")
    shard = sorted(snapshot.glob("model-*.safetensors"))[1]
    for target in (_outside_file(tmp_path, shard), other / shard.name):
        shard.unlink()
        shard.symlink_to(target)
        with pytest.raises(UserError, match=f"{shard.name} is a link to .*, outside the") as e:
            _preset(snapshot)
        assert "(its hub cache's blobs/)" in str(e.value) and "\n" not in str(e.value)


# --- code in the directory -----------------------------------------------------------------------


def trap(directory: Path, marker: Path, tokenizer_from: Path) -> Path:
    """A directory whose tokenizer and model classes exist only as its own Python files
    (``auto_map``), each of which writes ``marker`` when imported; its tokenizer.json is a
    real one (``tokenizer_from``'s)."""
    directory.mkdir()
    shutil.copyfile(tokenizer_from / "tokenizer.json", directory / "tokenizer.json")
    plant = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('the code ran')\n"
    (directory / "tokenization_trap.py").write_text(
        plant + "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class TrapTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    (directory / "configuration_trap.py").write_text(plant)
    (directory / "modeling_trap.py").write_text(plant)
    tokenizer_config = {
        "tokenizer_class": "TrapTokenizer",
        "auto_map": {"AutoTokenizer": [None, "tokenization_trap.TrapTokenizer"]},
        "eos_token": "</s>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = {
        "model_type": "trap",
        "auto_map": {
            "AutoConfig": "configuration_trap.TrapConfig",
            "AutoModelForCausalLM": "modeling_trap.TrapModel",
        },
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def terminal_says_yes(monkeypatch):
    """Standard input is a pseudo-terminal that has already typed ``y`` and Enter, several
    times: transformers, left to decide, asks "run the custom code? [y/N]" there and reads yes."""
    master, slave = os.openpty()
    os.write(master, b"y\n" * 8)
    tty = os.fdopen(slave, "r")
    assert tty.isatty()
    monkeypatch.setattr(sys, "stdin", tty)
    yield
    tty.close()
    os.close(master)


@pytest.mark.parametrize("command", ["generate", "prepare"])
def test_code_in_auto_map_never_runs_even_at_a_terminal(
    llama, tmp_path, monkeypatch, capsys, terminal_says_yes, command
):
    """``anneal generate DIR`` and ``anneal data prepare --tokenizer DIR`` (its tokenizer loaded
    in this process, as ``--init-from``'s tokenizer check loads it): exit 2, one paragraph,
    the marker never written, nothing created at ``--out``."""
    from anneal.cli import main
    from anneal.data import make_tokenizer

    marker = tmp_path / "MARKER"
    directory = trap(tmp_path / "trap", marker, llama)
    if command == "generate":
        argv = ["generate", str(directory), "--prompt", "hello"]
    else:
        monkeypatch.setattr(make_tokenizer, "_in_child", lambda fn, *args: fn(*args))
        text = tmp_path / "text.txt"
        text.write_text("some text to prepare\n\n" * 50)
        out = tmp_path / "prepared"
        argv = ["data", "prepare", "--input", str(text), "--out", str(out)]
        argv += ["--tokenizer", str(directory), "--workers", "1", "--quiet"]
    assert main(argv) == 2
    out_text, err_text = capsys.readouterr()
    assert not marker.exists()
    assert "Do you wish to run the custom code" not in out_text + err_text  # never asked
    [error] = [line for line in err_text.splitlines() if "error:" in line]
    assert f"anneal {argv[0]}: error: " in error and "Traceback" not in err_text
    assert "exists only as Python code in the directory (auto_map" in error
    assert "trust_remote_code=False" in error and str(directory) in error
    assert command == "generate" or not out.exists()
