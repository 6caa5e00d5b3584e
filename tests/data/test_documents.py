"""The documents of a packed window (``anneal.data.documents``): each token's position within
its document, from the end-of-text ids alone, against a plain loop over the tokens (the
reference) and a few cases written out by hand: the EOS ends the document before it, the token
after it is position 0, a window starts a document at 0, empty documents (EOS after EOS) and
an EOS in the last place; the prepared directory gives the EOS id from meta.json and, for an
older directory without it, from its tokenizer."""

from __future__ import annotations

import json

import torch

from anneal.data.documents import document_positions
from anneal.data.prepared_dir import PreparedDir

EOS = 1


def _by_loop(ids: list[int], eos: int) -> list[int]:
    out, at = [], 0
    for token in ids:
        out.append(at)
        at = 0 if token == eos else at + 1
    return out


def test_positions_restart_after_each_eos():
    ids = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, EOS, 4], [EOS, 3, 3, 3, 3, 3, 3, 3, EOS]])
    assert document_positions(ids, EOS).tolist() == [
        [0, 1, 2, 0, 1, 2, 3, 0, 0],
        [0, 0, 1, 2, 3, 4, 5, 6, 7],
    ]


def test_positions_equal_a_loop_over_the_tokens():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (5, 300), generator=g)  # EOS about one token in six
    got = document_positions(ids, EOS)
    assert got.dtype == torch.int64
    assert got.tolist() == [_by_loop(row, EOS) for row in ids.tolist()]


def test_a_window_without_eos_keeps_the_positions_of_no_masking():
    ids = torch.tensor([[4, 5, 6, 7, EOS]])
    assert document_positions(ids, EOS).tolist() == [list(range(5))]


def test_eos_id_from_meta_or_from_an_older_directory_s_tokenizer(tiny_data, tmp_path):
    prepared = PreparedDir(tiny_data)
    meta = json.loads(prepared.meta_file.read_text())
    assert prepared.eos_id(meta) == meta["eos_id"] == EOS
    older = {k: v for k, v in meta.items() if k != "eos_id"}
    assert prepared.eos_id(older) == EOS  # read from tokenizer.model
