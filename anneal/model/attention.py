"""Which attention implementation a run trains with: chosen here and nowhere else
(``choose_attention``, a pure function of what the launch knows), printed by the launch's
``describe()`` and recorded in ``config.json`` (``launch.attention``).

Without ``data.document_mask`` every run trains with SDPA, as it always has: no mask is built
and SDPA takes its causal flag, so on a GPU it runs its flash kernel.

With ``data.document_mask`` each token attends only within its document
(``anneal.data.documents``), and the way to mask differs by kernel:

- ``flash_attention_2`` (the ``flash-attn`` package, a GPU, bf16 or fp16): its variable-length
  kernel reads the documents from the position ids and skips the masked blocks, so masking
  costs nothing beyond the kernel. transformers 5.24 reads packed position ids there only for a
  batch of one row (``modeling_flash_attention_utils._is_packed_sequence``), so the micro-batch
  is handed to the model as one row of ``B x T`` tokens (``flat_batch``): each window starts a
  document at position 0, so the rows stay apart. Under Ulysses sequence parallelism a batch of
  rows cannot be made one (DeepSpeed's Ulysses attention takes fixed shapes), so there it is
  chosen only at a micro-batch of one.
- ``sdpa`` everywhere else: transformers builds a boolean block-causal mask (B, 1, T, T) from
  the position ids, and SDPA runs a kernel that takes a mask: on a GPU the memory-efficient
  one in place of the flash kernel.

Eager attention is exact too, and is what tests compare SDPA with; Anneal does not train with
it (Ulysses refuses it, and it holds the full attention matrix).
"""

from __future__ import annotations

import dataclasses
import importlib.util

SDPA = "sdpa"
FLASH_ATTENTION_2 = "flash_attention_2"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attention:
    """The attention of a run and how its documents reach it."""

    implementation: str = SDPA
    """transformers' ``attn_implementation`` the model is built with."""
    eos_id: int | None = None
    """``data.document_mask``: the id that ends a document (position ids restart after it);
    None: no masking, the model gets no position ids (the positions 0 .. T-1 of each window)."""
    flat_batch: bool = False
    """The micro-batch goes to the model as one row of B x T tokens (flash-attn's varlen path)."""
    reason: str = "no document masking: SDPA with its causal flag"

    @property
    def document_mask(self) -> bool:
        return self.eos_id is not None

    def describe(self) -> str:
        if not self.document_mask:
            return f"attention {self.implementation}: {self.reason}"
        return (
            f"attention {self.implementation}, documents masked (each ends at id {self.eos_id}; "
            f"positions restart after it): {self.reason}"
        )


def choose_attention(
    *,
    document_mask: bool,
    eos_id: int | None,
    device_type: str,
    half_precision: bool,
    flash_attn_installed: bool,
    sequence_parallel: int = 1,
    micro_batch: int = 1,
) -> Attention:
    """The attention a launch trains with, from what the launch knows: whether it masks
    documents (and the id that ends one), the device, whether it trains in bf16/fp16, whether
    ``flash_attn`` can be imported (``flash_attn_installed()``), the Ulysses degree and the
    micro-batch. Pure: tests give it a GPU and flash-attn that this machine lacks."""
    if not document_mask:
        return Attention()
    assert eos_id is not None, "document masking needs the data's end-of-text id"
    masked = "a boolean block-causal mask built from the position ids"
    if device_type != "cuda":
        return Attention(eos_id=eos_id, reason=f"{masked}, on a CPU")
    slower = f"{masked}: SDPA leaves its flash kernel for the memory-efficient one"
    if not flash_attn_installed:
        return Attention(eos_id=eos_id, reason=f"{slower} (pip install flash-attn to avoid it)")
    if not half_precision:
        return Attention(eos_id=eos_id, reason=f"{slower} (flash-attn needs bf16 or fp16)")
    if sequence_parallel > 1 and micro_batch > 1:
        return Attention(
            eos_id=eos_id,
            reason=f"{slower} (under Ulysses flash-attn reads documents only at a micro-batch "
            f"of 1; this launch has {micro_batch})",
        )
    return Attention(
        implementation=FLASH_ATTENTION_2,
        eos_id=eos_id,
        flat_batch=sequence_parallel == 1 and micro_batch > 1,
        reason="flash-attn's variable-length kernel reads the documents from the position ids",
    )


def flash_attn_installed() -> bool:
    """Whether the ``flash_attn`` package is importable here (transformers'
    ``flash_attention_2`` needs it)."""
    return importlib.util.find_spec("flash_attn") is not None
