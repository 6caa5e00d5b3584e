"""The GPU benchmark's throughput rows (issue 45; docs/throughput.md): torch.compile,
DeepCompile and float8 against eager, at the 1b shape and at an 8B-like shape that fits one
80 GB H100 at ZeRO-1. All optional, each named after its eager twin plus ``-compile``,
``-compile-float8`` or ``-deepcompile``; ``gpu_table.throughput_pairs`` reads each against its
twin (tokens/s, MFU, the loss after the same steps).

Rows are made from the eager 1b row of ``gpu_rows`` (``dataclasses.replace``), so this module
needs nothing of that one's.
"""

from __future__ import annotations

import dataclasses

EIGHT_B_LIKE = (
    "model.hidden_size=4096",
    "model.intermediate_size=14336",
    "model.num_hidden_layers=8",
)
"""Llama 3.1 8B's width (4096, 32 heads of 128) and feed-forward (14336) at 8 of its 32 layers,
on the 7b recipe (Anneal's 7b preset is Llama 2 7B's 4096 wide, 11008 feed-forward; no config
key sets the key-value heads, so attention keeps the preset's 32, where Llama 3 has 8 groups):
2.01B parameters at the stdlib vocabulary of 8192. Why 8 layers: at ZeRO-1 on one GPU, bf16
weights and gradients with fp32 master weights and AdamW moments, and at the optimizer step
torch AdamW's temporaries, Anneal's estimate is 53.5 GiB at 8 layers, 66.2 at 10, 78.9 at 12
(99% of an H100's 79.6 GiB) and 91.6 at 14 (micro-batch 4 x 2048, no activation
checkpointing; ``tests/bench/test_bench_gpu.py`` resolves it and checks the fit). 8 leaves
room for what the estimate does not count (float8's casts, compiled graphs). Each layer's
matrices are 8B's own, which is what float8's gain depends on."""


ISSUE_RUNS = (
    (
        "1b-z1-nockpt",
        "1b-z1-nockpt-compile",
        "1b-z1-nockpt-compile-float8",
        "1b-z1-nockpt-deepcompile",
    ),
    ("8b-8l-z1-nockpt", "8b-8l-z1-nockpt-compile", "8b-8l-z1-nockpt-compile-float8"),
)
"""Issue 45's rows as two runs of ``bash bench/gpu.sh LOGDIR --only ...`` (docs/throughput.md),
each within gpu.sh's budget by the rows' ``est_s`` but for the DeepCompile row, last in the
first run: it runs if the rows before it took less than their guesses, and is otherwise
skipped for time, saying so."""


def throughput_rows(eager_1b) -> list:
    """The optional throughput rows, from ``eager_1b`` (``1b-z1-nockpt``: bf16, ZeRO-1, one GPU):

    - 1b: its twins with torch.compile, torch.compile + float8 (tensorwise, the layers that
      gain by torchao's thresholds: 125 of 127 Linear layers) and DeepCompile (its ``z1`` pass);
    - the 8B-like shape (``EIGHT_B_LIKE``) at ZeRO-1: eager, torch.compile and
      torch.compile + float8, micro-batch 4, 2^16 tokens a step.

    ``est_s`` are guesses until a GPU measures them: the eager row's time and up to 2 minutes
    of compilation (inductor, in the first step)."""
    compiled = dict(optional=True, compile="torch", est_s=150, timeout_s=300)
    eager_8b = dataclasses.replace(
        eager_1b,
        name="8b-8l-z1-nockpt",
        preset="7b",
        extra=EIGHT_B_LIKE,
        micro=4,
        global_tokens=2**16,
        optional=True,
        # building and initialising 2B parameters on the host, then ~2 s a step on an H100
        est_s=100,
        timeout_s=240,
    )
    return [
        dataclasses.replace(eager_1b, name="1b-z1-nockpt-compile", **compiled),
        dataclasses.replace(
            eager_1b, name="1b-z1-nockpt-compile-float8", float8="tensorwise", **compiled
        ),
        eager_8b,
        dataclasses.replace(eager_8b, name="8b-8l-z1-nockpt-compile", **compiled),
        dataclasses.replace(
            eager_8b, name="8b-8l-z1-nockpt-compile-float8", float8="tensorwise", **compiled
        ),
        dataclasses.replace(
            eager_1b, name="1b-z1-nockpt-deepcompile", **{**compiled, "compile": "deepcompile"}
        ),
    ]
