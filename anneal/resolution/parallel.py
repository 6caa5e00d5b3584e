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

from anneal import rundir
from anneal.config.ds_schema import degrees
from anneal.errors import UserError
from anneal.model import ModelPreset
from anneal.resilience.manifest import MANIFEST, moves_stage, read_manifest, saved_zero_stage
from anneal.resolution.layout_check import check_layout


@dataclasses.dataclass(frozen=True)
class Layout:
    world_size: int
    tensor_parallel: int
    """Ranks per tensor-parallel group (1: none)."""
    sequence_parallel: int = 1
    """Ranks per sequence-parallel (Ulysses) group, which share each sequence (1: none)."""
    expert_parallel: int = 1
    """Ranks per expert-parallel (AutoEP) group, which share out each layer's experts (1:
    none). Every rank of a group still reads its own samples
    (``anneal.resolution.expert_layout``)."""

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
    """The launch's layout, refused (UserError) where Anneal does not run it
    (``anneal.resolution.layout_check``, the rules of ``anneal.model.layout_rules``): groups
    that do not split the world, heads, a sequence or experts that do not divide by the degree,
    Ulysses below ZeRO-2 or with tensor parallelism, experts with either or with offload. Any
    ZeRO stage goes with tensor parallelism, and so does ``train.export_every_save``: export
    merges the ranks' slices (``anneal.hf.tp_merge``)."""
    check_layout(ds, preset, world_size=world_size, source=source)
    d = degrees(ds)
    return Layout(world_size, d.tp, d.sp, d.ep)


def saved_layout(manifest: dict, here: Layout) -> Layout:
    """The layout a checkpoint was saved at, from its manifest (a field it lacks: ``here``'s
    world size, else degree 1, as before the manifests recorded them)."""
    return Layout(
        manifest.get("world_size", here.world_size),
        manifest.get("tensor_parallel_size", 1),
        manifest.get("sequence_parallel_size", 1),
        manifest.get("expert_parallel_size", 1),
    )


def converts(saved: Layout, here: Layout) -> bool:
    """Whether a resume from ``saved`` at ``here`` goes through DeepSpeed's universal
    checkpoint (``anneal.resilience.checkpoint.load`` decides alike): another number of ranks,
    expert-parallel or tensor-parallel degree. Another sequence-parallel degree alone loads
    the files as saved: the weights are whole on every rank, and ZeRO partitions them over
    all ranks (DeepSpeed's sequence-data-parallel group) at any degree, so every rank's
    shard is the same."""
    return (saved.world_size, saved.expert_parallel, saved.tensor_parallel) != (
        here.world_size,
        here.expert_parallel,
        here.tensor_parallel,
    )


def check_resume_layout(tag_dir: Path, manifest: dict, here: Layout, *, stage: int) -> None:
    """What a checkpoint resumes at besides its own layout (``stage``: this launch's ZeRO
    stage; ``check_resume_stage`` keeps it in the saved stage's family). Carried: another
    sequence-parallel degree on as many ranks (its files load as saved: ``converts``);
    another tensor-parallel degree, or tensor parallelism on another number of ranks, at
    ZeRO-1/2, through DeepSpeed's universal checkpoint, whose converter merges AutoTP's slices
    by the map the engine saves with them and whose loader cuts them again. Refused, where
    DeepSpeed 0.19.8 fails (docs/resilience.md, "Resuming at another layout"): a conversion
    to or from a sequence-parallel layout, and one with tensor parallelism at ZeRO-3 or
    without ZeRO."""
    saved = saved_layout(manifest, here)
    saved_stage = saved_zero_stage(manifest)
    if not converts(saved, here) and not moves_stage(saved_stage, stage):
        return
    what = (
        f"--resume {tag_dir}: saved on {saved.describe()} (its manifest), and this launch is "
        f"{here.describe()}"
    )
    if 1 < saved.sequence_parallel or 1 < here.sequence_parallel:
        raise UserError(
            f"{what}. That change goes through DeepSpeed's universal checkpoint, which "
            f"DeepSpeed 0.19.8 does not carry with Ulysses sequence parallelism on either side "
            f"(tried, bench/repro/ulysses_universal.py: its converter stops on a checkpoint "
            f'saved at SP=2 with "Checkpoint model-state file count 1 does not match '
            f'pp_degree=1 * tp_degree=2", the engine having recorded the sequence-parallel '
            f"degree as the tensor-parallel one; its universal load into an engine at SP=2 "
            f"stops on \"module 'parallel_state_sp' has no attribute "
            f"'get_tensor_model_parallel_world_size'\"). Resume on {saved.world_size} ranks, "
            f"at any sequence-parallel degree that divides them (the files load as saved), "
            f"or export the model and start a new run from it with --init-from (a fresh "
            f"optimizer)."
        )
    if saved.tensor_parallel == here.tensor_parallel == 1:
        return
    if 3 in (stage, saved_stage):
        raise UserError(
            f"{what}, at ZeRO-3 on one side. Another tensor-parallel degree, tensor "
            f"parallelism on another number of ranks, or a move between ZeRO-1/2 and ZeRO-3 "
            f"with it, goes through DeepSpeed's universal checkpoint, which "
            f"DeepSpeed 0.19.8 carries at ZeRO-1/2 but not at ZeRO-3 (tried, bench/repro/"
            f"autotp_zero3_universal.py: from TP=2 its converter stops in merge_tp_slices on "
            f'"Rank 0 supplied a shard of 64 elements, but the map describes 0", the AutoTP '
            f"map saved at ZeRO-3 giving the weights it does not slice, norms and embeddings, "
            f"the empty shape of ZeRO-3's partitioned placeholder; from TP=1 to 2 its ZeRO-3 "
            f'universal load stops on "start (77568) + length (4096) exceeds dimension size '
            f'(78976)", not cutting the weights for AutoTP). Resume with --set '
            f"ds.tensor_parallel.autotp_size={saved.tensor_parallel} on {saved.world_size} "
            f"ranks, or export the model and start a new run from it with --init-from (a "
            f"fresh optimizer)."
        )
    if stage == 0 and saved.world_size == here.world_size:
        raise UserError(
            f"{what}, without ZeRO. Another tensor-parallel degree goes through DeepSpeed's "
            f"universal checkpoint, whose converter reads ZeRO's optimizer shards, and a run "
            f"without ZeRO has none: resume with --set ds.tensor_parallel.autotp_size="
            f"{saved.tensor_parallel}."
        )


def check_resume_stage(tag_dir: Path, manifest: dict, *, stage: int, world_size: int) -> None:
    """The ZeRO stage and world size a checkpoint can resume at: any of ZeRO-1, 2 and 3 on any
    number of ranks, whichever of them saved it (another number of ranks, or a move between
    ZeRO-1/2 and ZeRO-3, through DeepSpeed's universal checkpoint, made loadable at either
    stage by ``anneal.resilience.universal_stages.either_stage``; ZeRO-1 and 2 write the same
    files).
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
    """One line for a resume whose checkpoint was saved at another layout than this launch's:
    the two layouts (the data-parallel replicas too, where a tensor- or sequence-parallel
    degree changes them) and how it loads: through DeepSpeed's universal checkpoint
    (``converts``, or a move between ZeRO-1/2 and ZeRO-3), or as saved (another
    sequence-parallel degree alone); None when nothing changes."""
    saved = saved_layout(manifest, here)
    saved_stage = saved_zero_stage(manifest)
    other_stage = moves_stage(saved_stage, stage)
    if saved == here and not other_stage:
        return None
    replicas = (saved.tensor_parallel, saved.sequence_parallel) != (
        here.tensor_parallel,
        here.sequence_parallel,
    )

    def degrees(at: Layout) -> tuple[int, int, int]:
        return at.tensor_parallel, at.sequence_parallel, at.expert_parallel

    names = ("tensor-parallel", "sequence-parallel", "expert-parallel")
    shown = [a != 1 or b != 1 for a, b in zip(degrees(saved), degrees(here), strict=True)]

    def layout(at: Layout, zero) -> str:
        where = f"{at.world_size} rank{'s' if at.world_size != 1 else ''}"
        where += f", ZeRO-{zero}" if zero else ""
        for name, degree, show in zip(names, degrees(at), shown, strict=True):
            where += f", {name} {degree}" if show else ""
        return where + (f", data-parallel {at.data_parallel}" if replicas else "")

    if converts(saved, here) or other_stage:
        how = (
            "it is converted once to DeepSpeed's universal checkpoint under this run's "
            "checkpoints/.universal/ and loaded from there"
        )
    else:
        how = (
            f"its files load as saved, ZeRO partitioning over all {here.world_size} ranks at "
            f"any sequence-parallel degree"
        )
    return (
        f"resume: {tag_dir.name} was saved on {layout(saved, saved_stage)}; this launch is "
        f"{layout(here, stage)}: {how} (the global batch, the data position, the schedule "
        f"and the optimizer's state carry over)"
    )


def describe_batch(ds: dict, here: Layout, *, saved_batch) -> str:
    """The global batch of a resume at another layout, re-derived for ``here``'s ranks (``ds``:
    the launch's resolved ds_config): kept, or changed from the saved run's ``saved_batch``
    by a micro-batch or accumulation setting of this launch, with the setting that keeps it."""
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    batch, dp = ds["train_batch_size"], here.data_parallel
    split = (
        f"{micro} a micro-batch x {accum} accumulation step{'s' if accum != 1 else ''} x {dp} "
        f"data-parallel rank{'s' if dp != 1 else ''}"
    )
    if not isinstance(saved_batch, int) or isinstance(saved_batch, bool) or saved_batch < 1:
        saved_batch = batch  # a run from before config.json, or one not Anneal's: unknown
    if saved_batch == batch:
        return f"the global batch stays {batch} samples, here {split}"
    keep = (
        f"--set ds.gradient_accumulation_steps={saved_batch // (micro * dp)} keeps {saved_batch}"
        if saved_batch % (micro * dp) == 0
        else f"{saved_batch} is no multiple of micro-batch {micro} x {dp} ranks"
    )
    return (
        f"the global batch CHANGES from {saved_batch} to {batch} samples ({split}), as this "
        f"launch's batch settings say; {keep}"
    )


SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
"""The model fields that decide the shape of its weights (a checkpoint loads only into these)."""


def check_checkpoint_fits(
    tag_dir: Path,
    preset: ModelPreset,
    *,
    world_size: int,
    zero_stage: int,
    layout: Layout,
) -> None:
    """The checkpoint to resume must hold weights of this run's shape (from its manifest, or
    the config.json of the run that wrote it), at a layout it can be resumed at (the
    tensor-parallel degree it was saved at; its ZeRO stage family; without ZeRO or with tensor
    parallelism, as many ranks): all are refused here, before anything is written, rather than
    inside DeepSpeed's load."""
    manifest = read_manifest(tag_dir) or {}
    saved, source = manifest.get("model"), tag_dir / MANIFEST
    if not isinstance(saved, dict):
        run_dir = rundir.of_checkpoint(tag_dir)
        record = rundir.record_or_empty(run_dir)
        source, saved = record.path, record.doc.get("model")
    if isinstance(saved, dict):
        diffs = [
            f"{key} {saved[key]!r} there, {getattr(preset, key)!r} here"
            for key in SHAPE_KEYS
            if key in saved and saved[key] != getattr(preset, key)
        ]
        if diffs:
            raise UserError(
                f"--resume {tag_dir}: the checkpoint holds a model of another shape "
                f"({'; '.join(diffs)}; as recorded in {source}), so its weights cannot load "
                f"into this run's. Resume with the model settings of that run (--set "
                f"model.hidden_size=... as {source} says; vocab_size comes from --data), or "
                f"start a new run in a new --out."
            )
    check_resume_layout(tag_dir, manifest, layout, stage=zero_stage)
    check_resume_stage(tag_dir, manifest, stage=zero_stage, world_size=world_size)
