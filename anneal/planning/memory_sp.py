"""Ulysses sequence parallelism in the memory estimate: what it splits and what it does not.

With ``sequence_parallel_size`` s (DeepSpeed Ulysses, anneal/train/sequence.py) each of the s
consecutive ranks of a group holds 1/s of every sequence. The embedding, the norms, the MLP,
the LM head and the loss run on the rank's slice of ``b x seq/s`` tokens; around the attention
an all-to-all trades sequence for heads, so the attention's tensors (the whole sequence for 1/s
of the heads, query and key-value alike) are the size of the slice's. So every tensor a layer
keeps for backward, each checkpointed layer input and the logits are those of ``seq/s`` tokens:
the estimate is the one at ``seq/s``. Ulysses keeps no ``a x s x s`` scores (SDPA or flash;
eager attention is refused, by Anneal and here: the layouts Ulysses runs are
``anneal.model.layout_rules``').

The weights are not split: every rank holds the whole model before ZeRO, and DeepSpeed
partitions ZeRO over the sequence-data-parallel group, all the ranks of the world
(``deepspeed/runtime/engine.py`` gives ZeRO ``dp_process_group=self.seq_data_parallel_group``),
not over the world / s replicas. So the model states per GPU are plain ZeRO's over all n GPUs:
SP costs nothing there, and at a fixed world it lowers the tokens per step by s (the global
batch counts replicas, world / s). Not counted: the all-to-alls' transient copies of q, k, v
and the attention output. Measured on CPU (tests/planning/test_memory_parallel.py, fp32, hidden 768,
SP=2), a rank's peak RSS grew by 234 MiB from sequence 32 to 256 where this estimate grows by
159, but by 108 MiB with glibc's mmap threshold fixed at 128 KiB (freed tensors then leave the
resident set): the excess is freed memory glibc keeps, not tensors this estimate misses.
"""

from __future__ import annotations

import dataclasses


def local_workload(work):
    """``work`` (a ``memory.Workload``) as one rank of a sequence-parallel group sees it: its
    ``seq / sp`` tokens of each sequence (the layout checked first: ``memory_layout``)."""
    return dataclasses.replace(work, seq_len=work.seq_len // work.sp)
