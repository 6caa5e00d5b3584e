"""One row of the GPU benchmark, run and measured: its recipe process started in its own
session, followed through the run's ``metrics.jsonl`` and killed (SIGKILL to the session, so
there is no final checkpoint of many GB to wait for) once the warmup and measured steps are in,
or at its timeout; then its result line, with the reason in the log's own words when it failed.

The arithmetic is here too: FLOPs per token (``6N + 12*L*H*Q*T``, ``anneal.model``), the memory
estimate of ``anneal.planning.memory`` and TFLOP/s and MFU of a throughput. The peak a row is
divided by is the one its run logged (tokens/s x FLOPs per token / its ``mfu``), so that the
driver checks the run's own figure instead of trusting it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

from gpu_rows import REPO, Row

RUNNING: list[subprocess.Popen] = []
"""The row processes alive now: the driver's SIGTERM handler kills their sessions."""


# --- arithmetic ----------------------------------------------------------------------------------


def flops_per_token(model_doc: dict) -> float:
    """``6N + 12*L*H*Q*T`` for the ``model`` section of a run's config.json (N: a sparse
    model's active parameters)."""
    from anneal.model import flops_per_token as count
    from anneal.model import preset_from_dict

    preset = preset_from_dict(model_doc, source="config.json", prefix="model.")
    return count(preset, seq_len=model_doc["seq_len"])


def active_params(model_doc: dict) -> int:
    """The parameters a token runs through (all of a dense model's)."""
    from anneal.model import active_params as count
    from anneal.model import preset_from_dict

    return count(preset_from_dict(model_doc, source="config.json", prefix="model."))


def memory_estimate_gib(doc: dict) -> float:
    """``anneal.planning.memory``'s peak per GPU for a run's config.json, in GiB (compared with the
    measured peak in results.jsonl)."""
    from anneal.model import preset_from_dict
    from anneal.planning.memory import Workload, ZeroSetup, estimate

    preset = preset_from_dict(doc["model"], source="config.json", prefix="model.")
    ds = doc["ds_config"]
    work = Workload(
        micro_batch=ds["train_micro_batch_size_per_gpu"],
        seq_len=doc["model"]["seq_len"],
        n_gpus=doc["launch"]["world_size"],
        activation_checkpointing=doc["run"]["model"]["activation_checkpointing"],
    )
    return estimate(preset, ZeroSetup.from_ds_config(ds), work).total / 2**30


def figures(flops_tok: float, tokens_per_s: float, peak: float) -> tuple[float, float]:
    """(TFLOP/s, MFU) of a throughput."""
    achieved = flops_tok * tokens_per_s
    return achieved / 1e12, achieved / peak


# --- the process ---------------------------------------------------------------------------------


def read_train_rows(path: Path) -> list[dict]:
    """The ``kind: train`` rows of a metrics.jsonl being written (a torn last line is skipped)."""
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("kind") == "train":
            rows.append(row)
    return rows


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the process's whole session (it was started with start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_until(cmd, *, log_path: Path, metrics: Path, steps: int, timeout_s: float, env=None):
    """Run ``cmd`` until ``metrics`` holds ``steps`` train rows, it exits, or the timeout.

    Returns (status, exit code or None, train rows, seconds to the first train row, wall s).
    status: ok | exited | timeout.
    """
    start = time.monotonic()
    first_row_s = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
            cwd=REPO,
        )
        RUNNING.append(proc)
        try:
            while True:
                code = proc.poll()
                rows = read_train_rows(metrics)
                if rows and first_row_s is None:
                    first_row_s = time.monotonic() - start
                if len(rows) >= steps:
                    status = "ok"
                    break
                if code is not None:
                    status = "exited"
                    break
                if time.monotonic() - start > timeout_s:
                    status = "timeout"
                    break
                time.sleep(0.2)
        finally:
            kill_session(proc)
            RUNNING.remove(proc)
    return status, code, rows, first_row_s, time.monotonic() - start


_REASON = re.compile(
    r"^(error\b.*|.*\b(\w*Error|\w*Exception|OutOfMemory\w*)\b:.*|.*out of memory.*|Killed)$",
    re.IGNORECASE,
)


def failure_reason(log_text: str) -> str:
    """The line that says why a row's process failed: the last error-looking line, else the
    last line."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if _REASON.match(line) and not line.startswith("warnings.warn"):
            reason = line
            break
    else:
        reason = lines[-1] if lines else "no output"
    if "out of memory" in log_text.lower() or "OutOfMemoryError" in log_text:
        reason = "OOM: " + reason
    return reason if len(reason) <= 240 else reason[:237] + "..."


# --- one row -------------------------------------------------------------------------------------


def measure(
    row: Row,
    *,
    python: str,
    data: Path,
    work: Path,
    rows_log: Path,
    cpu: bool,
    timeout_s: float,
    env: dict,
    inject=(),
) -> dict:
    """Run one row and return its result line."""
    out = work / "runs" / row.name
    shutil.rmtree(out, ignore_errors=True)
    cmd = row.command(python, data=data, out=out, cpu=cpu, inject=inject)
    own_log = work / "logs" / f"{row.name}.log"
    own_log.parent.mkdir(parents=True, exist_ok=True)
    need = row.warmup + row.measure
    status, code, steps, first_s, wall = run_until(
        cmd,
        log_path=own_log,
        metrics=out / "metrics.jsonl",
        steps=need,
        timeout_s=timeout_s,
        env=env,
    )
    text = own_log.read_text(errors="replace")
    result = {
        **{k: v for k, v in dataclasses.asdict(row).items() if k not in ("est_s", "timeout_s")},
        "status": status,
        "wall_s": round(wall, 1),
        "first_step_s": first_s and round(first_s, 1),
        "steps_done": len(steps),
    }
    from anneal.rundir import config_path, record_or_empty

    doc = record_or_empty(out).doc or None
    if doc is None and status == "ok":
        status, result["status"] = "error", "error"
        result["reason"] = f"the run wrote no readable {config_path(out)}"
    if doc:
        result.update(_config_figures(doc))
    if status == "ok":
        result.update(_step_figures(row, steps, flops_tok=result["flops_per_token"]))
        if row.save_every:
            result.update(save_figures(out / "metrics.jsonl"))
    else:
        if status == "timeout":
            result["reason"] = (
                f"timeout after {timeout_s:.0f} s ({len(steps)} of {need} steps); last output: "
                f"{failure_reason(text)}"
            )
        else:
            result["reason"] = f"exit {code}: {failure_reason(text)}"
        result["exit_code"] = code
    with open(rows_log, "a") as f:
        f.write(f"\n===== {row.name}: {status} ({wall:.1f} s)\n$ {' '.join(cmd)}\n")
        f.write(text)
        for s in steps:
            f.write("metrics " + json.dumps(s) + "\n")
    shutil.rmtree(out, ignore_errors=True)  # a killed run's directory holds no checkpoint
    return result


def save_figures(metrics: Path) -> dict:
    """A save row's figures from its events: the median seconds the loop waited at a save
    (``blocking_s`` of each ``checkpoint`` event, or of each ``snapshot`` of an asynchronous
    save, whose write may not be committed when the row is stopped) and of its background
    writes (``write_s`` of the committed ones; 0 for synchronous saves), and how many."""
    events = []
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("kind") == "event" and row.get("event") in ("snapshot", "checkpoint"):
            events.append(row)
    taken = [e for e in events if e["event"] == "snapshot"] or [
        e for e in events if e["event"] == "checkpoint"
    ]
    committed = [e for e in events if e["event"] == "checkpoint"]
    blocking = [e["blocking_s"] for e in taken if "blocking_s" in e]
    writes = [e.get("write_s", 0.0) for e in committed]
    return {
        "saves": len(taken),
        "saves_committed": len(committed),
        "save_blocking_s": statistics.median(blocking) if blocking else None,
        "save_write_s": statistics.median(writes) if writes else None,
    }


def _config_figures(doc: dict) -> dict:
    """What the run resolved, from its config.json: precision, batch, size, FLOPs, memory."""
    ds = doc["ds_config"]
    return dict(
        precision="bf16" if ds.get("bf16", {}).get("enabled") else "fp32",
        accum=ds["gradient_accumulation_steps"],
        micro=ds["train_micro_batch_size_per_gpu"],
        params=doc["model"]["params"],
        active_params=active_params(doc["model"]),
        flops_per_token=flops_per_token(doc["model"]),
        mem_estimate_gib=round(memory_estimate_gib(doc), 2),
        attention=doc.get("launch", {}).get("attention", "sdpa"),  # anneal.model.attention
    )


def _step_figures(row: Row, steps: list[dict], *, flops_tok: float) -> dict:
    """The median throughput of the measured steps (after the warmup) and what follows from it."""
    measured = steps[row.warmup : row.warmup + row.measure]
    tps = [s["tokens_per_s"] for s in measured]
    median = statistics.median(tps)
    # The peak the run divided by: tokens/s x FLOPs per token / its logged MFU.
    peaks = [flops_tok * s["tokens_per_s"] / s["mfu"] for s in measured]
    peak = statistics.median(peaks)
    tflops, mfu = figures(flops_tok, median, peak)
    return dict(
        tokens_per_s=round(median, 1),
        tokens_per_s_range=[round(min(tps), 1), round(max(tps), 1)],
        step_s=round(row.global_tokens / median, 3),
        tflops=round(tflops, 2),
        mfu=round(mfu, 4),
        mfu_logged=round(statistics.median(s["mfu"] for s in measured), 4),
        peak_flops=peak,
        peak_mem_gib=max(s.get("mem_max_gib", 0.0) for s in steps),
        # the loss after the same steps, which twin rows (compile, float8) compare
        last_loss=measured[-1]["loss"],
        last_step=measured[-1]["step"],
        compile_s=round(sum(s.get("compile_s", 0.0) for s in steps), 1),
    )
