"""Synthetic Markov corpora: the entropy rate recorded is the true one.

Proves: the entropy rate matches closed forms (order 0; a two-state order-1 chain); the
stationary distribution is stationary; on a long sample, the empirical conditional entropy and
context frequencies agree with the computed ones; ``anneal data synth`` is deterministic by
seed and writes what meta.json says; and a prepared copy carries the source's entropy rate.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from anneal.cli import main
from anneal.data.prepare import prepare
from anneal.data.synth import SYMBOLS, MarkovSource
from anneal.errors import UserError


def _h(p: float) -> float:
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def test_entropy_rate_matches_closed_forms():
    a, b = 0.1, 0.4  # P(0 -> 1), P(1 -> 0)
    src = MarkovSource(order=1, alphabet=2, transitions=np.array([[1 - a, a], [b, 1 - b]]))
    pi = np.array([b, a]) / (a + b)
    assert np.allclose(src.stationary(), pi, atol=1e-12)
    assert src.entropy_rate_bits() == pytest.approx(pi[0] * _h(a) + pi[1] * _h(b), abs=1e-12)
    iid = MarkovSource(order=0, alphabet=4, transitions=np.array([[0.5, 0.25, 0.125, 0.125]]))
    assert iid.entropy_rate_bits() == pytest.approx(1.75, abs=1e-12)
    assert iid.unigram_entropy_bits() == pytest.approx(1.75, abs=1e-12)


def test_random_source_agrees_with_a_long_sample():
    src = MarkovSource.random(order=2, alphabet=4, seed=3, concentration=0.5)
    pi = src.stationary()
    nxt = src._next_context()
    assert np.allclose(np.bincount(nxt.ravel(), (pi[:, None] * src.transitions).ravel()), pi)
    draws = src.sample(documents=64, chars=8000, seed=1).astype(np.int64)
    ctx = draws[:, :-2] * 4 + draws[:, 1:-1]  # context of each symbol from the third on
    joint = np.zeros((16, 4))
    np.add.at(joint, (ctx.ravel(), draws[:, 2:].ravel()), 1)
    p_ctx = joint.sum(1) / joint.sum()
    assert np.abs(p_ctx - pi).max() < 0.01
    cond = joint / joint.sum(1, keepdims=True)
    empirical = -(joint / joint.sum() * np.log2(np.where(cond > 0, cond, 1))).sum()
    assert empirical == pytest.approx(src.entropy_rate_bits(), abs=0.01)
    assert src.entropy_rate_bits() < src.unigram_entropy_bits()


def test_cli_writes_deterministic_documents_and_meta(tmp_path, capsys):
    args = [
        "data",
        "synth",
        "--order",
        "1",
        "--alphabet",
        "5",
        "--documents",
        "3",
        "--doc-chars",
        "1000",
    ]
    assert main([*args, "--seed", "7", "--out", str(tmp_path / "a")]) == 0
    assert "entropy rate" in capsys.readouterr().out
    assert main([*args, "--seed", "7", "--out", str(tmp_path / "b")]) == 0
    assert main([*args, "--seed", "8", "--out", str(tmp_path / "c")]) == 0
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())["synth"]
    src = MarkovSource.random(order=1, alphabet=5, seed=7, concentration=0.5)
    assert meta["entropy_bits_per_char"] == pytest.approx(src.entropy_rate_bits(), abs=1e-12)
    files = sorted((tmp_path / "a" / "text").iterdir())
    assert len(files) == meta["documents"] == 3
    for f in files:
        data = f.read_bytes()
        assert len(data) == 1000 and set(data.decode()) <= set(SYMBOLS[:5])
        assert data == (tmp_path / "b" / "text" / f.name).read_bytes()
    assert files[0].read_bytes() != (tmp_path / "c" / "text" / files[0].name).read_bytes()
    assert files[0].read_bytes() != files[1].read_bytes()


def test_prepared_copy_records_the_entropy_rate(tmp_path):
    main(["data", "synth", "--documents", "8", "--doc-chars", "4000", "--out", str(tmp_path / "s")])
    meta = prepare(
        inputs=[str(tmp_path / "s")],
        out=tmp_path / "p",
        vocab_size=300,
        val_fraction=0.5,
        seq_len=64,
        progress=False,
    )
    synth = json.loads((tmp_path / "s" / "meta.json").read_text())["synth"]
    assert meta["sources"][0]["synth"] == synth
    docs = meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"]
    assert docs == 8  # the text files only, not meta.json
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == 8 * 4000


def test_bad_parameters_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="--alphabet 60"):
        MarkovSource.random(order=1, alphabet=60, seed=0, concentration=1.0)
    with pytest.raises(UserError, match="contexts"):
        MarkovSource.random(order=9, alphabet=20, seed=0, concentration=1.0)
