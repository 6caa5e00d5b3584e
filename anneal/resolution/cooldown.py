"""Cooldown branches (docs/training.md, "Cooldown branches"): a new run started from a
checkpoint of a WSD run, whose LR decays from the parent's at that step to the floor over
``optim.cooldown_tokens``, on the parent's data or on another prepared directory with the same
tokenizer.

Resolved with the launch (``anneal.resolution.resolve``), before anything is written: the parent's
checkpoint (a tag directory, or a run directory's newest), whether it can be branched (a WSD
parent; the same number of ranks, tensor-parallel degree and ZeRO stage, as ZeRO shards are
per rank; the data's tokenizer), the ``--out`` (a new directory outside the parent, or this
branch's own, to continue it) and the branch's length. The parent is only read: its manifest
and config.json here, its checkpoint files when the engine loads them. The branch's
``config.json`` records the lineage (``Cooldown.to_dict``), which ``anneal plot`` and ``anneal
report`` read (``anneal.run_record.RunRecord``, ``schedule_of``, ``lineage``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

from anneal import rundir
from anneal.config.run import AUTO, RunConfig
from anneal.config.run_compare import config_differences
from anneal.config.schedule import Schedule
from anneal.data.prepared_dir import PreparedDir
from anneal.errors import UserError
from anneal.files import sha256_file
from anneal.resilience.manifest import MANIFEST, is_intact, read_manifest
from anneal.resilience.resume import intact_checkpoints
from anneal.resolution import ds as ds_config
from anneal.run_record import RunRecord

FLAG = "--cooldown-from"
EXPECTED_DIFFERENCES = ("train.max_steps", "train.cooldown_from", "optim.cooldown_tokens", "out")
"""Keys in which a branch differs from its parent by construction (not reported)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cooldown:
    """Where a cooldown branch starts, as its config.json's ``cooldown`` section records it
    (``branch`` before issue 40; ``anneal.run_record.RunRecord.cooldown`` reads both)."""

    parent_run: str
    checkpoint: str
    """The parent's tag directory the branch starts from."""
    step: int
    """S: the checkpoint's step; the branch's first step is S + 1."""
    manifest_sha256: str
    """sha256 of the checkpoint's manifest.json (which holds every file's hash)."""
    cooldown_tokens: int
    cooldown_steps: int
    """D = ceil(cooldown_tokens / tokens per step); the branch ends at step S + D."""
    from_ratio: float
    """The parent's LR at step S as a share of its peak, where the decay starts."""
    same_data: bool
    """The branch reads the parent's data, from the checkpoint's position (else from 0)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def applied_to(self, schedule: Schedule) -> Schedule:
        """``schedule`` as this branch's: the decay from ``from_ratio`` after step S."""
        return dataclasses.replace(
            schedule, kind="wsd", cooldown_step=self.step, cooldown_ratio=self.from_ratio
        )

    def client_for(self, client: dict) -> dict:
        """A checkpoint's client state as this branch starts from it: the parent's, on other
        data, with the data position 0 and the guard's loss history and skipped sample ranges
        left behind (they describe the parent's data); anything else as it is."""
        if client["step"] != self.step or self.same_data:
            return client
        guard = {**client.get("guard", {}), "history": [], "skipped": []}
        return {**client, "data": {**client["data"], "position": 0}, "guard": guard}


def resolve(
    cfg: RunConfig, ds: dict, *, meta: dict, world_size: int, layout, seq_len: int
) -> tuple[RunConfig, Cooldown | None, list[str]]:
    """(the launch's config, its branch, notes). Not a branch (no ``train.cooldown_from``): the
    config as given. A branch: its length as ``train.max_steps``, its schedule WSD, and as
    ``resume`` the parent's checkpoint, unless ``out`` holds this branch's own already."""
    if not cfg.train.cooldown_from:
        if cfg.optim.cooldown_tokens:
            raise UserError(
                f"optim.cooldown_tokens is {cfg.optim.cooldown_tokens:,} but this launch is not a "
                f"cooldown branch: give {FLAG} CHECKPOINT (a checkpoint of a WSD run) with it, "
                f"or drop the key."
            )
        return cfg, None, []
    if cfg.resume_explicit or cfg.restart:
        raise UserError(
            f"{FLAG} starts a new run in --out from the parent's checkpoint, and a relaunch with "
            f"the same command continues it; --resume and --restart do not apply. Drop them."
        )
    tag = parent_checkpoint(cfg.train.cooldown_from)  # links resolved: the real parent's
    manifest, parent_run = read_manifest(tag), rundir.of_checkpoint(tag)
    where = f"{FLAG} {tag}"
    _check_manifest(tag, manifest, where=where)
    parent = rundir.read_record(parent_run)
    ratio = _cooldown_ratio(parent, manifest["step"], where=where, run=parent_run)
    _check_topology(parent, manifest, ds, world_size, layout.tensor_parallel, where=where)
    _check_parent_tokenizer(manifest, meta, cfg.data.path, where=where)
    if cfg.optim.cooldown_tokens <= 0:
        raise UserError(
            f"{where}: a cooldown branch needs its length in tokens: --set "
            f"optim.cooldown_tokens=N (e.g. a fifth of the parent's tokens so far, "
            f"{(manifest.get('tokens') or 0) // 5:,}, as Haegele et al. 2024 found 20% enough)."
        )
    branch = Cooldown(
        parent_run=str(parent_run.absolute()),  # plots and reports read it from anywhere
        checkpoint=str(tag.absolute()),
        step=manifest["step"],
        manifest_sha256=sha256_file(tag / MANIFEST),
        cooldown_tokens=cfg.optim.cooldown_tokens,
        cooldown_steps=_steps(cfg, ds, seq_len=seq_len, data_parallel=layout.data_parallel),
        from_ratio=ratio,
        same_data=_same_data(parent, Path(cfg.data.path)),
    )
    own = _check_out(Path(cfg.out), branch)
    cfg = dataclasses.replace(
        cfg,
        resume=AUTO if own else str(tag),
        optim=dataclasses.replace(cfg.optim, schedule="wsd"),
        train=dataclasses.replace(cfg.train, max_steps=branch.step + branch.cooldown_steps),
    )
    return cfg, branch, _notes(cfg, branch, parent, manifest, resumed=own)


def parent_checkpoint(given: str) -> Path:
    """The tag directory ``--cooldown-from`` names: a tag directory, or a run or checkpoints
    directory (its newest intact checkpoint); with every link resolved, so that the parent run
    (``RUN`` of ``RUN/checkpoints/<tag>``) is where the checkpoint really lies, never a
    directory that only links to it."""
    path = Path(given)
    if is_intact(path):
        return path.resolve()
    if path.is_dir():
        found = intact_checkpoints(rundir.checkpoints_dir(path)) or intact_checkpoints(path)
        if found:
            return found[-1].resolve()
    what = "not an intact checkpoint, and holds none" if path.exists() else "no such directory"
    raise UserError(
        f"{FLAG} {given}: {what}. "
        f"Give a checkpoint of a WSD run (RUN/checkpoints/stepNNNNNNNN, with its {MANIFEST}) or "
        f"its run directory (its newest checkpoint)."
    )


def schedule_of(record: RunRecord) -> Schedule:
    """The schedule a run's config.json describes, a branch's included (KeyError when the
    document has no scheduler)."""
    doc = record.doc
    schedule = Schedule.resolved(doc["ds_config"]["scheduler"]["params"], doc["run"]["optim"])
    return with_cooldown(schedule, record)


def with_cooldown(schedule: Schedule, record: RunRecord) -> Schedule:
    """``schedule`` as the branch's decay when ``record`` is a branch's."""
    branch = record.cooldown
    try:
        step, ratio = int(branch["step"]), float(branch["from_ratio"])
    except (KeyError, TypeError, ValueError):
        return schedule  # not a branch (or not a section Anneal wrote: drawn as it says)
    return dataclasses.replace(schedule, kind="wsd", cooldown_step=step, cooldown_ratio=ratio)


def lineage(run_dir: Path, *, depth: int = 8) -> list[str]:
    """One line per ancestor of a branch (parent first): the run, the step and checkpoint it
    branched from, the manifest's hash and the cooldown. Empty when not a branch."""
    lines, record = [], rundir.record_or_empty(run_dir)
    while record.cooldown is not None and len(lines) < depth:
        b = record.cooldown
        lines.append(
            f"branch of {b.get('parent_run')} at step {b.get('step')} (checkpoint "
            f"{Path(str(b.get('checkpoint'))).name}, manifest sha256 "
            f"{str(b.get('manifest_sha256'))[:12]}...): cooldown of "
            f"{b.get('cooldown_tokens', 0):,} tokens ({b.get('cooldown_steps')} steps) from "
            f"{b.get('from_ratio', 0):.4g} x peak"
        )
        record = rundir.record_or_empty(Path(str(b.get("parent_run"))))
    return lines


def _check_manifest(tag: Path, manifest: dict, *, where: str) -> None:
    """The manifest's step agrees with the checkpoint's own name (its directory's, and the tag
    the manifest recorded at the save: ``stepNNNNNNNN``), and its ``tokens`` is a count: the
    branch's step, schedule and length come from it."""
    step, tokens = manifest["step"], manifest.get("tokens")
    for what, name in (("its directory", tag.name), ("the tag it records", manifest.get("tag"))):
        named = re.fullmatch(r"step(\d{8,})", str(name))
        if named and int(named[1]) != step:
            raise UserError(
                f"{where}: its {MANIFEST} says step {step}, but {what} is {name} (step "
                f"{int(named[1])}): the manifest was edited or belongs to another checkpoint, "
                f"and the branch would start from the wrong step. Branch from a checkpoint as "
                f"the run saved it, or restore this one."
            )
    if tokens is not None and (type(tokens) is not int or tokens < 0):
        raise UserError(
            f"{where}: its {MANIFEST}'s tokens is {json.dumps(tokens)[:40]}, not a count of "
            f"tokens: not a manifest Anneal writes. Restore the checkpoint as the run saved it, "
            f"or branch from another one."
        )


def _cooldown_ratio(parent: RunRecord, step: int, *, where: str, run: Path) -> float:
    """The parent's LR ratio at ``step``; a cosine parent, or a step at its floor, refused."""
    optim = parent.optim
    if optim.get("schedule") != "wsd":
        raise UserError(
            f"{where}: the parent ran the {optim.get('schedule', 'cosine')!r} schedule, not WSD. "
            f"A cosine run decays from its warmup on, so there is no stable phase to cool down "
            f"from, and a branch would only end its cosine early. Branch from a run trained with "
            f"--set optim.schedule=wsd, or extend this run instead (docs/training.md)."
        )
    try:
        schedule = schedule_of(parent)
    except (KeyError, TypeError, ValueError):
        raise UserError(
            f"{where}: {rundir.config_path(run)} has no resolved scheduler "
            f"(ds_config.scheduler.params); it is not as the run wrote it. Restore it, or "
            f"branch from another run."
        ) from None
    ratio = schedule.ratio(step)
    if ratio <= schedule.min_ratio + 1e-12:
        raise UserError(
            f"{where}: at step {step} the parent's LR is already at its floor "
            f"({schedule.min_ratio:g} x peak; {schedule.describe()}), so there is nothing to "
            f"cool down. Branch from a checkpoint of its stable phase (up to step "
            f"{schedule.decay_start})."
        )
    return ratio


def _check_topology(parent, manifest, ds, world_size, tensor_parallel, *, where) -> None:
    """Same ranks, tensor-parallel degree and ZeRO stage as the checkpoint (its shards are per
    rank; converting it would write into the parent)."""
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    theirs = {
        "ranks": manifest.get("world_size", world_size),
        "tensor-parallel degree": manifest.get("tensor_parallel_size", 1),
        "ZeRO stage": parent.zero_stage,
    }
    ours = {"ranks": world_size, "tensor-parallel degree": tensor_parallel, "ZeRO stage": stage}
    diffs = [
        f"{k} {theirs[k]} there, {ours[k]} here" for k in ours if theirs[k] not in (None, ours[k])
    ]
    if diffs:
        raise UserError(
            f"{where}: the checkpoint was saved on another layout ({'; '.join(diffs)}). ZeRO "
            f"shards are per rank, and a branch does not convert its parent's checkpoint "
            f"(that would write into the parent): launch the branch with "
            f"{theirs['ranks']} rank(s), the parent's ds_config and tensor-parallel degree."
        )


def _check_parent_tokenizer(manifest: dict, meta: dict, data_dir: str, *, where: str) -> None:
    saved, here = manifest.get("tokenizer_sha256"), meta.get("tokenizer_sha256")
    if saved and here and saved != here:
        raise UserError(
            f"{where}: --data {data_dir} was prepared with another tokenizer ({here[:12]}...) "
            f"than the parent's ({saved[:12]}...), so the model would read other ids. Prepare "
            f"the branch's data with the parent's tokenizer (anneal data prepare --tokenizer "
            f"PARENT_DATA/tokenizer.model, or the Hugging Face tokenizer directory it used)."
        )


def _steps(cfg: RunConfig, ds: dict, *, seq_len: int, data_parallel: int) -> int:
    """D = ceil(cooldown_tokens / tokens per step), the batch resolved as the launch will."""
    resolved, _ = ds_config.resolve_ds_config(
        ds,
        source=cfg.ds_config,
        data_parallel_size=data_parallel,
        max_steps=2**31,  # any length: only the batch is read
        seq_len=seq_len,
        optim=cfg.optim,
        resumed_warmup=0,
    )
    return math.ceil(cfg.optim.cooldown_tokens / (resolved["train_batch_size"] * seq_len))


def _same_data(parent: RunRecord, data_dir: Path) -> bool:
    """Whether the branch reads the parent's data: the same directory, or one whose meta.json
    is the same (a copy)."""
    theirs = Path(parent.data_path or "")
    if theirs.resolve() == data_dir.resolve():
        return True
    try:
        mine = PreparedDir(data_dir).meta_object()
        return mine is not None and PreparedDir(theirs).meta_object() == mine
    except OSError:
        return False


def _check_out(out: Path, branch: Cooldown) -> bool:
    """``out`` may hold nothing of another run, and lies outside the parent (which is never
    written). True when it holds this branch already (the same parent checkpoint, the same
    manifest) with a checkpoint of its own: the launch continues from there."""
    parent, real = Path(branch.parent_run).resolve(), out.resolve()
    if real == parent or parent in real.parents or real in parent.parents:
        how = "is" if real == parent else "lies inside" if parent in real.parents else "holds"
        raise UserError(
            f"--out {out}: {how} the parent run {branch.parent_run}, and a branch never "
            f"writes into its parent. "
            f"Choose a new --out outside it, e.g. {parent.parent / (parent.name + '-cooldown')}."
        )
    found = rundir.holds_run(out)
    if not found:
        return False
    mine = rundir.record_or_empty(out).cooldown or {}
    if (Path(str(mine.get("checkpoint"))).resolve(), mine.get("manifest_sha256")) == (
        Path(branch.checkpoint),
        branch.manifest_sha256,
    ):  # this branch, relaunched: from its own newest checkpoint, else the parent's again
        return bool(intact_checkpoints(rundir.checkpoints_dir(out)))
    raise UserError(
        f"--out {out} holds a run already ({', '.join(found)}), not this branch of "
        f"{branch.checkpoint}. A branch is a new run: choose a new --out (several branches of "
        f"one parent each need their own)."
    )


def _notes(
    cfg: RunConfig, branch: Cooldown, parent: RunRecord, manifest: dict, *, resumed
) -> list[str]:
    end = branch.step + branch.cooldown_steps
    notes = [
        f"cooldown branch of {branch.parent_run} at step {branch.step} ({branch.checkpoint}, "
        f"manifest sha256 {branch.manifest_sha256[:12]}...): the LR decays from "
        f"{branch.from_ratio:.4g} x peak to the floor over {branch.cooldown_tokens:,} tokens "
        f"= {branch.cooldown_steps} steps ({cfg.optim.decay_shape}), steps {branch.step + 1} to "
        f"{end} (train.max_steps = {end}); the peak LR is the checkpoint's"
        + ("; continuing this branch from its own checkpoints" if resumed else "")
    ]
    if not branch.same_data and not resumed:
        notes.append(
            f"--data {cfg.data.path} is not the parent's data "
            f"({parent.data_path}): the branch reads it from its start "
            f"(position 0), not from the position saved in the parent's checkpoint"
        )
    diffs = [
        d
        for d in config_differences({"run": parent.run}, {"run": cfg.to_dict()})
        if d.split(":")[0].removeprefix("run.") not in (*EXPECTED_DIFFERENCES, "data.path")
    ]
    if diffs:
        notes.append(f"the branch's settings differ from its parent's: {'; '.join(diffs[:6])}")
    return notes
