"""Resolve a launch into a ``Launch`` before anything is written or any engine is built.

``resolve_launch`` is pure apart from reading files (the ds_config, the data directory's
``meta.json``, checkpoint manifests, the run's ``config.json``): it takes the world size and the
device kind as arguments, so the launcher's pre-flight and the tests resolve the GPU path of a
launch on a machine without a GPU, exactly as the ranks will.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from anneal import rundir
from anneal.config.ds_schema import degrees
from anneal.config.run import AUTO, RunConfig
from anneal.config.run_checks import check_ranges, optim_keys_set
from anneal.config.run_compare import config_differences
from anneal.config.schedule import Schedule
from anneal.data.prepared_dir import PreparedDir
from anneal.errors import UserError
from anneal.files import claim_output
from anneal.model import (
    Attention,
    ModelPreset,
    active_params,
    count_params,
    describe_split,
    human_count,
)
from anneal.resilience import checkpoint
from anneal.resolution import cooldown, expert_layout, optimizer, parallel, throughput
from anneal.resolution import ds as ds_config
from anneal.resolution.preset import launch_attention, model_preset
from anneal.run_record import RunRecord

DEVICE_TYPES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """A launch, resolved and validated."""

    cfg: RunConfig
    ds_config: dict
    """The DeepSpeed config exactly as the engine gets it ("auto" values filled in)."""
    resolved_from: dict[str, str]
    """For each run-dependent ds_config key: its value and where it came from."""
    preset: ModelPreset
    out: Path
    resume_from: Path | None
    world_size: int
    device_type: str
    meta: dict
    """The data directory's meta.json."""
    notes: list[str]
    cooldown: cooldown.Cooldown | None = None
    """A cooldown branch's start (``anneal.resolution.cooldown``); None for any other run."""
    attention: Attention = Attention()
    """The attention the model trains with, and its documents (``data.document_mask``)."""

    @property
    def seq_len(self) -> int:
        return self.preset.seq_len

    @property
    def layout(self) -> parallel.Layout:
        """TP or SP degree x data-parallel size (``anneal.resolution.parallel``)."""
        d = degrees(self.ds_config)
        return parallel.Layout(self.world_size, d.tp, d.sp, d.ep)

    @property
    def zero_stage(self) -> int:
        return self.ds_config.get("zero_optimization", {}).get("stage", 0)

    @property
    def micro_batch(self) -> int:
        return self.ds_config["train_micro_batch_size_per_gpu"]

    @property
    def grad_accum(self) -> int:
        return self.ds_config["gradient_accumulation_steps"]

    @property
    def tokens_per_step(self) -> int:
        return self.ds_config["train_batch_size"] * self.seq_len

    @property
    def schedule(self) -> Schedule:
        """The LR schedule the engine applies (``anneal.config.schedule``)."""
        schedule = Schedule.resolved(self.ds_config["scheduler"]["params"], self.cfg.optim)
        return self.cooldown.applied_to(schedule) if self.cooldown else schedule

    @property
    def bf16(self) -> bool:
        return ds_config.bf16_enabled(self.ds_config)

    @property
    def has_validation(self) -> bool:
        """Whether the val split holds at least one window of seq_len + 1 tokens."""
        from anneal.data.checks import has_validation

        return has_validation(self.meta, seq_len=self.seq_len)

    def config_document(self) -> dict:
        """What ``config.json`` holds: the run config, the resolved ds_config and where its
        run-dependent values came from, the model and the launch."""
        return {
            **({"cooldown": self.cooldown.to_dict()} if self.cooldown else {}),
            "run": self.cfg.to_dict(),
            "ds_config": self.ds_config,
            "resolved_from": self.resolved_from,
            "model": {
                **dataclasses.asdict(self.preset),
                "seq_len": self.seq_len,
                "params": count_params(self.preset),
            },
            "launch": {
                "world_size": self.world_size,
                "tensor_parallel_size": self.layout.tensor_parallel,
                "sequence_parallel_size": self.layout.sequence_parallel,
                "data_parallel_size": self.layout.data_parallel,
                "expert_parallel_size": self.layout.expert_parallel,
                "device": self.device_type,
                "attention": self.attention.implementation,
            },
        }

    def describe(self) -> str:
        """The resolved launch, printed at start."""
        ds = self.ds_config
        n_params, active = count_params(self.preset), active_params(self.preset)
        sparse = f", {human_count(active)} active" if active != n_params else ""
        lines = [
            f"model {self.cfg.model.init_from or self.cfg.model.preset}: {n_params:,} parameters "
            f"({human_count(n_params)}{sparse}), vocab {self.preset.vocab_size}, seq "
            f"{self.seq_len}; {self.layout.describe()} on {self.device_type}; ZeRO stage "
            f"{self.zero_stage}, "
            f"{'bf16' if self.bf16 else 'fp32'}",
            f"resolved ({self.cfg.ds_config}, then the recipe's defaults, then --set):",
        ]
        lines += [f"  {key} = {how}" for key, how in self.resolved_from.items()]
        if self.preset.moe is not None:
            lines.insert(
                1, expert_layout.describe_experts(ds, self.preset, world_size=self.world_size)
            )
        if self.cfg.optim.optimizer == "muon":
            lines.append(describe_split(self.preset, scale=self.cfg.optim.muon_scale))
        lines.append(f"LR schedule ({self.cfg.optim.schedule}): {self.schedule.describe()}")
        lines.append(self.attention.describe())
        lines += throughput.describe_throughput(self.cfg.train, self.preset, self.zero_stage)
        return "\n".join(lines)


def resolve_launch(
    cfg: RunConfig,
    overrides: list[str] = (),
    *,
    world_size: int,
    device_type: str,
    fast_bf16: bool | None = None,
) -> Launch:
    """Resolve and check everything a launch needs on ``world_size`` ranks of ``device_type``.

    ``fast_bf16`` defaults to ``device_type == "cuda"``; a rank passes what its device reports.
    Raises UserError (marked as seen by every rank) before anything is written.
    """
    try:
        return _resolve(
            cfg,
            list(overrides),
            world_size=world_size,
            device_type=device_type,
            fast_bf16=device_type == "cuda" if fast_bf16 is None else fast_bf16,
        )
    except UserError as e:
        raise UserError(str(e), every_rank=True) from None


def _resolve(cfg, overrides, *, world_size, device_type, fast_bf16) -> Launch:
    from anneal.data.checks import check_prepared

    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {device_type!r}")
    check_ranges(cfg)
    ds_path = ds_config.find_ds_config(cfg.ds_config)
    ds = ds_config.load_ds_config(ds_path)
    ds = ds_config.override_ds_config(ds, ds_config.ds_overrides(overrides), source=str(ds_path))
    ds, note = ds_config.precision(cfg, ds, fast_bf16=fast_bf16, device_type=device_type)
    notes = [note] if note else []

    data_dir = Path(cfg.data.path)
    meta = check_prepared(PreparedDir(data_dir))  # complete, undamaged, tokenizer unchanged
    preset = model_preset(cfg.model, meta["vocab_size"])
    if preset.init_from is not None:  # the data's tokenizer is the model's, before any rank starts
        from anneal.hf.load import check_model_tokenizer

        check_model_tokenizer(preset, meta=meta, data_dir=data_dir)
    ds = expert_layout.fill_expert_parallel(
        ds, preset, device_type=device_type, source=str(ds_path)
    )
    layout = parallel.layout(ds, preset, world_size=world_size, source=str(ds_path))
    notes += throughput.check_throughput(
        cfg.train,
        preset,
        layout,
        zero_stage=ds.get("zero_optimization", {}).get("stage", 0),
        device_type=device_type,
    )
    out = Path(cfg.out)
    old_record = check_run_dir(cfg, out, data_dir=data_dir)
    cfg, branch, branch_notes = cooldown.resolve(
        cfg,
        ds,
        meta=meta,
        world_size=world_size,
        layout=layout,
        seq_len=preset.seq_len,
    )
    notes += branch_notes
    resume_from = checkpoint.find_resume(cfg.resume, rundir.checkpoints_dir(out))
    ds, resolved_from = ds_config.resolve_ds_config(
        ds,
        source=str(ds_path),
        data_parallel_size=layout.data_parallel,
        max_steps=cfg.train.max_steps,
        seq_len=preset.seq_len,
        optim=cfg.optim,
        optim_set=optim_keys_set(overrides),
        resumed_warmup=resumed_warmup(resume_from),
    )
    notes += resolved_from.messages
    ds_config.check_with_deepspeed(ds, source=str(ds_path))
    launch = Launch(
        cfg=cfg,
        ds_config=ds,
        resolved_from=resolved_from,
        preset=preset,
        out=out,
        resume_from=resume_from,
        world_size=world_size,
        device_type=device_type,
        meta=meta,
        notes=notes,
        cooldown=branch,
        attention=launch_attention(cfg, ds, meta=meta, device_type=device_type, layout=layout),
    )
    if resume_from is not None:
        _check_resume_target(launch)
    _check_validation_data(launch)
    if old_record is not None and not cfg.restart:
        _check_same_run(launch, old_record)
    return launch


def _check_resume_target(launch: Launch) -> None:
    """The checkpoint ``launch`` resumes from belongs to this data, this tokenizer and this
    model's shape and layout (``check_checkpoint_fits``); a layout it resumes at through a
    conversion is one line in the launch's notes."""
    from anneal.data.checks import check_matches_run

    data_dir, tag_dir = Path(launch.cfg.data.path), launch.resume_from
    check_matches_run(launch.meta, data_dir=data_dir, run_dir=launch.out)
    checkpoint.check_checkpoint_tokenizer(
        tag_dir, data_dir=data_dir, tokenizer_sha256=launch.meta.get("tokenizer_sha256")
    )
    stage = launch.zero_stage
    parallel.check_checkpoint_fits(
        tag_dir, launch.preset, world_size=launch.world_size, zero_stage=stage, layout=launch.layout
    )
    manifest = checkpoint.read_manifest(tag_dir) or {}
    optimizer.check_muon_resume(tag_dir, manifest, launch.ds_config, launch.layout, stage)
    change = parallel.describe_resume_change(tag_dir, manifest, launch.layout, stage=stage)
    if change:
        saved = rundir.record_or_empty(rundir.of_checkpoint(tag_dir)).ds_config
        batch = parallel.describe_batch(
            launch.ds_config, launch.layout, saved_batch=saved.get("train_batch_size")
        )
        launch.notes.append(f"{change}; {batch}")


def _check_validation_data(launch: Launch) -> None:
    """A run that validates needs at least one validation window in its data."""
    if not launch.has_validation and launch.cfg.train.val_samples > 0:
        data_dir, val_tokens = Path(launch.cfg.data.path), launch.meta["splits"]["val"]["tokens"]
        raise UserError(
            f"--data {data_dir}: has no validation windows of {launch.seq_len + 1} tokens (its val "
            f"split holds {val_tokens:,} tokens), so validation cannot run. "
            f"Prepare it again with a larger --val-fraction, or train without validation: "
            f"--set train.val_samples=0."
        )


def _check_same_run(launch: Launch, old_record: RunRecord) -> None:
    """``launch`` continues the run whose ``config.json`` its ``--out`` holds, or says so with
    ``--resume``: one directory never mixes two runs."""
    diffs = config_differences(old_record.doc, launch.config_document())
    if diffs and not launch.cfg.resume_explicit:
        raise UserError(
            f"--out {launch.out} holds a different run (its config.json differs: "
            f"{'; '.join(diffs[:5])}). Anneal will not mix two runs in one directory: "
            f"choose a new --out, or pass --resume auto (or a checkpoint path) to continue "
            f"that run with the new settings."
        )


def resumed_warmup(tag_dir: Path | None) -> int | None:
    """The resolved warmup of the run that wrote ``tag_dir`` (its config.json), which an
    ``"auto"`` warmup keeps on resume: that rule depends on ``--max-steps``, and a run resumed
    with a larger one must not warm up again. None when there is no such record."""
    if tag_dir is None:
        return None
    return rundir.record_or_empty(rundir.of_checkpoint(tag_dir)).warmup_steps


def check_run_dir(cfg: RunConfig, out: Path, *, data_dir: Path) -> RunRecord | None:
    """Refuse an ``--out`` this launch must not write into; returns the config.json of the run
    already there (None when there is none).

    Refused: ``.``, an ancestor of the working directory, the root, a file, the data directory
    or anything around it, a directory that is not writable, a config.json that is not a run's;
    ``--resume none`` (or a checkpoint path from elsewhere) on a directory that holds a run,
    unless ``--restart`` says to move that run aside; ``--restart`` with a resume from the
    run it moves aside; and, without ``--force``, a directory that holds no run but files of
    someone else's."""
    if out.is_symlink() and not out.is_dir():
        raise UserError(
            f"--out {out}: a link to no directory. Point it at a directory, or name another --out."
        )
    # A run continues in its directory and never replaces it, so a link to a directory (run
    # directories on a larger file system) is checked as the directory it leads to.
    target = out.resolve() if out.is_symlink() else out
    claim_output(target, in_place=True, what="run directory", inputs=[data_dir])
    if out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: not a directory you can write to. Choose another --out.")
    old = _read_run_record(out)
    found = rundir.holds_run(out)
    if not found:
        rundir.check_others_entries(out, force=cfg.force)
    here = rundir.checkpoints_dir(out).resolve()
    resume_path = None if cfg.resume in (AUTO, "none") else Path(cfg.resume).resolve()
    from_here = resume_path is not None and (resume_path == here or here in resume_path.parents)
    if cfg.restart:
        if (cfg.resume == AUTO and cfg.resume_explicit) or from_here:
            raise UserError(
                f"--restart --resume {cfg.resume}: --restart moves the run in {out} aside and "
                f"starts over, so it cannot also continue it. Drop --restart to continue that "
                f"run, or drop --resume to start over."
            )
        return old
    if found and (cfg.resume == "none" or (resume_path is not None and not from_here)):
        what = "--resume none" if cfg.resume == "none" else f"--resume {cfg.resume}"
        raise UserError(
            f"--out {out} holds a run already ({', '.join(found)}), and {what} would start "
            f"another one over it: its checkpoints at the same steps, config.json, metrics.jsonl, "
            f"plots and report would be replaced or mixed. Choose a new --out; continue that run "
            f"with --resume auto; or pass --restart to start over in {out} (that run is moved "
            f"to {out}/previous-<time>/ first, nothing is deleted)."
        )
    return old


def _read_run_record(out: Path) -> RunRecord | None:
    """``out/config.json`` when it is a run's (a JSON object with a "run" section)."""
    try:
        return rundir.read_record(out, missing_ok=True)
    except UserError:
        raise UserError(
            f"--out {out}: its config.json is not the config of an Anneal run (not JSON, or no "
            f'"run" section), so a run will not write over it. Choose a new --out, or move '
            f"that file away."
        ) from None
