"""Hugging Face export of a ZeRO checkpoint (any stage), one tensor at a time, verified.

DeepSpeed's ``zero_to_fp32`` loads every rank's optimizer file (fp32 master weights plus both Adam
moments) before it writes anything: about 3x the fp32 model in memory, a terabyte for an 80B model
(DeepSpeed PR #4025). Here the checkpoint files are opened, never loaded: their pickled index is
read with an unpickler that builds no tensors and imports nothing but a short list of harmless
names (``_LazyUnpickler``), once torch's weights-only loader has accepted the file
(``anneal.resilience.safeload``; tensors mapped, not read); each parameter is then read with
``readinto`` straight from the byte ranges that hold it (its ``ceil(n / world)`` slice on every
rank under ZeRO-3; the span of the concatenated rank partitions under ZeRO-1/2). Shards are written
in the safetensors format by streaming each tensor after a header computed from the shapes, so peak
memory is about one tensor (1.5 of it for bf16), whatever the model size. Exported weights never
pass through pickle. A tensor-parallel checkpoint (its manifest's ``tensor_parallel_size``) is one
such ZeRO checkpoint per tensor-parallel rank, each holding that rank's slices;
``anneal.hf.tp_merge`` concatenates them into the whole matrices (a whole tensor and one slice in
memory).

The export then verifies itself: ``AutoModelForCausalLM`` and ``AutoTokenizer`` load the directory;
the tokenizer encodes a fixed text like the run's; and the logits on a fixed batch match those of
the training model (``anneal.model.build_model``) holding the weights that DeepSpeed's own
``zero_to_fp32`` consolidates from the same checkpoint, an independent path. That comparison runs
in fp32 on both sides, the reference's weights rounded through the export dtype first, so any
difference is a layout bug and not bf16 rounding (which is reported apart).

This module is the orchestration (the claim on ``--out``, the partial directory replaced once
verified, every save, the report); the pieces are ``anneal.hf.source`` (what is read from the run
and checked first), ``anneal.hf.reader`` (lazy torch zip files), ``anneal.hf.zero`` (the ZeRO
layouts and the reference reader), ``anneal.hf.writer`` (safetensors, configs, tokenizer) and
``anneal.hf.verify``. ``--out`` is claimed by the rule of anneal.files (docs/security.md).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

from anneal import rundir
from anneal.errors import UserError
from anneal.files import claim_output, replace_dir
from anneal.hf.source import (
    check_for_export,
    open_weights,
    preset_from_record,
    select_checkpoint,
    tensor_parallel_size,
    tokenizer_dir,
)
from anneal.hf.verify import ExportMismatch, verify_export
from anneal.hf.writer import DTYPES, convert, parse_size
from anneal.resilience import checkpoint

MARKER = "anneal_export.json"
"""The marker of an export directory: the export's report, written last, once the model is
verified. This module is its one owner: ``write_marker`` writes it, ``read_marker`` reads it."""


def write_marker(directory: Path, report: dict) -> None:
    """Mark ``directory`` as a finished export: its report as ``MARKER``."""
    (Path(directory) / MARKER).write_text(json.dumps(report, indent=2) + "\n")


def read_marker(directory: Path) -> dict | None:
    """The report of the export in ``directory`` (its ``MARKER``), None when there is none or
    it is not a JSON object holding the exported checkpoint."""
    try:
        doc = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and "checkpoint" in doc else None


def is_export(path: Path) -> bool:
    """A directory that ``anneal export`` wrote (its marker file), which --force may replace."""
    return read_marker(path) is not None


def _claim_out(out: Path, *, run_dir: Path, inputs: list[Path], force: bool, every: bool) -> None:
    """The rule of ``anneal.files.claim_output``, with the run's checkpoints/ and config.json
    and the tokenizer as inputs; inside the run directory only ``RUN/hf`` and below, the
    conventional place of its exports (``export_every_save``, ``train.export_every_save``).
    ``every``: ``out`` holds one export per tag and is added to, never replaced."""
    real_out, real_run = Path(os.path.realpath(out)), Path(os.path.realpath(run_dir))
    real_hf = Path(os.path.realpath(rundir.hf_dir(run_dir)))
    if real_out.is_relative_to(real_run) and not real_out.is_relative_to(real_hf):
        raise UserError(
            f"--out {out}: that is the run directory {run_dir} or lies inside it, and a run's "
            f"files are its own: an export goes under {rundir.hf_dir(run_dir)} (e.g. "
            f"{rundir.hf_dir(run_dir, 'final')}) or outside the run."
        )
    inputs = [rundir.checkpoints_dir(run_dir), rundir.config_path(run_dir), *inputs]
    if every:
        claim_output(out, in_place=True, what="exports", inputs=inputs)
    else:
        what = "model exported by anneal export"
        claim_output(out, force=force, made_by_us=is_export, what=what, inputs=inputs)


def _partial_dir(out: Path) -> Path:
    """Where an export is written and verified before it replaces ``out``: a failed or
    interrupted export never leaves a half-written model under the name asked for. The name
    is new (process id and a random part), so nothing already there is touched; a killed
    export leaves its ``.NAME.partial-*`` beside ``out``, to be removed by hand."""
    partial = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        partial.mkdir(parents=True)
    except OSError as e:
        raise UserError(
            f"--out {out}: cannot create a directory beside it ({e.strerror or e}). Choose a "
            f"directory you can write to."
        ) from None
    return partial


def export(
    run_dir: Path,
    *,
    out: Path,
    tag: str | None = None,
    dtype: str = "bf16",
    shard_size: str = "5GB",
    force: bool = False,
    tokenizer: Path | None = None,
    verify: bool = True,
) -> dict:
    """Write a Hugging Face model directory from a run's checkpoint; return a report
    (checkpoint, files, bytes, peak memory of the conversion, verification numbers).

    Everything is checked before anything is written: the run's config.json, ``tag`` (one
    checkpoint of this run), the manifest (confined names), ``out`` (``_claim_out``), the
    checkpoint's bytes against its manifest and every file through torch's weights-only loader
    (``anneal.resilience.safeload``). With
    ``force``, only an earlier export (its ``anneal_export.json``) or an empty directory is
    replaced, once the new one is verified."""
    run_dir, out = Path(run_dir), Path(out)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}.")
    shard_bytes = parse_size(shard_size)
    record = rundir.read_record(run_dir, section="model")
    preset = preset_from_record(record)
    tag_dir = select_checkpoint(run_dir, tag)
    manifest = checkpoint.read_manifest(tag_dir)
    tp = tensor_parallel_size(tag_dir, manifest)
    tok_dir = tokenizer_dir(record, manifest, tokenizer)
    _claim_out(out, run_dir=run_dir, inputs=[tok_dir], force=force, every=False)
    check_for_export(tag_dir, manifest)
    _refuse_sparse_tp(tag_dir, tp, preset)
    with open_weights(tag_dir, tp, preset, record.path) as ckpt:
        partial = _partial_dir(out)
        try:
            report = convert(
                ckpt,
                partial,
                preset=preset,
                dtype=dtype,
                shard_bytes=shard_bytes,
                tok_dir=tok_dir,
                manifest=manifest,
            )
            report = {"run_dir": str(run_dir), **report, "out": str(out)}
            report["tensor_parallel_size"] = tp
            if verify:
                report["verify"] = verify_export(
                    partial,
                    tag_dir=tag_dir,
                    zero_stage=report["zero_stage"],
                    tensor_parallel=tp,
                    preset=preset,
                    dtype=dtype,
                    data_tokenizer=tok_dir,
                )
        except ExportMismatch as e:
            raise ExportMismatch(f"{e} The failed export is kept in {partial}.") from e
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    write_marker(partial, report)
    replace_dir(partial, out)
    return report


def _refuse_sparse_tp(tag_dir: Path, tp: int, preset) -> None:
    """A sparse model saved by several tensor-parallel ranks is not exported."""
    if tp > 1 and preset.is_moe:
        raise UserError(
            f"{tag_dir}: a sparse model saved by {tp} tensor-parallel ranks; anneal export "
            f"reads sparse checkpoints of one tensor-parallel rank (any expert-parallel "
            f"degree). Export a run trained without AutoTP."
        )


def export_every_save(run_dir: Path, *, out: Path, force: bool = False, **kwargs) -> list[dict]:
    """Export every intact checkpoint of a run to ``out/<tag>``; tags already exported there
    (an ``anneal_export.json`` present) are skipped unless ``force``. ``out`` itself is only
    added to, and claimed as such: never ``.``, the run or an input."""
    run_dir, out = Path(run_dir), Path(out)
    rundir.read_record(run_dir, section="model")  # a run's config.json, or a UserError
    tags = checkpoint.intact_checkpoints(rundir.checkpoints_dir(run_dir))
    if not tags:
        select_checkpoint(run_dir, None)  # raises the no-checkpoint UserError
    _claim_out(out, run_dir=run_dir, inputs=[], force=True, every=True)
    reports = []
    for tag_dir in tags:
        dest = out / tag_dir.name
        if is_export(dest) and not force:
            continue
        reports.append(export(run_dir, out=dest, tag=tag_dir.name, force=True, **kwargs))
    return reports


def format_report(r: dict) -> str:
    gib = 2**30
    tp = r.get("tensor_parallel_size", 1)
    layout = f", tensor-parallel {tp}" if tp > 1 else ""
    lines = [
        f"exported {r['checkpoint']} (step {r['step']}, ZeRO stage {r['zero_stage']}, "
        f"{r['world_size']} rank(s){layout}) -> {r['out']}",
        f"  {r['params']:,} parameters as {r['dtype']} in {len(r['files'])} file(s); "
        f"conversion {r['convert_s']:.1f} s",
    ]
    if r.get("peak_rss_bytes") and r.get("rss_before_bytes"):
        grew = r["peak_rss_bytes"] - r["rss_before_bytes"]
        lines.append(
            f"  memory: peak RSS {r['peak_rss_bytes'] / gib:.2f} GiB, "
            f"{max(grew, 0) / gib:.3f} GiB above the process before conversion; model "
            f"{r['model_bytes_fp32'] / gib:.3f} GiB fp32, largest tensor "
            f"{r['largest_tensor_bytes_fp32'] / gib:.3f} GiB"
        )
    v = r.get("verify")
    if v:
        lines.append(
            f"  verified: transformers loads it; max |logit diff| {v['max_abs_logit_diff']:.3g} "
            f"(tolerance {v['tolerance']:.3g}); {r['dtype']} rounding moves logits by "
            f"{v['dtype_rounding_diff']:.3g}"
        )
    return "\n".join(lines)
