"""The parallel layout of a launch: world size = tensor-parallel degree x data-parallel size.

Tensor parallelism is DeepSpeed's AutoTP training: ``"tensor_parallel": {"autotp_size": N}`` in
the ds_config (or ``--set ds.tensor_parallel.autotp_size=N``) makes ``deepspeed.initialize``
shard every layer of the Llama model by the model's own Hugging Face ``tp_plan`` (q, k, v, gate
and up column-wise, o and down row-wise, the LM head column-wise with its output gathered) over
groups of N consecutive ranks. The ranks of one group compute one model replica, so they read
the same samples, and everything that counts replicas (the batch arithmetic, the token stream's
sharding, validation) counts data-parallel ranks: world / N. Everything here is checked before
any process starts: the launcher's pre-flight resolves the launch through this same code.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from anneal.errors import UserError


@dataclasses.dataclass(frozen=True)
class Layout:
    world_size: int
    tensor_parallel: int
    """Ranks per tensor-parallel group (1: none)."""

    @property
    def data_parallel(self) -> int:
        """Model replicas, each reading its own samples: world / tensor-parallel degree."""
        return self.world_size // self.tensor_parallel

    def describe(self) -> str:
        if self.tensor_parallel == 1:
            return f"{self.world_size} rank(s)"
        return (
            f"{self.world_size} ranks = tensor-parallel {self.tensor_parallel} x data-parallel "
            f"{self.data_parallel}"
        )


def tensor_parallel_size(ds: dict) -> int:
    """``tensor_parallel.autotp_size`` of a ds_config; DeepSpeed takes 0 and 1 as off."""
    return max(1, int(ds.get("tensor_parallel", {}).get("autotp_size", 0)))


def layout(ds: dict, preset, *, world_size: int, source: str, exports: bool = False) -> Layout:
    """The launch's layout, refused (UserError) where AutoTP would not shard this model evenly
    over these ranks (a world size that does not split into groups, query or key-value heads
    that do not divide by the degree) and with ``exports`` (``train.export_every_save``), as
    export does not read tensor-parallel checkpoints yet. Any ZeRO stage goes with it."""
    tp = tensor_parallel_size(ds)
    if tp == 1:
        return Layout(world_size, 1)
    fix = f"Set ds.tensor_parallel.autotp_size (now {tp}, from {source} or --set)"
    if world_size % tp:
        raise UserError(
            f"{source}: tensor_parallel.autotp_size is {tp} but the launch has {world_size} "
            f"rank(s), which do not split into tensor-parallel groups of {tp}. {fix} to a "
            f"divisor of {world_size}, or launch a multiple of {tp} ranks."
        )
    uneven = preset.heads_not_dividing(tp)
    if uneven:
        raise UserError(
            f"{source}: tensor_parallel.autotp_size {tp} does not divide the model's "
            f"{', '.join(uneven)}: AutoTP deals whole heads to the {tp} ranks of a group, so "
            f"some would do more attention work than others (or none, past the key-value head "
            f"count) while all wait for the slowest. {fix} to a divisor of the head counts, or "
            f"change them (--set model.num_attention_heads=...)."
        )
    if exports:
        raise UserError(
            f"{source}: tensor_parallel.autotp_size {tp} with train.export_every_save: "
            f"`anneal export` does not read tensor-parallel checkpoints yet, so every export "
            f"would fail. Drop --set train.export_every_save=true, or train without tensor "
            f"parallelism."
        )
    return Layout(world_size, tp)


def check_resume_layout(tag_dir: Path, manifest: dict, here: Layout) -> None:
    """A checkpoint resumes only at the tensor-parallel degree it was saved at, and with
    tensor parallelism only on as many ranks: each rank's files hold its own slices of the
    sharded matrices, and DeepSpeed's checkpoint loading (its universal-checkpoint conversion
    included) does not re-slice AutoTP weights for another degree."""
    saved_tp = manifest.get("tensor_parallel_size", 1)
    saved_ranks = manifest.get("world_size")
    if not isinstance(saved_tp, int) or isinstance(saved_tp, bool):
        return
    if saved_tp != here.tensor_parallel:
        raise UserError(
            f"--resume {tag_dir}: saved with tensor-parallel degree {saved_tp} (its manifest) "
            f"and this launch has {here.tensor_parallel}. Each rank's checkpoint files hold its "
            f"own slices of the sharded weights, and DeepSpeed does not re-slice AutoTP weights "
            f"on load. Resume with --set ds.tensor_parallel.autotp_size={saved_tp} on "
            f"{saved_ranks or 'as many'} ranks, or start a new run in a new --out."
        )
    if here.tensor_parallel > 1 and isinstance(saved_ranks, int) and saved_ranks != here.world_size:
        raise UserError(
            f"--resume {tag_dir}: saved by {saved_ranks} ranks with tensor parallelism "
            f"{saved_tp}, and this launch has {here.world_size} ranks. A tensor-parallel "
            f"checkpoint resumes only on the topology that saved it (DeepSpeed's universal "
            f"checkpoint, which Anneal uses for other world sizes, does not re-slice AutoTP "
            f"weights): resume with {saved_ranks} ranks."
        )
