"""The runs a scaling law is fitted to: N parameters, D tokens and final loss of each, read from
Anneal run directories or from a CSV."""

from __future__ import annotations

import csv
import dataclasses
import statistics
from pathlib import Path

from anneal.errors import UserError


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPoint:
    """One finished run: N parameters, D training tokens, final loss in nats per token."""

    params: float
    tokens: float
    loss: float
    source: str = ""


def read_run(run_dir: str | Path) -> RunPoint:
    """N (all parameters, embeddings included, as Hoffmann counted; of a sparse model the
    active ones, as ``anneal.planning.sparse`` reads the law), D (tokens consumed) and the last
    validation loss of a run directory."""
    from anneal.rundir import config_path, metrics_path, read_metrics, record_or_empty

    run_dir = Path(run_dir)
    cfg_path = config_path(run_dir)
    if not cfg_path.is_file() or not metrics_path(run_dir).is_file():
        raise UserError(
            f"{run_dir}: not a run directory (it needs config.json and metrics.jsonl, which "
            f"every Anneal run writes). Give run directories, or --csv with params,tokens,loss."
        )
    record = record_or_empty(run_dir)
    if not record.model:
        raise UserError(
            f"{cfg_path}: not the config.json an Anneal run writes (not JSON, or no model "
            f"section); give "
            f"run directories, or --csv with params,tokens,loss."
        )
    params = record.params
    if isinstance(record.model.get("moe"), dict):  # a sparse model: its active parameters
        from anneal.model import active_params, preset_from_dict

        params = active_params(preset_from_dict(record.model, source=str(cfg_path)))
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val" and r.get("val_loss") is not None]
    if not params or not train or not val:
        raise UserError(
            f"{run_dir}: has no parameter count or no train and val rows in metrics.jsonl; "
            f"the fit needs finished runs (a validation after the last step)."
        )
    last = train[-1]
    if val[-1]["step"] != last["step"]:
        raise UserError(
            f"{run_dir}: the last validation is at step {val[-1]['step']} but training went "
            f"to step {last['step']}; the fit needs the loss at the end of training. Finish "
            f"the run (it validates after its last step) or drop it."
        )
    return RunPoint(
        params=float(params),
        tokens=float(last["tokens"]),
        loss=float(val[-1]["val_loss"]),
        source=str(run_dir),
    )


def read_runs(paths: list[str | Path]) -> tuple[list[RunPoint], list[str]]:
    """:func:`read_run` of each path, and the paths skipped. Several paths come from a glob
    (``anneal fit runs/scaling_sweep/*`` also matches the sweep's fit.json, fit.png and
    sweep.json), so among several, one that exists but is no run directory (a file, or a
    directory with neither config.json nor metrics.jsonl) is skipped; a lone path, a path
    that does not exist (a glob that matched nothing) and a broken run stay errors."""
    from anneal.rundir import config_path, metrics_path

    def not_a_run(p: Path) -> bool:
        if not p.exists():
            return False
        return not p.is_dir() or not (config_path(p).exists() or metrics_path(p).exists())

    skip = [len(paths) > 1 and not_a_run(Path(p)) for p in paths]
    skipped = [str(p) for p, s in zip(paths, skip, strict=True) if s]
    if skipped and len(skipped) == len(paths):
        raise UserError(
            f"none of the {len(paths)} paths is a run directory (config.json and "
            f"metrics.jsonl): {', '.join(skipped)}. Give run directories, or --csv with "
            f"params,tokens,loss."
        )
    return [read_run(p) for p, s in zip(paths, skip, strict=True) if not s], skipped


def read_csv(path: str | Path) -> list[RunPoint]:
    """Rows of a CSV with a header naming ``params``, ``tokens`` and ``loss`` columns."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"--csv {path}: cannot read it ({e}).") from None
    points = []
    for i, row in enumerate(rows, start=2):
        try:
            p = RunPoint(
                params=float(row["params"]),
                tokens=float(row["tokens"]),
                loss=float(row["loss"]),
                source=f"{path}:{i}",
            )
        except (KeyError, TypeError, ValueError):
            raise UserError(
                f"--csv {path}, line {i}: needs numbers in columns params, tokens and loss "
                f"(header: params,tokens,loss), got {dict(row)}."
            ) from None
        points.append(p)
    return points


def mfu_from_run(run_dir: str | Path) -> tuple[float, str]:
    """Median MFU of a run's train rows (the first 10% of steps skipped as warm-up)."""
    from anneal.rundir import read_metrics, record_or_empty

    try:
        train = read_metrics(run_dir, "train")
    except UserError as e:
        raise UserError(f"--mfu-from {run_dir}: {e} Or give --mfu M.") from None
    mfus = [r["mfu"] for r in train if r.get("mfu") is not None]
    if not mfus:
        raise UserError(
            f"--mfu-from {run_dir}: its metrics.jsonl has no train rows with an mfu value; give "
            f"a run that trained at least one step, or --mfu M."
        )
    device = record_or_empty(run_dir).device  # only a label
    kept = mfus[len(mfus) // 10 :] or mfus
    mfu = statistics.median(kept)
    if not 0 < mfu <= 1:
        why = (
            "That run measured it against a device peak that was too small (a CPU peak "
            "measured on a busy machine; runs logged since MFU is capped at 100% do not show "
            "this)"
            if mfu > 1
            else "That run logged no throughput"
        )
        raise UserError(
            f"--mfu-from {run_dir}: the median MFU of its train rows is {mfu:.1%}, and MFU is a "
            f"fraction of peak in (0, 100%]. {why}. Give --mfu M instead, or another run."
        )
    return mfu, f"median over {len(kept)} steps of {run_dir} ({device})"
