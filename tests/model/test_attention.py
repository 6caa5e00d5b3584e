"""The one choice of the attention a run trains with (``anneal.model.attention``), resolved
for a GPU on this machine without one: the choosing function takes "is there a GPU, is
flash-attn installed, bf16 or fp32, the Ulysses degree, the micro-batch" as plain inputs.
Without document masking every launch keeps SDPA and no position ids, as before; with it,
flash-attn's varlen kernel where it can read the documents (a GPU, flash-attn, half
precision; a micro-batch of one row under Ulysses, the rows made one without), and SDPA with
the block-causal mask everywhere else, each with the reason that ``describe()`` prints."""

from __future__ import annotations

import pytest

from anneal.model.attention import FLASH_ATTENTION_2, SDPA, Attention, choose_attention

GPU = dict(device_type="cuda", half_precision=True, flash_attn_installed=True)


def _choose(mask=True, **given):
    return choose_attention(document_mask=mask, eos_id=1 if mask else None, **{**GPU, **given})


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_without_masking_every_launch_keeps_sdpa(device):
    for flash in (False, True):
        chosen = _choose(False, device_type=device, flash_attn_installed=flash, micro_batch=4)
        assert chosen == Attention()
        assert (chosen.implementation, chosen.eos_id, chosen.flat_batch) == (SDPA, None, False)
        assert "no document masking" in chosen.describe()


def test_a_gpu_with_flash_attn_masks_in_its_varlen_kernel():
    one = _choose(micro_batch=1)
    assert (one.implementation, one.flat_batch, one.eos_id) == (FLASH_ATTENTION_2, False, 1)
    rows = _choose(micro_batch=4)  # transformers reads packed positions at batch 1 only
    assert (rows.implementation, rows.flat_batch) == (FLASH_ATTENTION_2, True)
    ulysses = _choose(sequence_parallel=2, micro_batch=1)
    assert (ulysses.implementation, ulysses.flat_batch) == (FLASH_ATTENTION_2, False)
    assert "variable-length kernel" in rows.describe()
    assert "documents masked (each ends at id 1" in rows.describe()


@pytest.mark.parametrize(
    "given, why",
    [
        (dict(device_type="cpu", half_precision=False, flash_attn_installed=False), "CPU"),
        (dict(flash_attn_installed=False), "pip install flash-attn"),
        (dict(half_precision=False), "needs bf16 or fp16"),
        (dict(sequence_parallel=2, micro_batch=2), "micro-batch of 1"),
    ],
)
def test_everywhere_else_sdpa_with_the_block_causal_mask(given, why):
    chosen = _choose(**given)
    assert (chosen.implementation, chosen.flat_batch, chosen.eos_id) == (SDPA, False, 1)
    assert "block-causal mask" in chosen.describe() and why in chosen.describe()
