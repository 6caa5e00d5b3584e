"""What ``anneal eval`` scores: a run (its newest checkpoint that verifies, or ``--step N``), one
checkpoint tag directory, or a Hugging Face model directory; found, checked and opened here
before any engine is built.

A checkpoint is read as input from elsewhere, as the export reads it (``anneal.hf.source``):
its manifest must verify (every file's size and xxh3 hash, re-hashed by the ranks together),
every file read must be listed there, and every file must pass torch's weights-only loader
(``anneal.resilience.safeload``) before the exporter's lazy reader indexes it; the weights are
then read from their byte ranges (``anneal.hf.zero``, ``anneal.hf.tp_merge``), never unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from anneal import rundir
from anneal.errors import UserError
from anneal.eval.score import Target
from anneal.resilience import checkpoint, safeload
from anneal.resilience.manifest import MANIFEST, read_manifest, saved_step, verify
from anneal.resilience.resume import choose
from anneal.run_record import RunRecord

log = logging.getLogger(__name__)


def find_target(
    target: Path,
    *,
    step: int | None,
    out: Path | None,
    ds_config: str | None,
    tokenizer: Path | None,
    data: Path | None,
) -> Target:
    """The ``Target`` that ``target`` names (collective for a checkpoint: the ranks re-hash it
    together). UserError, on every rank, for what the user can fix."""
    target = Path(target)
    if not target.is_dir():
        raise UserError(
            f"{target}: no such directory. Give a run directory (the recipe's "
            f"--out), one of its checkpoints (RUN/checkpoints/stepNNNNNNNN) or a Hugging Face "
            f"model directory.",
            every_rank=True,
        )
    if (target / MANIFEST).is_file() or target.parent.name == rundir.CHECKPOINTS:
        if step is not None:
            raise UserError(
                f"--step {step}: {target} is one checkpoint already; drop --step, or give the "
                f"run directory {target.parent.parent} with --step.",
                every_rank=True,
            )
        return checkpoint_target(target.parent.parent, _verified_tag(target), **_rest(locals()))
    if _is_hf_dir(target):
        if step is not None:
            raise UserError(
                f"--step {step}: {target} is a Hugging Face directory, which "
                "holds one model; drop --step.",
                every_rank=True,
            )
        return _hf_target(target, out=out, ds_config=ds_config, data=data)
    tag_dir = _choose_tag(target, step)
    return checkpoint_target(target, tag_dir, **_rest(locals()))


def _rest(scope: dict) -> dict:
    return {k: scope[k] for k in ("out", "ds_config", "tokenizer", "data")}


def _is_hf_dir(directory: Path) -> bool:
    """A directory whose config.json is a Hugging Face model's, not a run's."""
    try:
        doc = json.loads(rundir.config_path(directory).read_text())  # a run's, or a model's
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and not RunRecord.holds(doc) and "model_type" in doc


def _choose_tag(run_dir: Path, step: int | None) -> Path:
    """The newest intact checkpoint of ``run_dir`` whose hashes verify (an older one, said so,
    when the newest does not), or the one saved at ``step``. Collective."""
    rundir.read_record(run_dir, section="model")  # a run's config.json, or a UserError
    ckpt_dir = rundir.checkpoints_dir(run_dir)
    intact = checkpoint.intact_checkpoints(ckpt_dir)
    steps = ", ".join(str(saved_step(t)) for t in intact) or "none"
    if step is not None:
        chosen = choose(ckpt_dir, step=step)
        if chosen is None:
            raise UserError(
                f"--step {step}: {run_dir} has no intact checkpoint saved at step {step} "
                f"(intact: {steps}). Give one of those steps, or drop --step for the newest.",
                every_rank=True,
            )
        return _verified_tag(chosen)
    newest = choose(ckpt_dir, verified=True, on_damaged=_skipped)
    if newest is not None:
        return newest
    raise UserError(
        f"{run_dir}: no checkpoint in {ckpt_dir} verifies (intact by size: {steps}; "
        f"a run writes one every --save-every steps and at its last step). Train it first, "
        f"copy its checkpoints again, or give another run.",
        every_rank=True,
    )


def _skipped(tag_dir: Path, bad: list[str]) -> None:
    log.warning("%s does not verify (%s differ from its manifest): skipped", tag_dir, bad[:3])


def _verified_tag(tag_dir: Path) -> Path:
    """``tag_dir`` when its manifest is there and every file it lists has its size and hash.
    Collective."""
    if read_manifest(tag_dir) is None or not checkpoint.is_intact(tag_dir):
        raise UserError(
            f"{tag_dir}: not a checkpoint whose {MANIFEST} verifies (missing, not "
            f"one Anneal writes, or files missing or of another size: a save still being "
            f"written, or interrupted). Give an intact tag of {tag_dir.parent}, or the run "
            f"directory for its newest that verifies.",
            every_rank=True,
        )
    bad = verify(tag_dir)
    if bad:
        raise UserError(
            f"{tag_dir}: {len(bad)} file(s) differ from the sizes and xxh3 hashes "
            f"in its {MANIFEST} ({', '.join(bad[:3])}): bit rot, a torn copy or a change after "
            f"the save. Nothing was scored. Give another step, or copy the checkpoint again.",
            every_rank=True,
        )
    return tag_dir


def checkpoint_target(run_dir, tag_dir, *, out, ds_config, tokenizer, data) -> Target:
    """A run's checkpoint: its model and ds_config from the run's config.json, its files
    checked as the export checks them (listed, weights-only loadable), its tokenizer."""
    from anneal.files import sha256_file
    from anneal.hf.source import preset_from_record
    from anneal.hf.source import tokenizer_dir as find_tokenizer
    from anneal.resolution.ds import find_ds_config, load_ds_config

    record = rundir.read_record(run_dir, section="model")
    manifest = read_manifest(tag_dir)
    _check_files(tag_dir, manifest)
    preset = dataclasses.replace(preset_from_record(record), init_from=None)
    ds, ds_source = _scoring_layout(record.ds_config), f"{rundir.config_path(run_dir)} (ds_config)"
    if ds_config:
        ds_source = str(find_ds_config(ds_config))
        ds = load_ds_config(ds_source)
    data_dir = data or _data_dir(record)
    tokenizer_dir = _loadable_tokenizer(find_tokenizer(record, manifest, tokenizer))
    return Target(
        source="checkpoint",
        preset=preset,
        ds_config=ds,
        ds_source=ds_source,
        step=manifest["step"],
        tokens=manifest.get("tokens"),
        tokenizer_dir=tokenizer_dir,
        data_dir=data_dir,
        results_dir=Path(out) if out else Path(run_dir),
        run_dir=Path(run_dir),
        tag_dir=Path(tag_dir),
        manifest_sha256=sha256_file(Path(tag_dir) / MANIFEST),
    )


def _scoring_layout(ds: dict) -> dict:
    """The run's own ds_config, at ``sequence_parallel_size`` 1 where it trained with Ulysses:
    the checkpoint's weights load whole, and scoring runs on whole sequences
    (``anneal.eval.lm.unsupported_layout``). Its ZeRO stage and tensor-parallel degree stay."""
    from anneal.config.ds_schema import degrees

    if degrees(ds).sp == 1:
        return ds
    log.info("the run trained at sequence_parallel_size %d; scoring at 1", degrees(ds).sp)
    return {**ds, "sequence_parallel_size": 1}


def _data_dir(record: RunRecord) -> Path | None:
    """The run's prepared data (``run.data.path``, relative to the run directory when not found
    as given), None when it names none or it is gone."""
    if not record.data_path:
        return None
    path = Path(record.data_path)
    if not path.is_absolute() and not path.exists():
        path = record.path.parent / path
    return path if path.is_dir() else None


def _check_files(tag_dir: Path, manifest: dict) -> None:
    """Before anything of ``tag_dir`` is opened: every file the reader opens is listed in the
    (verified) manifest, and no pickle in it names a global outside safeload's allow-list."""
    from anneal.hf.source import tensor_parallel_size
    from anneal.resilience.ds_files import files_holding_weights

    read = files_holding_weights(tag_dir, tensor_parallel_size(tag_dir, manifest))
    unlisted = [f.name for f in read if f.name not in manifest["files"]]
    if unlisted or not read:
        raise UserError(
            f"{tag_dir}: {', '.join(unlisted) or 'no model states file'} "
            f"{'not listed in its ' + MANIFEST if unlisted else ''}, so the checkpoint is not "
            f"one whose bytes can be checked. Nothing was scored. Give another step, or copy "
            f"the checkpoint again from where it was saved.",
            every_rank=True,
        )
    try:
        safeload.check_checkpoint(tag_dir)
    except UserError as e:
        raise UserError(f"{e} Nothing was scored.", every_rank=True) from None


def _loadable_tokenizer(tokenizer_dir: Path) -> Path:
    """``tokenizer_dir`` once its tokenizer loads as scoring loads it, before any engine: a
    class that exists only as the directory's code (``auto_map``) is refused here, never run."""
    from anneal.eval.lm import load_tokenizer

    try:
        load_tokenizer(tokenizer_dir)
    except UserError as e:
        raise UserError(f"{e} Nothing was scored.", every_rank=True) from None
    return tokenizer_dir


def _hf_target(directory: Path, *, out, ds_config, data) -> Target:
    """A Hugging Face directory (an Anneal export, or any Llama-shaped model that
    ``--init-from`` accepts): checked by ``anneal.hf.load``; step and tokens from an export's
    marker (0 and none otherwise); the scores go under ``--out``."""
    from anneal.config.run import ModelConfig
    from anneal.hf.export import read_marker
    from anneal.hf.load import pretrained_preset
    from anneal.resolution.ds import find_ds_config, load_ds_config

    if out is None:
        raise UserError(
            f"{directory}: a Hugging Face directory has no run to write its scores "
            f"into; give --out DIR (they go to DIR/evals/step-N.json).",
            every_rank=True,
        )
    preset = pretrained_preset(directory, data_vocab=0, model=ModelConfig())
    ds_source = str(find_ds_config(ds_config or DEFAULT_HF_DS_CONFIG))
    _loadable_tokenizer(Path(directory))
    marker = read_marker(directory) or {}
    step = marker.get("step") if isinstance(marker.get("step"), int) else 0
    tokens = marker.get("tokens") if isinstance(marker.get("tokens"), int) else None
    return Target(
        source="hf",
        preset=preset,
        ds_config=load_ds_config(ds_source),
        ds_source=ds_source,
        step=step,
        tokens=tokens,
        tokenizer_dir=Path(directory),
        data_dir=Path(data) if data else None,
        results_dir=Path(out),
        hf_dir=Path(directory),
    )


DEFAULT_HF_DS_CONFIG = "zero3_bf16.json"
"""The ds_config a Hugging Face directory is scored under when --ds-config names none (ZeRO-3:
any model that trains fits; bf16 where the device has fast bf16, fp32 otherwise); its optimizer
and batch keys are dropped or set for scoring (``anneal.train.eval_engine``)."""
