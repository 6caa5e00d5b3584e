"""Documents inside a packed window (``data.document_mask``; docs/training.md, "Documents in a
packed window").

Prepared data holds documents end to end, each followed by its end-of-text token (EOS), and a
window of the token stream cuts through them wherever it falls. The boundaries are read from
the tokens themselves, so every prepared directory, however old, gives them: the EOS ends the
document it follows (as Megatron-LM's ``--reset-position-ids`` and torchtitan's block-causal
mask count it), and the token after it is position 0 of the next document. The part of a
document that a window starts inside also starts at position 0: the window holds no more of it.

The position ids are all a model needs: transformers 5.24 reads a restart of the positions as
a new document (``masking_utils.find_packed_sequence_indices``) and builds the block-causal
mask from them, and RoPE turns the same ids into each token's rotation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def document_positions(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The position of each token of ``ids`` (B, T) within its document, (B, T) int64: the
    distance from the first token of its document in the window, which is the window's first
    token or the token just after an ``eos_id``. A row without ``eos_id`` (but in its last
    place) gets ``0 .. T-1``, the positions of a window without masking."""
    import torch

    index = torch.arange(ids.size(-1), device=ids.device).expand_as(ids)
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, :-1] == eos_id
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first
