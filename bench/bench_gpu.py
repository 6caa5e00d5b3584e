"""The GPU benchmark behind ``bench/gpu.sh``: tokens/s, TFLOP/s, MFU and peak memory of the 1b
and 125m recipes on one GPU, bf16, ZeRO-1 and ZeRO-3, sequence 2048, activation checkpointing
off and on, and optional rows: the sparse models (tiny-moe, and OLMoE-1B-7B's shape at 8 of its
16 layers) through AutoEP at ZeRO-2, and 1b at sequence 32K with the chunked and the plain loss
(docs/benchmarks.md, "GPU"). A row sized for a larger GPU than this one (``Row.gpu``) is
skipped, saying so.

Each configuration (a row) is its own ``python recipes/pretrain_<preset>.py`` process in its
own session, with a timeout: an OOM, a failed build or a hang costs that row only, which is
reported in the table with its reason, and the next row starts. The driver reads the run's
``metrics.jsonl`` while it trains and kills the process (SIGKILL to its session, so there is no
final checkpoint of many GB to wait for) once the warmup and measured steps are in. Rows go in
order of importance; a global deadline stops starting rows that no longer fit, and the table is
printed whatever happened.

MFU is ``(6N + 12*L*H*Q*T) * tokens/s / peak`` (``anneal.model.flops_per_token``; N without the
input embedding, and a sparse model's active parameters) against the dense bf16 peak that
``anneal.hardware`` gives the device (989 TFLOP/s for the H100 and H200 SXM). The driver
computes it from the model in each run's ``config.json`` and checks it against the ``mfu`` the
run itself logged.

    bash bench/gpu.sh LOGDIR                 # the GPU benchmark (sets up python, then this)
    bash bench/gpu.sh --cpu-smoke LOGDIR     # the same code path on CPU: tiny preset, fp32
    python bench/bench_gpu.py --smoke        # = --cpu-smoke into a temporary LOGDIR
    python bench/bench_gpu.py                # no GPU: says so and exits 0 (``make bench``)

LOGDIR gets at most five files: gpu_bench.log (gpu.sh's whole console), rows.log (every row's
command and output), env.txt (versions, device, ds_report), results.jsonl (one line per row, as
rows finish) and table.md. The last stdout line is one JSON document of the results.

The parts, one idea each: ``gpu_rows`` (the rows and their commands), ``gpu_measure`` (one row
run, stopped and measured), ``gpu_probe`` (what the benchmarked python has), ``gpu_table`` (the
table, its header and the JSON line). This file sets up, runs the rows in order under the
deadline and writes the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpu_measure import RUNNING, kill_session, measure  # noqa: E402
from gpu_probe import ds_report, probe  # noqa: E402
from gpu_rows import Row, cpu_rows, gpu_rows  # noqa: E402
from gpu_table import H100_H200_PEAK, header, reading, report_fragment, summary, table  # noqa: E402

from anneal.hardware import GPUS  # noqa: E402

TABLE_RESERVE_S = 8.0
"""Seconds kept back at the deadline for the table and files."""
GPU_BUDGET_S = 470.0
"""Seconds for everything on a GPU (``--budget-s``'s default), counted from gpu.sh's start:
with the set-up and the table, within the device tool's 10 minutes a command."""


@dataclasses.dataclass(kw_only=True)
class Setup:
    """What every row of one invocation shares: the python under test and its environment,
    the mode, the clock and the directories."""

    python: str
    env: dict
    cpu: bool
    t0: float
    """Wall-clock start (gpu.sh's, through $ANNEAL_BENCH_T0, when set)."""
    deadline: float
    logdir: Path
    work: Path
    info: dict = dataclasses.field(default_factory=dict)
    """The probe's answer."""
    data: Path | None = None

    @property
    def rows_log(self) -> Path:
        return self.logdir / "rows.log"

    @property
    def results_path(self) -> Path:
        return self.logdir / "results.jsonl"

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.1f}s] {msg}", flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logdir", nargs="?", help="directory for the logs (default: a new temp dir)")
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="the same code path on CPU: tiny preset, fp32, cpu.json, 3 steps a row",
    )
    p.add_argument(
        "--smoke", action="store_true", help="the benchmark protocol's smoke: --cpu-smoke"
    )
    p.add_argument("--report", help="also write a markdown fragment for docs/benchmarks.md here")
    p.add_argument("--data", help="a prepared data directory (default: prepare stdlib in --work)")
    p.add_argument(
        "--work",
        help="scratch directory for data, runs and row logs "
        "(default: $ANNEAL_BENCH_WORK, else a new private directory from mkdtemp: a fixed "
        "path under /tmp could be made first by another user of the host, with JIT-built "
        "extensions in it for this process to load)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        help="seconds for everything, counted from "
        "$ANNEAL_BENCH_T0 (gpu.sh's start) when set (default 470 on GPU, 900 on CPU)",
    )
    p.add_argument("--only", help="comma-separated row names to run (default: all)")
    p.add_argument(
        "--inject-set",
        action="append",
        default=[],
        metavar="ROW=KEY=VALUE",
        help="add --set KEY=VALUE to one row (to test the failure path)",
    )
    return p


def child_env(*, cpu: bool) -> dict:
    """The rows' environment: unbuffered, offline, this checkout first on PYTHONPATH; on the CPU
    smoke, no GPU visible."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *[x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x]]
    )
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def no_gpu_here(python: str, env: dict) -> dict | None:
    """`make bench` runs every benchmark with no arguments: where torch sees no GPU, the JSON
    line that says so (and exit 0) instead of a failure. The quick probe: torch alone answers,
    without the seconds of importing DeepSpeed and transformers."""
    info = probe(python, env, quick=True)
    if info.get("cuda_available"):
        return None
    return {
        "bench": "gpu",
        "skipped": "no CUDA GPU here; bench/gpu.sh LOGDIR runs it on one, --smoke runs its CPU "
        "smoke",
        "probe": info.get("error") or info.get("device"),
    }


def make_dirs(args, *, cpu: bool, env: dict) -> tuple[Path, Path]:
    """LOGDIR (with rows.log and results.jsonl emptied) and WORK, both made."""
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="anneal-gpu-bench-"))
    logdir.mkdir(parents=True, exist_ok=True)
    work = Path(
        args.work
        or os.environ.get("ANNEAL_BENCH_WORK")
        or tempfile.mkdtemp(prefix="anneal-gpu-bench-work-")
    )
    work.mkdir(parents=True, exist_ok=True)
    if not cpu:
        env.setdefault("TORCH_EXTENSIONS_DIR", str(work / "torch_extensions"))
    (logdir / "rows.log").write_text("")
    (logdir / "results.jsonl").write_text("")
    return logdir, work


def select_rows(p, args, *, cpu: bool) -> tuple[list[Row], dict[str, list[str]]]:
    """The rows ``--only`` names (all by default) and the ``--inject-set`` items of each."""
    rows = cpu_rows() if cpu else gpu_rows()
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {r.name for r in rows}
        if unknown:
            p.error(f"--only: unknown rows {sorted(unknown)}; rows: {[r.name for r in rows]}")
        rows = [r for r in rows if r.name in wanted]
    inject: dict[str, list[str]] = {}
    for item in args.inject_set:
        name, sep, kv = item.partition("=")
        if not sep or name not in {r.name for r in rows}:
            p.error(f"--inject-set {item}: expected ROW=KEY=VALUE with a row of this run")
        inject.setdefault(name, []).append(kv)
    return rows, inject


def check_python(s: Setup) -> int | None:
    """Probe the python under test into env.txt; 2 if it cannot run the benchmark."""
    s.info = probe(s.python, s.env)
    s.log(f"python {s.python}: " + json.dumps(s.info))
    (s.logdir / "env.txt").write_text(json.dumps(s.info, indent=2) + "\n")
    if "error" in s.info:
        s.log(f"cannot run: {s.info['error']}")
        return 2
    if not s.cpu and not s.info.get("cuda_available"):
        s.log("no CUDA GPU visible to this python: nothing to measure (--cpu-smoke runs on CPU)")
        return 2
    if not s.cpu and s.info.get("peak_flops") != H100_H200_PEAK:
        s.log(
            f"note: {s.info.get('device')} is not an H100/H200 SXM: MFU is against "
            f"{s.info.get('peak_flops', 0) / 1e12:.0f} TFLOP/s"
        )
    return None


def prepare_data(python: str, work: Path, env: dict, log, timeout_s: float = 240) -> Path:
    """The stdlib corpus (vocab 8192) in WORK/data, prepared once."""
    data = work / "data" / "stdlib"
    if (data / "meta.json").exists():
        return data
    shutil.rmtree(data, ignore_errors=True)
    cmd = [python, "-m", "anneal.cli", "data", "prepare", "--input", "stdlib", "--out", str(data)]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=REPO)
    log(f"data: {' '.join(cmd[1:])}: exit {out.returncode} in {time.monotonic() - t0:.1f} s")
    if out.returncode != 0 or not (data / "meta.json").exists():
        raise SystemExit(f"data preparation failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return data


# --- the rows ------------------------------------------------------------------------------------


def run_rows(s: Setup, rows: list[Row], inject: dict) -> tuple[list[dict], list[int]]:
    """Every row in order, each appended to results.jsonl as it finishes; a row that no longer
    fits before the deadline is skipped. SIGTERM (the outer timeout) stops the row running and
    keeps the rows so far. Returns (results, the signals that interrupted)."""
    results: list[dict] = []
    interrupted = []

    def on_signal(signum, frame):  # the outer timeout: stop the row, still write the table
        interrupted.append(signum)
        for proc in list(RUNNING):
            kill_session(proc)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    last_wall: dict[tuple[str, int, str], float] = {}
    try:
        for row in rows:
            result = run_row(s, row, inject=inject.get(row.name, ()), last_wall=last_wall)
            for k in ("est_s", "timeout_s"):
                result.pop(k, None)
            results.append(result)
            with open(s.results_path, "a") as f:
                f.write(json.dumps(result) + "\n")
            log_result(s, row, result)
    except KeyboardInterrupt:
        s.log(f"interrupted (signal {interrupted or 'SIGINT'}): the table holds the rows so far")
    return results, interrupted


def run_row(s: Setup, row: Row, *, inject, last_wall: dict[tuple[str, int, str], float]) -> dict:
    """One row's result line: measured, or skipped (no nvcc, or out of time) with its reason.
    ``last_wall`` holds the wall time of the last measured row of each preset, sequence length
    and ``train.compile``, the estimate for the next (an eager row's time says nothing of a
    compiled twin's first step)."""
    left = s.deadline - time.time() - TABLE_RESERVE_S
    key = (row.preset, row.seq_len, row.compile)
    est = last_wall.get(key, 0) * 1.15 or row.est_s
    if row.optimizer == "ds-fused" and key in last_wall:
        est += row.est_s - 75  # the JIT build on top of a measured row of this size
    skip = None
    if row.needs_nvcc and not s.info.get("nvcc"):
        skip = "no nvcc on PATH (FusedAdam is JIT-built with it)"
    elif not s.cpu and too_small(row, s.info.get("memory_gib")):
        skip = (
            f"sized for an {GPUS[row.gpu].name} by Anneal's memory estimate; this GPU has "
            f"{s.info.get('memory_gib')} GiB"
        )
    elif left < est:
        skip = f"out of time ({left:.0f} s left, needs ~{est:.0f} s)"
    if skip:
        return {**dataclasses.asdict(row), "status": "skipped", "reason": skip}
    s.log(f"{row.name}: start (timeout {min(row.timeout_s, left):.0f} s)")
    try:
        result = measure(
            row,
            python=s.python,
            data=s.data,
            work=s.work,
            rows_log=s.rows_log,
            cpu=s.cpu,
            timeout_s=min(row.timeout_s, left),
            env=s.env,
            inject=inject,
        )
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        # A bug or a surprise in the driver costs this row, not the table.
        result = {**dataclasses.asdict(row), "status": "error"}
        result["reason"] = f"driver: {type(e).__name__}: {e}"
    if result["status"] == "ok":
        last_wall[key] = result["wall_s"]
    return result


def too_small(row: Row, memory_gib: float | None) -> bool:
    """Whether a GPU of ``memory_gib`` lacks the memory of the GPU the row is sized for (less
    than 90% of it: torch reports a little under the nominal size)."""
    need = GPUS[row.gpu].memory_bytes / 2**30
    return memory_gib is not None and memory_gib < 0.9 * need


def log_result(s: Setup, row: Row, result: dict) -> None:
    if result["status"] == "ok":
        s.log(
            f"{row.name}: {result['tokens_per_s']:,.0f} tokens/s, {result['tflops']:.1f} "
            f"TFLOP/s, MFU {100 * result['mfu']:.1f}%, peak {result['peak_mem_gib']:.1f} "
            f"GiB (first step after {result['first_step_s']:.0f} s, row "
            f"{result['wall_s']:.0f} s)"
        )
    else:
        s.log(f"{row.name}: {result['status']}: {result['reason']}")


# --- main ----------------------------------------------------------------------------------------


def finish(s: Setup, results: list[dict], *, interrupted: list, report: str | None) -> int:
    """ds_report into env.txt if there is time, then the table (printed, table.md, the report
    fragment) and the JSON line. Returns the exit status: 0 if a row was measured and no
    required row failed."""
    if s.deadline - time.time() > 30 and not interrupted:  # diagnostics, after the figures
        with open(s.logdir / "env.txt", "a") as f:
            timeout_s = min(60, s.deadline - time.time() - 5)
            f.write("\n" + ds_report(s.python, s.env, timeout_s=timeout_s))
    head = header(s.info, results, cpu=s.cpu)
    text = head + "\n\n" + table(results) + "\n\n" + reading(results, cpu=s.cpu)
    print("\n" + text, flush=True)
    (s.logdir / "table.md").write_text(text + "\n")
    device = s.info.get("device", "?")
    if report:
        Path(report).write_text(report_fragment(device, text, cpu=s.cpu))
    print(json.dumps(summary(results, cpu=s.cpu, device=device, logdir=str(s.logdir))))
    measured = any(r["status"] == "ok" for r in results)
    required_failed = any(
        r["status"] not in ("ok", "skipped") and not r["optional"] for r in results
    )
    return 0 if measured and not required_failed and not interrupted else 1


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    cpu = args.cpu_smoke or args.smoke
    t0 = float(os.environ.get("ANNEAL_BENCH_T0") or time.time())
    budget = args.budget_s if args.budget_s is not None else (900.0 if cpu else GPU_BUDGET_S)
    python, env = sys.executable, child_env(cpu=cpu)
    if not cpu and not args.logdir:  # `make bench`: no arguments
        skipped = no_gpu_here(python, env)
        if skipped:
            print(json.dumps(skipped))
            return 0
    logdir, work = make_dirs(args, cpu=cpu, env=env)
    s = Setup(
        python=python, env=env, cpu=cpu, t0=t0, deadline=t0 + budget, logdir=logdir, work=work
    )
    rows, inject = select_rows(p, args, cpu=cpu)
    code = check_python(s)
    if code is not None:
        return code
    s.data = Path(args.data) if args.data else prepare_data(python, work, env, s.log)
    results, interrupted = run_rows(s, rows, inject)
    return finish(s, results, interrupted=interrupted, report=args.report)


if __name__ == "__main__":
    sys.exit(main())
