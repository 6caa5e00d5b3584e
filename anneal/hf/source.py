"""What an export reads from a run directory, and the checks made before anything of it is
unpickled: the run's config (its model preset), the checkpoint chosen (``--tag``, or the
newest intact one), the run's tokenizer, and the checkpoint's files (listed in its manifest,
sizes and hashes as recorded, every file read by torch's weights-only loader first,
``anneal.resilience.safeload``).

A run directory and its checkpoints are read as input from elsewhere: --tag and every name in
a manifest are confined (checkpoint.read_manifest), every file's bytes are checked against the
manifest, and every file must pass torch's weights-only loader before the export's own
reader (``anneal.hf.reader``) opens it (docs/security.md).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from anneal import rundir
from anneal.data.prepared_dir import PreparedDir
from anneal.errors import UserError
from anneal.hf.autoep import with_experts
from anneal.hf.expert_names import saved_shapes
from anneal.hf.tp_merge import open_tp_checkpoint
from anneal.hf.zero import ZeroCheckpoint, open_checkpoint
from anneal.model import ModelPreset, build_model, preset_from_dict
from anneal.resilience import checkpoint, ds_files, safeload
from anneal.resilience.manifest import missing_files
from anneal.resilience.resume import choose
from anneal.run_record import RunRecord

log = logging.getLogger(__name__)

_TAG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _tags(ckpt_dir: Path, *, leave_out: str = "") -> str:
    """The intact tags of ``ckpt_dir``, for a message (one whose manifest is refused is left
    out, and ``leave_out``: the tag the message refuses)."""
    names = []
    for p in sorted(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []:
        try:
            if p.name != leave_out and p.is_dir() and p.name[:1] != "." and checkpoint.is_intact(p):
                names.append(p.name)
        except UserError:
            pass
    return ", ".join(names) or "none"


def _incomplete(tag_dir: Path) -> str | None:
    """Why ``tag_dir`` is not intact when its manifest reads but files it lists are missing or
    of another size (a sentence naming them: tensor-parallel rank files said so), else None."""
    manifest = checkpoint.read_manifest(tag_dir)
    if manifest is None:
        return None
    missing = missing_files(tag_dir, manifest)
    if not missing:
        return None
    listed = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    tp = manifest.get("tensor_parallel_size", 1)
    if isinstance(tp, int) and tp > 1 and any(map(ds_files.names_a_tensor_parallel_rank, missing)):
        what = (
            f"is missing tensor-parallel rank files that its {checkpoint.MANIFEST} lists "
            f"({listed}): it was saved by {tp} tensor-parallel ranks, and the export needs "
            f"every rank's slices"
        )
    else:
        what = f"lacks files that its {checkpoint.MANIFEST} lists, or has them cut ({listed})"
    return (
        f"{tag_dir}: the checkpoint {what}. Copy the whole tag directory again from where it "
        f"was saved, or export an intact checkpoint (--tag; intact: {_tags(tag_dir.parent)})."
    )


def _newest_incomplete(ckpt_dir: Path) -> str | None:
    """``_incomplete`` of the newest tag directory of ``ckpt_dir`` that has one, else None."""
    tags = ckpt_dir.iterdir() if ckpt_dir.is_dir() else []
    for tag_dir in sorted((p for p in tags if p.is_dir() and p.name[:1] != "."), reverse=True):
        if why := _incomplete(tag_dir):
            return why
    return None


def select_checkpoint(run_dir: Path, tag: str | None) -> Path:
    ckpt_dir = rundir.checkpoints_dir(run_dir)
    if tag is None:  # a manifest that names a file outside its directory stops the search
        newest = choose(ckpt_dir)
        if newest is None and (why := _newest_incomplete(ckpt_dir)):
            raise UserError(why)
        if newest is None:
            raise UserError(
                f"{run_dir}: no intact checkpoint in {ckpt_dir} (a run writes one every "
                f"--save-every steps and at its last step). Train it first, or point at another "
                f"run directory."
            )
        return newest
    have = _tags(ckpt_dir)
    tag_dir = ckpt_dir / str(tag)
    if not _TAG_NAME.fullmatch(str(tag)):
        raise UserError(
            f"--tag {tag}: a tag is the name of one checkpoint directory of this run, such as "
            f"step00000300 (letters, digits, '.', '_', '-'; no '/' or '..'). Intact tags in "
            f"{ckpt_dir}: {have}."
        )
    if tag_dir.is_symlink() or not tag_dir.is_dir():
        raise UserError(
            f"--tag {tag}: no such checkpoint in {ckpt_dir}. Intact tags there: {have}."
        )
    if not checkpoint.is_intact(tag_dir):  # confines the manifest's names, or refuses
        if why := _incomplete(tag_dir):
            raise UserError(why)
        raise UserError(
            f"--tag {tag}: not intact ({tag_dir / checkpoint.MANIFEST} missing or not a "
            f"manifest Anneal writes, or a file of the wrong size: a save that was "
            f"interrupted). Export another tag: {have}."
        )
    return tag_dir


def preset_from_record(record: RunRecord) -> ModelPreset:
    """The model of a run's ``config.json`` (``anneal.model.preset_from_dict``, the one reader
    of a model's shape); UserError naming the file and the key when a size is not a positive
    integer or the heads do not divide."""
    return preset_from_dict(
        record.model,
        source=str(record.path or rundir.CONFIG),
        prefix="model.",
        hint="Give the config.json of the run that wrote the checkpoint (a run writes it when "
        "it starts).",
    )


def tokenizer_dir(record: RunRecord, manifest: dict, tokenizer: Path | None) -> Path:
    """The directory of the run's tokenizer: ``tokenizer`` if given, else the run's data
    (``run.data.path``, relative to the run directory when it is not found as given); its
    tokenizer files as prepared, and the one the checkpoint was trained with."""
    from anneal.data.tokenizer import tokenizer_sha256

    run_dir, recorded = record.path.parent, record.data_path
    if tokenizer is None and recorded is None:
        raise UserError(
            f"{record.path}: names no run.data.path, so the run's tokenizer is "
            f"unknown. Pass --tokenizer DIR (the prepared data directory the run trained on)."
        )
    source = Path(tokenizer) if tokenizer else Path(recorded)
    if not source.is_absolute() and not source.exists():
        source = run_dir / source
    if not (source / "tokenizer.json").is_file():
        raise UserError(
            f"{source}: no tokenizer.json, so the export cannot ship the run's tokenizer. "
            f"The run's data directory moved? Pass --tokenizer DIR (the prepared data "
            f"directory the run trained on)."
        )
    if PreparedDir(source).meta_file.is_file():  # a prepared directory: its files as prepared
        _check_tokenizer_files(source)
    want = manifest.get("tokenizer_sha256")
    if want and tokenizer_sha256(source) != want:
        raise UserError(
            f"{source}: its tokenizer is not the one the checkpoint was trained with "
            f"({str(want)[:12]}...). Pass --tokenizer with the run's own prepared data "
            f"directory."
        )
    return source


def _check_tokenizer_files(data_dir: Path) -> None:
    """Every tokenizer file of a prepared directory as meta.json recorded it (what ``anneal
    data verify`` checks), before anything is written: the export copies them."""
    prepared = PreparedDir(data_dir)
    changed = [name for name, *_ in prepared.tokenizer_changes(prepared.meta())]
    if changed:
        raise UserError(
            f"{data_dir}: {', '.join(changed)} differ(s) from the sha256 that meta.json "
            f"recorded when the data was prepared (missing, edited or damaged), so the export "
            f"would ship another tokenizer than the run trained with. Put the original files "
            f"back (`anneal data verify {data_dir}` lists them), or pass --tokenizer with an "
            f"intact copy of the run's prepared data directory. Nothing was exported."
        )


def check_for_export(tag_dir: Path, manifest: dict) -> None:
    """Before anything of ``tag_dir`` is unpickled: every file export reads is listed in the
    manifest, every listed file has the size and xxh3 hash recorded there (same-size bit rot
    included), and no pickle in it names a global outside ``anneal.resilience.safeload``'s
    allow-list."""
    read = ds_files.files_holding_weights(tag_dir, tensor_parallel_size(tag_dir, manifest))
    listed = set(manifest["files"])
    unlisted = [f.name for f in read if f.name not in listed]
    if unlisted:
        raise UserError(
            f"{tag_dir}: {', '.join(unlisted)} not listed in its manifest.json, so its bytes "
            f"cannot be checked, and the checkpoint is not exported. Export another tag "
            f"(--tag), or copy the checkpoint again from where it was saved."
        )
    if not all(isinstance(e, dict) and checkpoint.HASH in e for e in manifest["files"].values()):
        log.warning("%s: its manifest holds no hashes (an older save); sizes checked only", tag_dir)
    bad = checkpoint.damaged_files(tag_dir)
    if bad:
        raise UserError(
            f"{tag_dir}: {len(bad)} file(s) differ from the sizes and xxh3 hashes in its "
            f"manifest.json ({', '.join(bad)}): bit rot, a torn copy or a change after the "
            f"save. Nothing was exported. Export an older tag (--tag; intact by size: "
            f"{_tags(tag_dir.parent, leave_out=tag_dir.name)}), or copy the checkpoint again."
        )
    try:
        safeload.check_checkpoint(tag_dir)
    except UserError as e:
        raise UserError(
            f"{e} Nothing was exported. Export a checkpoint you trust (--tag), or copy this one "
            f"again from where it was saved."
        ) from None


def tensor_parallel_size(tag_dir: Path, manifest: dict) -> int:
    """The tensor-parallel degree the checkpoint was saved at (its manifest; 1 if absent)."""
    tp = manifest.get("tensor_parallel_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= 4096:
        raise UserError(
            f"{tag_dir}: its manifest.json's tensor_parallel_size is {tp!r}, not a whole number "
            f"of ranks: not a manifest Anneal wrote. Export another tag (--tag)."
        )
    return tp


def open_weights(tag_dir: Path, tp: int, preset, config_path: Path) -> ZeroCheckpoint:
    """The one opener of a checkpoint's weights (the export's and ``anneal eval``'s), once its
    files passed the weights-only loader (``check_for_export``, or ``anneal eval``'s checks
    in ``anneal.cli.eval_target``): its parameters indexed lazily; with tensor parallelism, each
    rank's slices merged into the whole matrices (``anneal.hf.tp_merge``); a sparse run's in
    transformers' Qwen3-MoE names, its experts from their files (``anneal.hf.autoep``); their
    names and shapes checked against ``preset``, the model of ``config_path``. The caller closes
    it (``with``)."""
    if tp > 1:
        ckpt = open_tp_checkpoint(tag_dir, tp, expected_shapes(preset))
    else:
        ckpt = open_checkpoint(tag_dir)
    try:
        ckpt = with_experts(ckpt) if tp == 1 else ckpt
        check_shapes(ckpt, preset, config_path)
    except BaseException:
        ckpt.close()
        raise
    return ckpt


def check_shapes(ckpt: ZeroCheckpoint, preset, config_path: Path) -> None:
    expected = expected_shapes(preset)  # imports transformers before memory is measured
    got = {s.name: s.shape for s in ckpt.sources}
    if got != expected:
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        differ = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])[:3]
        raise UserError(
            f"{ckpt.tag_dir}: its parameters do not match the model in {config_path} (missing "
            f"{missing}, unexpected {extra}, other shapes {differ}): the checkpoint is another "
            f"run's, or config.json was edited. Export from the run directory that wrote it."
        )


def expected_shapes(preset) -> dict[str, tuple[int, ...]]:
    """Every parameter name, a tied head's included (DeepSpeed saves it as a shared alias),
    fused experts under the per-expert names save_pretrained writes
    (``anneal.hf.expert_names``)."""
    with torch.device("meta"):
        model = build_model(preset)
    named = model.named_parameters(remove_duplicate=False)
    return saved_shapes({name: tuple(p.shape) for name, p in named})
