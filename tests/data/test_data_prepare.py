"""``anneal data prepare`` turns every input format into the same exact, reproducible shards.

Proves: every document of text files, directories (with glob filters), JSON Lines, gzip,
Parquet and a ``datasets`` ``save_to_disk`` directory comes back byte for byte when its ids are
read from the shards through the document index; the validation split is exactly the documents
whose name hashes below the fraction, plus the smallest-hash document of a source that would
otherwise have none (prepare prints each source's counts); reruns, any ``--workers`` and any
work-unit size give byte-identical shards; shards respect their size bound; counts in meta.json
add up (tokens, bytes = sum of token_bytes over the ids, documents); weights are recorded; and
``--input stdlib`` still prepares through the CLI.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from anneal.cli import main
from anneal.data import tokenizer as toklib
from anneal.data.pack import is_validation
from anneal.data.prepare import prepare
from anneal.data.prepared_dir import PreparedDir
from anneal.errors import UserError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _texts() -> dict[str, str]:
    """Real files nobody here wrote: the json and email packages (about 400 KB)."""
    files = sorted((STDLIB / "json").glob("*.py")) + sorted((STDLIB / "email").glob("*.py"))
    return {f"{p.parent.name}/{p.name}": p.read_text(encoding="utf-8") for p in files}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for name, text in _texts().items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tokenizer_model(corpus, tmp_path_factory) -> Path:
    """A small BPE model, reused so that most tests skip training."""
    out = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    toklib.train_sentencepiece(_texts().values(), vocab_size=700, out_path=out)
    return out


def _meta(out: Path) -> dict:
    return json.loads((out / "meta.json").read_text())


def read_documents(out: Path, split: str) -> dict[str, list[str]]:
    """Decoded documents of each source, cut at the ends recorded in the document index."""
    meta = _meta(out)
    tok = toklib.load(out)
    docs = {}
    for s, source in enumerate(meta["sources"]):
        info = meta["splits"][split]["sources"][source["name"]]
        shards = [sh for sh in meta["splits"][split]["shards"] if sh["source"] == s]
        ids = np.concatenate(
            [np.fromfile(out / split / sh["file"], dtype=meta["dtype"]) for sh in shards]
            or [np.zeros(0, meta["dtype"])]
        ).astype(np.int64)
        ends = (
            np.fromfile(out / split / info["doc_index"], dtype="<u8").astype(np.int64)
            if info["doc_index"]
            else np.zeros(0, np.int64)
        )
        assert len(ends) == info["documents"] and (not len(ends) or ends[-1] == len(ids))
        starts = np.concatenate([[0], ends[:-1]])
        assert all(ids[e - 1] == meta["eos_id"] for e in ends)
        spans = zip(starts, ends, strict=True)
        docs[source["name"]] = [tok.decode(ids[a : b - 1].tolist()) for a, b in spans]
    return docs


def _file_digests(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in ("meta.json", "provenance.json")
    }


def _stable_meta(out: Path) -> dict:
    """meta.json: the same bytes for every run of the same prepare (the timings and the command
    are provenance.json's)."""
    return _meta(out)


def test_text_directory_round_trips_and_splits_by_document(corpus, tmp_path):
    out = tmp_path / "out"
    meta = prepare(
        inputs=[str(corpus)],
        out=out,
        vocab_size=700,
        val_fraction=0.2,
        workers=2,
        progress=False,
    )
    texts = _texts()
    label = corpus.name
    want_val = {n for n in texts if is_validation(label, n, val_fraction=0.2)}
    assert 0 < len(want_val) < len(texts)
    docs = {split: read_documents(out, split)[label] for split in ("train", "val")}
    assert sorted(docs["val"]) == sorted(texts[n] for n in want_val)
    assert sorted(docs["train"]) == sorted(texts[n] for n in texts if n not in want_val)
    # Counts add up, and bytes are exactly what token_bytes.npy credits to the ids.
    token_bytes = np.load(out / "token_bytes.npy")
    for split in ("train", "val"):
        info = meta["splits"][split]
        ids = np.concatenate(
            [np.fromfile(out / split / s["file"], dtype=meta["dtype"]) for s in info["shards"]]
        )
        assert len(ids) == info["tokens"] == sum(s["tokens"] for s in info["shards"])
        assert info["bytes"] == sum(len(t.encode()) for t in docs[split])
        assert int(token_bytes[ids].sum()) == info["bytes"]
        assert info["documents"] == len(docs[split])
    assert meta["tokenizer"] == {
        "kind": "sentencepiece",
        "trained": True,
        "model_type": "bpe",
        "sample_bytes": meta["tokenizer"]["sample_bytes"],
    }
    assert 0 < meta["tokenizer"]["sample_bytes"] <= meta["splits"]["train"]["bytes"]


def test_reruns_workers_and_unit_sizes_give_identical_shards(corpus, tmp_path):
    """Tokenizer training included: the whole directory but meta's timing is reproducible."""
    outs = []
    for i, (workers, unit_bytes) in enumerate([(1, 4 << 20), (1, 4 << 20), (2, 8192), (3, 50_000)]):
        out = tmp_path / f"out{i}"
        prepare(
            inputs=[str(corpus)],
            out=out,
            vocab_size=700,
            workers=workers,
            unit_bytes=unit_bytes,
            shard_tokens=20_000,
            val_fraction=0.3,  # 25 files: a validation split of a few of them
            progress=False,
        )
        outs.append(out)
    first = _file_digests(outs[0])
    assert len([f for f in first if f.endswith(".bin") and "_docs" not in f]) > 3
    for out in outs[1:]:
        assert _file_digests(out) == first
        assert _stable_meta(out) == _stable_meta(outs[0])
        assert (out / "meta.json").read_bytes() == (outs[0] / "meta.json").read_bytes()
        assert PreparedDir(out).content_sha256() == PreparedDir(outs[0]).content_sha256()


def test_shards_are_bounded_and_listed_with_hashes(corpus, tokenizer_model, tmp_path):
    out = tmp_path / "out"
    meta = prepare(
        inputs=[str(corpus)],
        out=out,
        tokenizer=tokenizer_model,
        shard_tokens=10_000,
        workers=2,
        val_fraction=0.0,
        progress=False,
    )
    shards = meta["splits"]["train"]["shards"]
    assert all(s["tokens"] <= 10_000 for s in shards)
    assert all(s["tokens"] == 10_000 for s in shards[:-1])
    for s in shards:
        data = (out / "train" / s["file"]).read_bytes()
        assert len(data) == 2 * s["tokens"]
        assert hashlib.sha256(data).hexdigest() == s["sha256"]


def test_include_and_exclude_globs(corpus, tokenizer_model, tmp_path):
    out = tmp_path / "out"
    prepare(
        inputs=[str(corpus)],
        out=out,
        tokenizer=tokenizer_model,
        include=["email/*"],
        exclude=["*/_*"],
        val_fraction=0.0,
        progress=False,
    )
    texts = _texts()
    want = [t for n, t in texts.items() if n.startswith("email/") and "/_" not in n]
    assert sorted(read_documents(out, "train")[corpus.name]) == sorted(want)


def test_jsonl_gzip_parquet_and_saved_dataset_inputs(tokenizer_model, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = list(_texts().values())
    rows = [{"id": i, "content": t} for i, t in enumerate(texts)]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n\n" for r in rows[:6]))  # blank lines are fine
    gz = tmp_path / "b.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[6:12])
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(rows[12:20]), parquet, row_group_size=3)
    saved = tmp_path / "d_saved"
    datasets.Dataset.from_list(rows[20:]).save_to_disk(str(saved))
    out = tmp_path / "out"
    meta = prepare(
        inputs=[str(jsonl), str(gz), str(parquet), str(saved)],
        out=out,
        tokenizer=tokenizer_model,
        text_field="content",
        val_fraction=0.0,
        workers=2,
        unit_bytes=20_000,
        progress=False,
    )
    assert [s["kind"] for s in meta["sources"]] == ["files", "files", "files", "arrow"]
    docs = read_documents(out, "train")
    assert docs["a.jsonl"] == texts[:6]
    assert docs["b.jsonl.gz"] == texts[6:12]
    assert docs["c.parquet"] == texts[12:20]
    assert docs["d_saved"] == texts[20:]


def test_plain_gzip_text_and_a_file_larger_than_a_unit(tokenizer_model, tmp_path):
    big = "".join(_texts().values())
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "big.txt").write_text(big, encoding="utf-8")
    with gzip.open(tmp_path / "in" / "small.txt.gz", "wt", encoding="utf-8") as f:
        f.write("hello\nworld\n")
    out = tmp_path / "out"
    prepare(
        inputs=[str(tmp_path / "in")],
        out=out,
        tokenizer=tokenizer_model,
        val_fraction=0.0,
        unit_bytes=30_000,
        workers=2,
        progress=False,
    )
    assert read_documents(out, "train")["in"] == [big, "hello\nworld\n"]


def test_weights_are_recorded(corpus, tokenizer_model, tmp_path):
    jsonl = tmp_path / "web.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts().values()))
    out = tmp_path / "out"
    meta = prepare(
        inputs=[f"{jsonl}:0.7", f"{corpus}:0.3"],
        out=out,
        tokenizer=tokenizer_model,
        val_fraction=0.0,
        progress=False,
    )
    assert meta["blend"] == "weighted"
    assert [(s["name"], s["weight"]) for s in meta["sources"]] == [
        ("web.jsonl", 0.7),
        (corpus.name, 0.3),
    ]
    per_source = meta["splits"]["train"]["sources"]
    assert sum(v["tokens"] for v in per_source.values()) == meta["splits"]["train"]["tokens"]
    with pytest.raises(UserError, match="Give every input a weight"):
        prepare(inputs=[f"{jsonl}:0.7", str(corpus)], out=tmp_path / "o2", progress=False)


def test_stdlib_through_the_cli(stdlib_prepared, capsys):
    """The session's stdlib corpus (tests/conftest.py) was prepared by ``anneal data prepare
    --input stdlib`` through ``anneal.cli.main``; its output and result are checked here."""
    out, printed_out, printed_err = stdlib_prepared
    assert "prepared" in printed_out and "MB/s" in printed_err
    meta = _meta(out)
    assert meta["vocab_size"] == 8192 and meta["dtype"] == "uint16"
    assert meta["splits"]["train"]["documents"] > 500 and meta["splits"]["val"]["documents"] > 0
    assert "command" not in meta and "seconds" not in meta  # provenance.json's, below
    made = json.loads((out / "provenance.json").read_text())
    assert made["command"].startswith("anneal ") and made["seconds"] > 0
    # Rerunning without --force refuses; with it, replaces.
    assert main(["data", "prepare", "--input", "stdlib", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err


def test_dataset_dict_split_and_streamed_local_dataset(tokenizer_model, tmp_path):
    """A saved DatasetDict by split, and ``hf:PATH?streaming=1`` (records read by the parent
    and sent to the workers in batches) give the same documents."""
    import datasets

    texts = list(_texts().values())
    saved = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": texts[:5]}),
            "test": datasets.Dataset.from_dict({"text": texts[5:9]}),
        }
    ).save_to_disk(str(saved))
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "part.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[9:]))
    out = tmp_path / "out"
    meta = prepare(
        inputs=[str(saved), f"hf:{saved}?split=test", f"hf:{raw}?streaming=1"],
        out=out,
        tokenizer=tokenizer_model,
        val_fraction=0.0,
        unit_bytes=30_000,
        workers=2,
        progress=False,
    )
    assert [s["kind"] for s in meta["sources"]] == ["arrow", "arrow", "hub"]
    docs = read_documents(out, "train")
    names = [s["name"] for s in meta["sources"]]
    assert docs[names[0]] == texts[:5]
    assert docs[names[1]] == texts[5:9]
    assert docs[names[2]] == texts[9:]
    with pytest.raises(UserError, match="has splits train, test"):
        prepare(inputs=[f"hf:{saved}?split=dev"], out=tmp_path / "o2", progress=False)


def test_unigram_tokenizer_trains_after_torch_ran_in_the_same_process(corpus, tmp_path):
    """torch's OpenMP pool, once it has run an op, is inherited by a forked child without its
    threads, and SentencePiece's unigram trainer calls into that libgomp: in a forked child it
    hung for ever (CI lost 90 minutes to it). The tokenizer trains in a fresh interpreter."""
    script = (
        "import sys, torch\n"
        "a = torch.randn(512, 512); (a @ a).sum()  # starts the OpenMP pool\n"
        "from anneal.data.prepare import prepare\n"
        "meta = prepare(inputs=[sys.argv[1]], out=sys.argv[2], vocab_size=500,\n"
        "               model_type='unigram', val_fraction=0.3, workers=2, progress=False)\n"
        "print('model_type', meta['tokenizer']['model_type'])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(corpus), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model_type unigram" in proc.stdout
    assert toklib.load(tmp_path / "out").vocab_size == 500


def test_the_prepare_command_does_not_import_torch(corpus, tokenizer_model, tmp_path):
    """`anneal data prepare` never builds a model. Importing torch (as building the CLI's
    parser once did, through the planning commands' presets) cost it 2-3 s and about 200 MB:
    the 1.3 GB memory benchmark's peak went from 115 to 297 MiB of summed PSS, over its 128 MiB
    cap. Its forked workers would also inherit torch's OpenMP state (see above)."""
    script = (
        "import sys\n"
        "from anneal.cli import main\n"
        "rc = main(['data', 'prepare', '--input', sys.argv[1], '--tokenizer', sys.argv[2],\n"
        "           '--out', sys.argv[3], '--workers', '2', '--val-fraction', '0.3', '--quiet'])\n"
        "print('rc', rc, 'heavy', sorted({m.split('.')[0] for m in sys.modules}\n"
        "                                 & {'torch', 'deepspeed', 'transformers'}))\n"
    )
    args = [str(corpus), str(tokenizer_model), str(tmp_path / "out")]
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "rc 0 heavy []", proc.stderr[-3000:]
    assert _meta(tmp_path / "out")["splits"]["train"]["tokens"] > 0


def test_every_source_of_a_blend_gets_a_validation_document(corpus, tokenizer_model, tmp_path):
    """26 files at the default --val-fraction 0.02 whose names all hash above it got no
    validation document, silently. Now a source of 2 or more documents whose hashes all lie
    above the fraction holds out its smallest-hash document (deterministic: the same one for
    any --workers), and prepare prints each source's train and val counts."""
    small = tmp_path / "notes"
    small.mkdir()
    names: list[str] = []
    i = 0
    while len(names) < 26:  # names none of which the hash alone would hold out
        name, i = f"note{i:03d}.txt", i + 1
        if not is_validation("notes", name, val_fraction=0.02):
            names.append(name)
    for name in names:
        (small / name).write_text(f"the notes of {name}\n" * 40, encoding="utf-8")

    def hash_of(label: str, name: str) -> int:
        return int.from_bytes(hashlib.sha256(f"{label}/{name}".encode()).digest()[:8], "little")

    want = min(names, key=lambda n: hash_of("notes", n))
    shards = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        argv = ["data", "prepare", "--input", str(corpus), "--input", str(small)]
        argv += ["--out", str(out), "--tokenizer", str(tokenizer_model), "--quiet"]
        assert main([*argv, "--workers", str(workers)]) == 0
        meta = _meta(out)
        per_source = {s: meta["splits"][s]["sources"]["notes"] for s in ("train", "val")}
        assert (per_source["train"]["documents"], per_source["val"]["documents"]) == (25, 1)
        assert read_documents(out, "val")["notes"] == [(small / want).read_text()]
        assert meta["splits"]["val"]["sources"][corpus.name]["documents"] >= 1
        shards.append(_file_digests(out))
    assert shards[0] == shards[1]


def test_prepare_prints_each_sources_validation_counts(corpus, tokenizer_model, tmp_path, capsys):
    """With several inputs, prepare's summary has a line per source with its train and val
    documents and tokens, so a source without validation data shows."""
    jsonl = tmp_path / "web.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts().values()))
    out = tmp_path / "out"
    argv = ["data", "prepare", "--input", str(jsonl), "--input", str(corpus), "--out", str(out)]
    argv += ["--tokenizer", str(tokenizer_model), "--val-fraction", "0.3", "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    meta = _meta(out)
    for name in ("web.jsonl", corpus.name):
        val = meta["splits"]["val"]["sources"][name]
        train = meta["splits"]["train"]["sources"][name]
        line = next(ln for ln in printed.splitlines() if ln.strip().startswith(f"{name}:"))
        assert f"train {train['tokens']:,} tokens / {train['documents']} docs" in line
        assert f"val {val['tokens']:,} tokens / {val['documents']} docs" in line
