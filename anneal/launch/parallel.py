"""The parallel layout of a launch: world size = (tensor- or sequence-parallel degree) x
data-parallel size.

Tensor parallelism is DeepSpeed's AutoTP training: ``"tensor_parallel": {"autotp_size": N}`` in
the ds_config (or ``--set ds.tensor_parallel.autotp_size=N``) makes ``deepspeed.initialize``
shard every layer of the Llama model by the model's own Hugging Face ``tp_plan`` (q, k, v, gate
and up column-wise, o and down row-wise, the LM head column-wise with its output gathered) over
groups of N consecutive ranks. The ranks of one group compute one model replica, so they read
the same samples, and everything that counts replicas (the batch arithmetic, the token stream's
sharding, validation) counts data-parallel ranks: world / N. Everything here is checked before
any process starts: the launcher's pre-flight resolves the launch through this same code.

Sequence parallelism is DeepSpeed's Ulysses (``"sequence_parallel_size": N``, or ``--set
ds.sequence_parallel_size=N``; ``anneal.train.sequence``): the N consecutive ranks of a group
read the same samples, each takes 1/N of every sequence, and the attention trades heads for
sequence (all-to-all) so that each rank attends over the whole sequence for 1/N of the heads.
So the sequence length and the query and key-value head counts divide by N, as does the world.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from anneal.config.ds_schema import autotp_size, expert_parallel_size, sequence_parallel_size
from anneal.errors import UserError
from anneal.resilience.manifest import saved_zero_stage


@dataclasses.dataclass(frozen=True)
class Layout:
    world_size: int
    tensor_parallel: int
    """Ranks per tensor-parallel group (1: none)."""
    sequence_parallel: int = 1
    """Ranks per sequence-parallel (Ulysses) group, which share each sequence (1: none)."""
    expert_parallel: int = 1
    """Ranks per expert-parallel (AutoEP) group, which share out each layer's experts (1:
    none). Every rank of a group still reads its own samples (``anneal.launch.experts``)."""

    @property
    def data_parallel(self) -> int:
        """Model replicas, each reading its own samples: world / (TP degree x SP degree)."""
        return self.world_size // (self.tensor_parallel * self.sequence_parallel)

    def describe(self) -> str:
        if self.sequence_parallel > 1:
            return (
                f"{self.world_size} ranks = sequence-parallel {self.sequence_parallel} x "
                f"data-parallel {self.data_parallel}"
            )
        if self.expert_parallel > 1:
            return (
                f"{self.world_size} ranks = data-parallel {self.data_parallel}, experts shared "
                f"out over groups of {self.expert_parallel}"
            )
        if self.tensor_parallel == 1:
            return f"{self.world_size} rank(s)"
        return (
            f"{self.world_size} ranks = tensor-parallel {self.tensor_parallel} x data-parallel "
            f"{self.data_parallel}"
        )


def layout(ds: dict, preset, *, world_size: int, source: str) -> Layout:
    """The launch's layout, refused (UserError) where AutoTP would not shard this model evenly
    over these ranks (a world size that does not split into groups, query or key-value heads
    that do not divide by the degree). Any ZeRO stage goes with it, and so does
    ``train.export_every_save``: export merges the ranks' slices (``anneal.hf.tp_merge``)."""
    tp, sp, ep = autotp_size(ds), sequence_parallel_size(ds), expert_parallel_size(ds)
    if sp > 1:
        return _sequence_parallel_layout(ds, preset, world_size=world_size, source=source)
    if tp == 1:
        return Layout(world_size, 1, 1, ep)
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
    return Layout(world_size, tp)


def _sequence_parallel_layout(ds: dict, preset, *, world_size: int, source: str) -> Layout:
    """The layout with Ulysses sequence parallelism, refused where it cannot run: with tensor
    parallelism, below ZeRO-2, on a world, sequence length or head counts that do not divide
    by the degree, or on a model whose attention masks a sliding window."""
    sp, tp = sequence_parallel_size(ds), autotp_size(ds)
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    fix = f"Set ds.sequence_parallel_size (now {sp}, from {source} or --set)"
    if tp > 1:
        why = (
            f"tensor_parallel.autotp_size {tp} together with sequence_parallel_size {sp}: "
            f"DeepSpeed 0.19.8 builds their process groups apart (AutoTP's mesh, Ulysses' own "
            f"sequence groups) and does not test them together, nor does Anneal run them "
            f"together. Use one: --set ds.tensor_parallel.autotp_size=1, or "
            f"--set ds.sequence_parallel_size=1."
        )
    elif stage not in (2, 3):
        why = (
            f"sequence_parallel_size {sp} with ZeRO stage {stage}: Anneal runs Ulysses "
            f"sequence parallelism with ZeRO-2 and ZeRO-3, as DeepSpeed tests it, and checks "
            f"it against the run without it only there. Use --set ds.zero_optimization.stage=2 "
            f"(or 3)."
        )
    elif stage == 3 and not ds["zero_optimization"].get("reduce_scatter", True):
        why = (
            f"sequence_parallel_size {sp} with ZeRO-3 and zero_optimization.reduce_scatter "
            f"false: DeepSpeed 0.19.8's ZeRO-3 then reduces some gradient buckets summed over "
            f"each sequence-parallel group and others averaged, so no one loss scaling gives "
            f"the gradients of the run without it (anneal/train/sequence.py). Drop the key, "
            f"or set it to true."
        )
    elif world_size % sp:
        why = (
            f"sequence_parallel_size is {sp} but the launch has {world_size} rank(s), which "
            f"do not split into sequence-parallel groups of {sp}. {fix} to a divisor of "
            f"{world_size}, or launch a multiple of {sp} ranks."
        )
    elif preset.seq_len % sp:
        why = (
            f"sequence_parallel_size {sp} does not divide the sequence length "
            f"{preset.seq_len}: each rank of a group takes an equal slice of every sequence. "
            f"{fix} to a divisor of {preset.seq_len}, or change --set model.seq_len."
        )
    elif preset.heads_not_dividing(sp):
        why = (
            f"sequence_parallel_size {sp} does not divide the model's "
            f"{', '.join(preset.heads_not_dividing(sp))}: Ulysses' all-to-all gives each rank "
            f"of a group the whole sequence for 1/{sp} of the heads, query and key-value "
            f"alike. {fix} to a divisor of the head counts, or change them "
            f"(--set model.num_attention_heads=...)."
        )
    elif _sliding_window(preset) is not None:
        why = (
            f"sequence_parallel_size {sp} on a model that attends through a sliding window of "
            f"{_sliding_window(preset)} tokens (its config.json): DeepSpeed's Ulysses attention "
            f"drops the attention mask and attends causally over the whole sequence, so this "
            f"model would train on another attention than its own. Train it with "
            f"--set ds.sequence_parallel_size=1, or with a sequence no longer than the window."
        )
    else:
        return Layout(world_size, 1, sp)
    raise UserError(f"{source}: {why}")


def _sliding_window(preset) -> int | None:
    """The sliding attention window of a Hugging Face model (Mistral's ``sliding_window``,
    Qwen2's when ``use_sliding_window``) shorter than the run's sequence; None without one."""
    doc = preset.hf_config or {}
    window = doc.get("sliding_window")
    if not isinstance(window, int) or window >= preset.seq_len:
        return None
    if doc.get("model_type") == "qwen2" and not doc.get("use_sliding_window"):
        return None
    return window


def check_resume_layout(tag_dir: Path, manifest: dict, here: Layout) -> None:
    """A checkpoint resumes only at the tensor-parallel degree it was saved at, and with
    tensor parallelism only on as many ranks: each rank's files hold its own slices of the
    sharded matrices, and DeepSpeed's checkpoint loading (its universal-checkpoint conversion
    included) does not re-slice AutoTP weights for another degree. Likewise only at the
    sequence-parallel degree it was saved at. Another expert-parallel degree resumes through
    DeepSpeed's universal checkpoint (``anneal.resilience.checkpoint.load``)."""
    saved_tp = manifest.get("tensor_parallel_size", 1)
    saved_ranks = manifest.get("world_size")
    saved_sp = manifest.get("sequence_parallel_size", 1)
    if isinstance(saved_sp, int) and saved_sp != here.sequence_parallel:
        raise UserError(
            f"--resume {tag_dir}: saved with sequence-parallel degree {saved_sp} (its manifest) "
            f"and this launch has {here.sequence_parallel}. Anneal resumes only at the degree a "
            f"checkpoint was saved at: its weights would load (they are whole on every rank), "
            f"but the data-parallel replicas, and with them the batch arithmetic, would change, "
            f"and such a resume is not tested. Resume with --set "
            f"ds.sequence_parallel_size={saved_sp}, or start a new run in a new --out."
        )
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


def check_resume_stage(tag_dir: Path, manifest: dict, *, stage: int, world_size: int) -> None:
    """The ZeRO stage and world size a checkpoint can resume at: any of ZeRO-1, 2 and 3 on any
    number of ranks, whichever of them saved it (another number of ranks, or a move between
    ZeRO-1/2 and ZeRO-3, through DeepSpeed's universal checkpoint, made loadable at either
    stage by ``anneal.resilience.universal.either_stage``; ZeRO-1 and 2 write the same files).
    Refused: a move to or from no ZeRO (stage 0), and another number of ranks without ZeRO:
    DeepSpeed's converter reads ZeRO's optimizer shards, and a run without ZeRO has none."""
    saved = saved_zero_stage(manifest)
    saved_ranks = manifest.get("world_size")
    if saved is None:
        return
    if (saved == 0) != (stage == 0):
        raise UserError(
            f"--resume {tag_dir}: saved at ZeRO stage {saved} (its manifest) and this launch "
            f"uses ZeRO stage {stage}. A move to or from ZeRO stage 0 is not carried: a resume "
            f"at another ZeRO stage goes through DeepSpeed's universal checkpoint, whose "
            f"converter reads ZeRO's optimizer shards, and a run without ZeRO writes none. "
            f"Resume with --set ds.zero_optimization.stage={saved}, or export the model and "
            f"start a new run from it with --init-from (a fresh optimizer)."
        )
    if stage == 0 and isinstance(saved_ranks, int) and saved_ranks != world_size:
        raise UserError(
            f"--resume {tag_dir}: saved by {saved_ranks} ranks without ZeRO, and this launch "
            f"has {world_size}. Another number of ranks goes through DeepSpeed's universal "
            f"checkpoint, whose converter reads ZeRO's optimizer shards, and a run without ZeRO "
            f"has none: resume with {saved_ranks} ranks."
        )


def describe_resume_change(
    tag_dir: Path, manifest: dict, here: Layout, *, stage: int
) -> str | None:
    """One line for a resume whose checkpoint was saved at another layout than this launch's,
    which ``anneal.resilience.checkpoint.load`` loads through DeepSpeed's universal checkpoint
    (another number of ranks, another expert-parallel degree, ZeRO-1/2 for ZeRO-3 or the other
    way); None when nothing changes."""
    saved_ranks = manifest.get("world_size", here.world_size)
    saved_ep = manifest.get("expert_parallel_size", 1)
    saved_stage = saved_zero_stage(manifest)
    other_stage = saved_stage is not None and (saved_stage == 3) != (stage == 3)
    if saved_ranks == here.world_size and saved_ep == here.expert_parallel and not other_stage:
        return None

    def layout(ranks, ep, zero):
        where = f"{ranks} rank{'s' if ranks != 1 else ''}"
        where += f", ZeRO-{zero}" if zero else ""
        return where + (
            f", expert-parallel {ep}" if ep != 1 or saved_ep != here.expert_parallel else ""
        )

    return (
        f"resume: {tag_dir.name} was saved on {layout(saved_ranks, saved_ep, saved_stage)}; "
        f"this launch is {layout(here.world_size, here.expert_parallel, stage)}: it is converted "
        f"once to DeepSpeed's universal checkpoint under this run's checkpoints/.universal/ and "
        f"loaded from there (the global batch, the data position, the schedule and the "
        f"optimizer's state carry over)"
    )
