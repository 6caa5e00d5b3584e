"""The GPU benchmark's rows: one configuration each (preset, ZeRO stage, activation
checkpointing, optimizer, batch), the command line that runs it as a recipe process, and the
two tables of rows: the GPU matrix in order of importance and the CPU smoke of the same shape.

A row is data only; ``gpu_measure`` runs one and ``bench_gpu`` decides which run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpu_throughput import throughput_rows

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One configuration: one process, one line of the table."""

    name: str
    preset: str
    zero: int
    ckpt: bool
    optimizer: str
    """torch-foreach | torch-fused | ds-fused (DeepSpeed's FusedAdam, JIT-built with nvcc) |
    muon (``optim.optimizer=muon``: DeepSpeed's MuonWithAuxAdam, AdamW on the embeddings, head,
    norms and router; such a row is named after its AdamW twin plus ``-muon``)."""
    micro: int
    global_tokens: int
    seq_len: int
    warmup: int
    """Steps run and left out of the median (allocator growth, cuBLAS set-up, ZeRO-3 tracing)."""
    measure: int
    """Steps whose tokens/s make the median."""
    est_s: float
    """Expected wall time of the row, to decide whether it still fits before the deadline."""
    timeout_s: float
    precision: str = "bf16"
    ds_config: str = ""
    """A name in ds_configs/; empty: zero{stage}_bf16.json."""
    optional: bool = False
    """An extra row: its failure is reported but does not fail the script."""
    needs_nvcc: bool = False
    loss: str = "chunked"
    """train.loss: chunked (Anneal's default) | plain (the full logits). A plain row is named
    after its chunked twin plus ``-plainloss``; ``gpu_table.reading`` compares the two."""
    recipe: str = ""
    """A file in recipes/; empty: pretrain_{preset}.py (a sparse preset's is pretrain_moe_*)."""
    extra: tuple = ()
    """More ``--set`` overrides of the row's shape (e.g. fewer layers than the preset's)."""
    document_mask: bool = False
    """``data.document_mask``: attention stays inside each document; such a row is named after
    its unmasked twin plus ``-docmask`` (``gpu_table.mask_pairs`` compares the two)."""
    save_every: int = 0
    """``--save-every``: 0, no save in the measured steps; a save row times its saves
    (``gpu_measure.save_figures``), synchronous or, with ``async_save``, in the background."""
    async_save: bool = False
    """``train.async_save``: such a row is named after its synchronous twin with ``async``
    for ``sync`` (``gpu_table.save_pairs`` compares the two)."""
    compile: str = "off"
    float8: str = "off"
    """``train.compile`` and ``train.float8``: such a row is named after its eager twin plus
    ``-compile``, ``-compile-float8`` or ``-deepcompile`` (``gpu_throughput``)."""
    gpu: str = "h100"
    """The smallest GPU (``anneal.hardware.GPUS``) the row is sized for by Anneal's memory
    estimate: on a GPU with less memory ``bench_gpu`` skips it, saying so."""

    @property
    def recipe_path(self) -> Path:
        return REPO / "recipes" / (self.recipe or f"pretrain_{self.preset}.py")

    def sets(self, *, cpu: bool) -> list[str]:
        sets = [
            "train.val_samples=0",  # no validation pass inside the measured steps
            "train.log_every=1",
            f"train.precision={self.precision}",
            f"model.seq_len={self.seq_len}",
            f"model.activation_checkpointing={str(self.ckpt).lower()}",
            f"optim.global_batch_tokens={self.global_tokens}",
            f"ds.train_micro_batch_size_per_gpu={self.micro}",
            f"ds.zero_optimization.stage={self.zero}",
            f"train.loss={self.loss}",
        ]
        if self.optimizer == "muon":  # its section is Anneal's, with no torch_adam key
            sets.append("optim.optimizer=muon")
        else:
            sets.append(
                f"ds.optimizer.params.torch_adam={str(self.optimizer != 'ds-fused').lower()}"
            )
        if self.optimizer == "torch-fused":
            sets.append("ds.optimizer.params.fused=true")
        if self.document_mask:
            sets.append("data.document_mask=true")
        if self.save_every:
            sets.append("train.keep_last=1")  # two checkpoints at most on the disk at a time
        if self.async_save:
            sets.append("train.async_save=true")
        if self.compile != "off":
            sets.append(f"train.compile={self.compile}")
        if self.float8 != "off":
            sets.append(f"train.float8={self.float8}")
        return sets + list(self.extra)

    def command(self, python: str, *, data: Path, out: Path, cpu: bool, inject=()) -> list[str]:
        cmd = [
            python,
            str(self.recipe_path),
            "--data",
            str(data),
            "--out",
            str(out),
            "--ds-config",
            self.ds_config or f"zero{self.zero}_bf16.json",
            "--max-steps",
            "1000000",  # the driver stops it; the schedule's warmup stays long
            "--save-every",
            str(self.save_every),
            "--val-every",
            "0",
            "--resume",
            "none",
        ]
        for item in [*self.sets(cpu=cpu), *inject]:
            cmd += ["--set", item]
        return cmd


def gpu_rows() -> list[Row]:
    """Most important first: 1b ZeRO-1 (off, on), 1b ZeRO-3, then 125m, then the optional rows:
    1b at 32K tokens (chunked and plain loss), then the 2048-token extras."""
    rows = []
    for preset, micro, tokens, est, timeout in (
        # 1b: 64 sequences of 2048 per step (accumulation 8); ~2 s a step at 400 TFLOP/s.
        ("1b", 8, 2**17, 75, 170),
        # 125m: 128 sequences per step (accumulation 8); well under 1 s a step.
        ("125m", 16, 2**18, 40, 110),
    ):
        for zero in (1, 3):
            for ckpt in (False, True):
                rows.append(
                    Row(
                        name=f"{preset}-z{zero}-{'ckpt' if ckpt else 'nockpt'}",
                        preset=preset,
                        zero=zero,
                        ckpt=ckpt,
                        optimizer="torch-foreach",
                        micro=micro,
                        global_tokens=tokens,
                        seq_len=2048,
                        warmup=3,
                        measure=5,
                        est_s=est,
                        timeout_s=timeout,
                    )
                )
    return (
        rows
        + moe_rows()
        + _long_context_rows()
        + document_mask_rows(rows)
        + muon_rows(rows)
        + throughput_rows({r.name: r for r in rows}["1b-z1-nockpt"])
        + _extra_rows()
        + save_rows()
    )


def save_rows() -> list[Row]:
    """The optional pair that times a checkpoint save at the 1b shape (1b-z1-nockpt's), one
    GPU: saves every 3 steps, synchronous and asynchronous (``train.async_save``). A save
    holds bf16 weights and the fp32 master and moments, about 16 GB at 1b; ``keep_last`` 1
    keeps at most two on the disk. Each row's ``save_blocking_s`` (what the loop waited) and
    ``save_write_s`` (the background write) come from its events; its tokens/s median runs over
    the steps themselves (a synchronous save waits between them), so the pair's difference in
    tokens/s is what a write behind the training costs its steps."""
    base = dict(
        preset="1b",
        zero=1,
        ckpt=False,
        optimizer="torch-foreach",
        micro=8,
        global_tokens=2**17,
        seq_len=2048,
        warmup=2,
        measure=10,
        est_s=150,
        timeout_s=300,
        optional=True,
        save_every=3,
    )
    return [
        Row(name="1b-z1-nockpt-syncsave", **base),
        Row(name="1b-z1-nockpt-asyncsave", async_save=True, **base),
    ]


def moe_rows() -> list[Row]:
    """The optional sparse rows, first among the optional ones: tiny-moe, and OLMoE-1B-7B's
    shape at half its depth, on one GPU through AutoEP at ``autoep_size`` 1 (every expert on the
    GPU; resolution turns on AutoEP's grouped GEMMs on a GPU in bf16), bf16, ZeRO-2, torch's
    AdamW. MFU counts active parameters (``anneal.model.flops_per_token``).

    OLMoE whole (6.75B parameters at the stdlib vocabulary of 8192) needs 177 GiB by Anneal's
    estimate at ZeRO-2 on one GPU (100.5 GiB of weights, gradients and AdamW state, and at the
    optimizer step a 25 GiB fp32 gradient partition and 50 GiB of torch AdamW temporaries): it
    fits no single GPU, at any micro-batch or context. 8 of its 16 layers (3.39B parameters,
    0.57B active) need 89.4 GiB: an H200 (141 GB) with room to spare for what the estimate does
    not count of AutoEP's token routing; not an H100 (80 GB). Activations are small beside that
    (micro-batch 4 x 2048 without checkpointing: 3.3 GiB by the estimate), so checkpointing
    stays off. Each layer keeps OLMoE's width, heads, 64 experts of width 1024 and top-8, so a
    token's work per layer is OLMoE's own."""
    return [
        Row(
            name="tiny-moe-z2-nockpt",
            preset="tiny-moe",
            recipe="pretrain_moe_tiny.py",
            zero=2,
            ckpt=False,
            optimizer="torch-foreach",
            micro=16,
            global_tokens=2**17,
            seq_len=2048,
            warmup=3,
            measure=5,
            est_s=45,
            timeout_s=120,
            optional=True,
        ),
        Row(
            name="olmoe-8l-z2-nockpt",
            preset="olmoe-1b-7b",
            recipe="pretrain_moe_1b_7b.py",
            extra=("model.num_hidden_layers=8",),
            zero=2,
            ckpt=False,
            optimizer="torch-foreach",
            micro=4,
            global_tokens=2**15,
            seq_len=2048,
            warmup=2,
            measure=4,
            est_s=150,  # building and initialising 3.4B parameters on the host, then ~1-3 s a step
            timeout_s=330,
            optional=True,
            gpu="h200",
        ),
    ]


def _long_context_rows() -> list[Row]:
    """The optional 1b ZeRO-1 rows at 32K tokens (SP=1, one GPU): the chunked loss and its
    plain twin, whose difference in peak memory is what the chunked loss saves at this context
    (the estimator: 17.58 GiB of plain loss against 0.61 GiB at vocab 32000; the benchmark's
    stdlib vocabulary of 8192 makes the plain loss about a quarter of that). One sequence of
    32768 a micro-batch, 4 of them a step, activation checkpointing on; at ~20 GFLOP a token
    (the attention term is 2.6x the 6N term at 32K) a step is ~8-10 s on an H100/H200. The
    model's context is its seq_len (max_position_embeddings); RoPE keeps the preset's base
    10000, which costs nothing to measure and matters only for what the model learns."""
    base = dict(
        preset="1b",
        zero=1,
        ckpt=True,
        optimizer="torch-foreach",
        micro=1,
        global_tokens=2**17,
        seq_len=32768,
        warmup=2,
        measure=3,
        est_s=120,
        timeout_s=240,
        optional=True,
    )
    return [
        Row(name="1b-z1-ckpt-32k", **base),
        Row(name="1b-z1-ckpt-32k-plainloss", loss="plain", **base),
    ]


def document_mask_rows(rows: list[Row]) -> list[Row]:
    """The optional rows with ``data.document_mask`` on, each the twin of an unmasked row: 1b
    ZeRO-1 at 2048 tokens, and at 32K (its twin among the long-context rows). The cost of
    masking is the pair's difference in tokens/s: nothing beyond the kernel where flash-attn is
    installed (its varlen kernel), the memory-efficient SDPA kernel with a mask where it is not
    (the attention the launch chose is in the row's log: ``describe()``)."""
    twins = {r.name: r for r in [*rows, *_long_context_rows()]}
    return [
        dataclasses.replace(twins[name], name=f"{name}-docmask", document_mask=True, optional=True)
        for name in ("1b-z1-nockpt", "1b-z1-ckpt-32k")
    ]


def muon_rows(rows: list[Row]) -> list[Row]:
    """The optional rows with Muon, each the twin of an AdamW row: 125m and 1b at ZeRO-1 without
    activation checkpointing. Muon's price is the pair's difference in step time (its
    Newton-Schulz iterations on every hidden matrix, once a step; issue 42's goal: at most
    1.10x AdamW's step at the larger shape) and in peak memory (one momentum buffer where AdamW
    keeps two moments)."""
    twins = {r.name: r for r in rows}
    return [
        dataclasses.replace(twins[name], name=f"{name}-muon", optimizer="muon", optional=True)
        for name in ("125m-z1-nockpt", "1b-z1-nockpt")
    ]


def _extra_rows() -> list[Row]:
    """The optional 1b ZeRO-1 rows: the other two optimizers, a micro batch of 16, and the
    plain loss over the full logits (the chunked loss's price or gain, against 1b-z1-nockpt)."""
    base = dict(
        preset="1b",
        zero=1,
        ckpt=False,
        micro=8,
        global_tokens=2**17,
        seq_len=2048,
        warmup=3,
        measure=5,
        est_s=75,
        timeout_s=170,
        optional=True,
    )
    return [
        Row(name="1b-z1-nockpt-torchfused", optimizer="torch-fused", **base),
        Row(
            name="1b-z1-nockpt-dsfused",
            optimizer="ds-fused",
            needs_nvcc=True,
            **{**base, "est_s": 180, "timeout_s": 300},  # + the FusedAdam JIT build
        ),
        Row(name="1b-z1-nockpt-micro16", optimizer="torch-foreach", **{**base, "micro": 16}),
        Row(name="1b-z1-nockpt-plainloss", optimizer="torch-foreach", loss="plain", **base),
    ]


def cpu_rows() -> list[Row]:
    """The CPU smoke: the GPU rows' shape on the tiny preset in fp32 (ds_configs/cpu.json), and
    the sparse rows' on tiny-moe (ds_configs/cpu_zero2.json)."""
    common = dict(
        preset="tiny",
        micro=2,
        global_tokens=2 * 64,
        seq_len=64,
        warmup=1,
        measure=2,
        est_s=20,
        timeout_s=240,
        precision="fp32",
        ds_config="cpu.json",
        optimizer="torch-foreach",
    )
    return [
        Row(name="tiny-z1-nockpt", zero=1, ckpt=False, **common),
        Row(name="tiny-z1-ckpt", zero=1, ckpt=True, **common),
        Row(name="tiny-z3-nockpt", zero=3, ckpt=False, **common),
        # the sparse rows' path: AutoEP (the plain expert loop on CPU), ZeRO-2
        Row(
            name="tiny-moe-z2-nockpt",
            zero=2,
            ckpt=False,
            optional=True,
            **{
                **common,
                "preset": "tiny-moe",
                "recipe": "pretrain_moe_tiny.py",
                "ds_config": "cpu_zero2.json",
            },
        ),
    ]
