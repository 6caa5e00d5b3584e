"""Random garbage into every reader of a file Anneal did not write: a clear error or success,
never a traceback.

Each reader gets a few hundred seeded mutations of a real document (a value anywhere in it
swapped for another type, a huge or negative number, NaN, a path that leaves its directory, a
key dropped) plus raw bytes that are not JSON. What may come out is the reader's result or a
``UserError`` whose message names the file; any other exception fails with the input that
caused it. The readers: the run config (``--set``), the ds_config loader, the hostfile parser,
a checkpoint's manifest (as resume reads it) and a prepared directory's meta.json.
"""

from __future__ import annotations

import copy
import json
import math
import random
import shutil
from pathlib import Path

import pytest

from anneal.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
N = 150  # mutations per reader; all in-process, well under a second each

ODD = [
    None,
    True,
    False,
    0,
    -1,
    -(2**63),
    2**64,
    1e308,
    -1e-308,
    math.nan,
    math.inf,
    "",
    " ",
    "nan",
    "-inf",
    "0x10",
    "../../etc/passwd",
    "/etc/passwd",
    "a\nb",
    "%s%n",
    "é" * 3,
    "x" * 5000,
    [],
    [1, "a"],
    {},
    {"": None},
    3.5,
    "1e999",
]


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def mutations(doc, rng: random.Random, n: int = N):
    """``n`` copies of ``doc``, each with one or two nodes replaced, removed or retyped."""
    paths = [p for p in _paths(doc) if p]
    for _ in range(n):
        new = copy.deepcopy(doc)
        for path in rng.sample(paths, k=min(len(paths), rng.choice([1, 1, 2]))):
            parent = new
            try:
                for k in path[:-1]:
                    parent = parent[k]
                if rng.random() < 0.15 and isinstance(parent, dict):
                    parent.pop(path[-1], None)
                else:
                    parent[path[-1]] = copy.deepcopy(rng.choice(ODD))
            except (KeyError, IndexError, TypeError):
                continue  # an earlier mutation removed or retyped the path
        yield new


def raw_garbage(rng: random.Random, n: int = 30):
    for _ in range(n):
        yield bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
    yield b""
    yield b"[]"
    yield b"null"
    yield b'{"a": 1, "a": 2}'
    yield b"\xff\xfe{}"


def _dump(doc) -> str:
    return json.dumps(doc, allow_nan=True)


def _must_be_clear(fn, what: str, source: str | None = None):
    try:
        fn()
    except UserError as e:
        msg = str(e)
        assert msg.strip(), f"empty message for {what}"
        assert "Traceback" not in msg
        if source:
            assert source in msg, f"the message does not name {source}: {msg}"
    except Exception as e:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{what}: {type(e).__name__}: {e}")


def test_run_config_overrides():
    from anneal.config.run import RunConfig
    from anneal.config.run_checks import apply_overrides

    rng = random.Random(1)
    cfg = RunConfig(out="runs/x", ds_config="cpu.json")
    keys = [
        f"{section}.{k}"
        for section in ("model", "data", "optim", "train", "guard")
        for k in vars(getattr(cfg, section))
    ]
    for _ in range(N * 2):
        value = rng.choice(ODD)
        text = value if isinstance(value, str) else json.dumps(value)
        item = f"{rng.choice(keys)}={text}"
        _must_be_clear(lambda item=item: apply_overrides(cfg, [item]), f"--set {item}", "--set")


def test_ds_config_loader(tmp_path):
    from anneal.resolution.ds import load_ds_config

    rng = random.Random(2)
    shipped = json.loads((ROOT / "ds_configs" / "cpu.json").read_text())
    f = tmp_path / "ds.json"
    for doc in mutations(shipped, rng):
        f.write_text(_dump(doc))
        _must_be_clear(lambda: load_ds_config(f), f"ds_config {_dump(doc)[:300]}", str(f))
    for raw in raw_garbage(rng):
        f.write_bytes(raw)
        _must_be_clear(lambda: load_ds_config(f), f"ds_config bytes {raw[:80]!r}", str(f))


def test_hostfile_parser():
    from launcher.hostfile import parse_text

    rng = random.Random(3)
    good = "node001 slots=8\nnode002 slots=8\n"
    alphabet = "node01 slots=8\n\t#=-.,:;$`'\"\\/é\x00"
    for _ in range(N * 2):
        text = list(good)
        for _ in range(rng.randrange(1, 6)):
            text.insert(rng.randrange(len(text) + 1), rng.choice(alphabet))
        text = "".join(text)
        _must_be_clear(lambda text=text: parse_text(text, source="hf"), f"hostfile {text!r}", "hf")


@pytest.fixture(scope="module")
def checkpoint_tree(tmp_path_factory) -> Path:
    """A checkpoints/ directory shaped like a real one (manifest, files, latest), tiny files."""
    from anneal.resilience.checkpoint import HASH, file_hash

    ckpt = tmp_path_factory.mktemp("run") / "checkpoints"
    tag = ckpt / "step00000002"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"model" * 10)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optim" * 10)
    files = {p.name: {"size": p.stat().st_size, HASH: file_hash(p)} for p in tag.iterdir()}
    manifest = {"step": 2, "world_size": 1, "tokenizer_sha256": "ab" * 32, "files": files}
    (tag / "manifest.json").write_text(json.dumps(manifest))
    (ckpt / "latest").write_text("step00000002")
    return ckpt


def test_checkpoint_manifest(tmp_path, checkpoint_tree):
    from anneal.resilience import checkpoint

    rng = random.Random(4)
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(checkpoint_tree, ckpt)
    tag = ckpt / "step00000002"
    good = json.loads((tag / "manifest.json").read_text())
    outside = tmp_path / "secret"
    outside.write_text("not yours")

    def read_as_resume():
        found = checkpoint.find_resume("auto", ckpt)
        if found is not None:
            checkpoint.damaged_files(found)
            checkpoint.check_checkpoint_tokenizer(
                found, data_dir=tmp_path, tokenizer_sha256="cd" * 32
            )

    for doc in mutations(good, rng):
        (tag / "manifest.json").write_text(_dump(doc))
        _must_be_clear(read_as_resume, f"manifest {_dump(doc)[:300]}")
    for raw in raw_garbage(rng):
        (tag / "manifest.json").write_bytes(raw)
        _must_be_clear(read_as_resume, f"manifest bytes {raw[:80]!r}")
    assert outside.read_text() == "not yours"


@pytest.fixture(scope="module")
def tiny_prepared(tmp_path_factory) -> Path:
    """A real prepared directory from a few kilobytes of text (a byte-level vocabulary)."""
    from anneal.data.prepare import prepare

    src = tmp_path_factory.mktemp("src") / "text.txt"
    src.write_text("\n\n".join(f"document {i}: " + "the quick brown fox " * 40 for i in range(40)))
    out = tmp_path_factory.mktemp("prep") / "data"
    prepare(inputs=[str(src)], out=out, vocab_size=300, seq_len=16, shard_tokens=1024)
    return out


def test_prepared_meta(tmp_path, tiny_prepared):
    from anneal.data.checks import check_prepared

    rng = random.Random(5)
    data = tmp_path / "data"
    shutil.copytree(tiny_prepared, data)
    good = json.loads((data / "meta.json").read_text())
    for doc in mutations(good, rng):
        (data / "meta.json").write_text(_dump(doc))
        _must_be_clear(lambda: check_prepared(data), f"meta.json {_dump(doc)[:300]}", "meta.json")
    for raw in raw_garbage(rng):
        (data / "meta.json").write_bytes(raw)
        _must_be_clear(lambda: check_prepared(data), f"meta.json bytes {raw[:80]!r}", "meta.json")
