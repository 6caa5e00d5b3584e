"""The GPU benchmark behind ``bench/gpu.sh``: tokens/s, TFLOP/s, MFU and peak memory of the 1b
and 125m recipes on one GPU, bf16, ZeRO-1 and ZeRO-3, sequence 2048, activation checkpointing
off and on (docs/benchmarks.md, "GPU").

Each configuration (a row) is its own ``python recipes/pretrain_<preset>.py`` process in its
own session, with a timeout: an OOM, a failed build or a hang costs that row only, which is
reported in the table with its reason, and the next row starts. The driver reads the run's
``metrics.jsonl`` while it trains and kills the process (SIGKILL to its session, so there is no
final checkpoint of many GB to wait for) once the warmup and measured steps are in. Rows go in
order of importance; a global deadline stops starting rows that no longer fit, and the table is
printed whatever happened.

MFU is ``(6N + 12*L*H*Q*T) * tokens/s / peak`` (``anneal.model.flops_per_token``; N without the
input embedding) against the dense bf16 peak that ``anneal.hardware`` gives the device (989
TFLOP/s for the H100 and H200 SXM). The driver computes it from the model in each run's
``config.json`` and checks it against the ``mfu`` the run itself logged.

    bash bench/gpu.sh LOGDIR                 # the GPU benchmark (sets up python, then this)
    bash bench/gpu.sh --cpu-smoke LOGDIR     # the same code path on CPU: tiny preset, fp32
    python bench/bench_gpu.py --smoke        # = --cpu-smoke into a temporary LOGDIR
    python bench/bench_gpu.py                # no GPU: says so and exits 0 (``make bench``)

LOGDIR gets at most five files: gpu_bench.log (gpu.sh's whole console), rows.log (every row's
command and output), env.txt (versions, device, ds_report), results.jsonl (one line per row, as
rows finish) and table.md. The last stdout line is one JSON document of the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

H100_H200_PEAK = 989e12
"""Dense bf16 peak of the H100 and H200 SXM, FLOP/s (what the issue measures MFU against)."""
GOAL_MFU = 0.45
LLM_FOUNDRY_1B_MFU = 0.418
"""llm-foundry's published MFU for its 1B model on H100 (its README's throughput table)."""
TABLE_RESERVE_S = 8.0
"""Seconds kept back at the deadline for the table and files."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One configuration: one process, one line of the table."""

    name: str
    preset: str
    zero: int
    ckpt: bool
    optimizer: str
    """torch-foreach | torch-fused | ds-fused (DeepSpeed's FusedAdam, JIT-built with nvcc)."""
    micro: int
    global_tokens: int
    seq_len: int
    warmup: int
    """Steps run and left out of the median (allocator growth, cuBLAS set-up, ZeRO-3 tracing)."""
    measure: int
    """Steps whose tokens/s make the median."""
    est_s: float
    """Expected wall time of the row, to decide whether it still fits before the deadline."""
    timeout_s: float
    precision: str = "bf16"
    ds_config: str = ""
    """A name in ds_configs/; empty: zero{stage}_bf16.json."""
    optional: bool = False
    """An extra row: its failure is reported but does not fail the script."""
    needs_nvcc: bool = False

    def sets(self, *, cpu: bool) -> list[str]:
        sets = [
            "train.eval_samples=0",  # no validation pass inside the measured steps
            "train.log_every=1",
            f"train.precision={self.precision}",
            f"model.seq_len={self.seq_len}",
            f"model.activation_checkpointing={str(self.ckpt).lower()}",
            f"optim.global_batch_tokens={self.global_tokens}",
            f"ds.train_micro_batch_size_per_gpu={self.micro}",
            f"ds.zero_optimization.stage={self.zero}",
            f"ds.optimizer.params.torch_adam={str(self.optimizer != 'ds-fused').lower()}",
        ]
        if self.optimizer == "torch-fused":
            sets.append("ds.optimizer.params.fused=true")
        return sets

    def command(self, python: str, *, data: Path, out: Path, cpu: bool, inject=()) -> list[str]:
        cmd = [
            python,
            str(REPO / "recipes" / f"pretrain_{self.preset}.py"),
            "--data",
            str(data),
            "--out",
            str(out),
            "--ds-config",
            self.ds_config or f"zero{self.zero}_bf16.json",
            "--max-steps",
            "1000000",  # the driver stops it; the schedule's warmup stays long
            "--save-every",
            "0",
            "--eval-every",
            "0",
            "--resume",
            "none",
        ]
        for item in [*self.sets(cpu=cpu), *inject]:
            cmd += ["--set", item]
        return cmd


def gpu_rows() -> list[Row]:
    """Most important first: 1b ZeRO-1 (off, on), 1b ZeRO-3, then 125m, then the extras."""
    rows = []
    for preset, micro, tokens, est, timeout in (
        # 1b: 64 sequences of 2048 per step (accumulation 8); ~2 s a step at 400 TFLOP/s.
        ("1b", 8, 2**17, 75, 170),
        # 125m: 128 sequences per step (accumulation 8); well under 1 s a step.
        ("125m", 16, 2**18, 40, 110),
    ):
        for zero in (1, 3):
            for ckpt in (False, True):
                rows.append(
                    Row(
                        name=f"{preset}-z{zero}-{'ckpt' if ckpt else 'nockpt'}",
                        preset=preset,
                        zero=zero,
                        ckpt=ckpt,
                        optimizer="torch-foreach",
                        micro=micro,
                        global_tokens=tokens,
                        seq_len=2048,
                        warmup=3,
                        measure=5,
                        est_s=est,
                        timeout_s=timeout,
                    )
                )
    base = dict(
        preset="1b",
        zero=1,
        ckpt=False,
        micro=8,
        global_tokens=2**17,
        seq_len=2048,
        warmup=3,
        measure=5,
        est_s=75,
        timeout_s=170,
        optional=True,
    )
    rows += [
        Row(name="1b-z1-nockpt-torchfused", optimizer="torch-fused", **base),
        Row(
            name="1b-z1-nockpt-dsfused",
            optimizer="ds-fused",
            needs_nvcc=True,
            **{**base, "est_s": 180, "timeout_s": 300},  # + the FusedAdam JIT build
        ),
        Row(name="1b-z1-nockpt-micro16", optimizer="torch-foreach", **{**base, "micro": 16}),
    ]
    return rows


def cpu_rows() -> list[Row]:
    """The CPU smoke: the GPU rows' shape on the tiny preset in fp32 (ds_configs/cpu.json)."""
    common = dict(
        preset="tiny",
        micro=2,
        global_tokens=2 * 64,
        seq_len=64,
        warmup=1,
        measure=2,
        est_s=20,
        timeout_s=240,
        precision="fp32",
        ds_config="cpu.json",
        optimizer="torch-foreach",
    )
    return [
        Row(name="tiny-z1-nockpt", zero=1, ckpt=False, **common),
        Row(name="tiny-z1-ckpt", zero=1, ckpt=True, **common),
        Row(name="tiny-z3-nockpt", zero=3, ckpt=False, **common),
    ]


# --- arithmetic ----------------------------------------------------------------------------------


def flops_per_token(model_doc: dict) -> float:
    """``6N + 12*L*H*Q*T`` for the ``model`` section of a run's config.json."""
    from anneal.model import flops_per_token as count
    from anneal.model import preset_from_dict

    preset = preset_from_dict(model_doc, source="config.json", prefix="model.")
    return count(preset, seq_len=model_doc["seq_len"])


def memory_estimate_gib(doc: dict) -> float:
    """``anneal.scaling.memory``'s peak per GPU for a run's config.json, in GiB (compared with the
    measured peak in results.jsonl)."""
    from anneal.model import preset_from_dict
    from anneal.scaling.memory import Workload, ZeroSetup, estimate

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


# --- one row -------------------------------------------------------------------------------------


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


_CURRENT: list[subprocess.Popen] = []


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
        _CURRENT.append(proc)
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
            _CURRENT.remove(proc)
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
    doc = _read_json(out / "config.json")
    if doc is None and status == "ok":
        status, result["status"] = "error", "error"
        result["reason"] = f"the run wrote no readable {out / 'config.json'}"
    if doc:
        ds = doc["ds_config"]
        result.update(
            precision="bf16" if ds.get("bf16", {}).get("enabled") else "fp32",
            accum=ds["gradient_accumulation_steps"],
            micro=ds["train_micro_batch_size_per_gpu"],
            params=doc["model"]["params"],
            flops_per_token=flops_per_token(doc["model"]),
            mem_estimate_gib=round(memory_estimate_gib(doc), 2),
        )
    if status == "ok":
        measured = steps[row.warmup : row.warmup + row.measure]
        tps = [s["tokens_per_s"] for s in measured]
        median = statistics.median(tps)
        # The peak the run divided by: tokens/s x FLOPs per token / its logged MFU.
        peaks = [result["flops_per_token"] * s["tokens_per_s"] / s["mfu"] for s in measured]
        peak = statistics.median(peaks)
        tflops, mfu = figures(result["flops_per_token"], median, peak)
        result.update(
            tokens_per_s=round(median, 1),
            tokens_per_s_range=[round(min(tps), 1), round(max(tps), 1)],
            step_s=round(row.global_tokens / median, 3),
            tflops=round(tflops, 2),
            mfu=round(mfu, 4),
            mfu_logged=round(statistics.median(s["mfu"] for s in measured), 4),
            peak_flops=peak,
            peak_mem_gib=max(s.get("mem_max_gib", 0.0) for s in steps),
        )
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


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- the environment -----------------------------------------------------------------------------

PROBE = r"""
import json, os, platform, shutil, subprocess, sys
info = {"python": sys.version.split()[0], "executable": sys.executable}
import torch
info["torch"] = torch.__version__
info["cuda_available"] = torch.cuda.is_available()
info["torch_cuda"] = torch.version.cuda
for mod in ("deepspeed", "transformers", "sentencepiece", "numpy", "flash_attn"):
    try:
        m = __import__(mod)
        info[mod] = f"{m.__version__} ({os.path.dirname(m.__file__)})"
    except Exception as e:
        info[mod] = f"missing ({type(e).__name__})"
nvcc = shutil.which("nvcc")
info["nvcc"] = nvcc
if nvcc:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    info["nvcc_version"] = out.strip().splitlines()[-1] if out.strip() else "?"
info["cuda_home"] = os.environ.get("CUDA_HOME")
if torch.cuda.is_available():
    from anneal.hardware import device_peak_flops
    dev = torch.device("cuda", 0)
    info["device"] = torch.cuda.get_device_name(dev)
    info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    info["memory_gib"] = round(torch.cuda.get_device_properties(dev).total_memory / 2**30, 1)
    info["bf16"] = torch.cuda.is_bf16_supported()
    info["peak_flops"] = device_peak_flops(dev)
    try:  # the kernel SDPA picks for the model's shapes: causal bf16, head dim 128
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q = torch.randn(1, 16, 2048, 128, device=dev, dtype=torch.bfloat16)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.cuda.synchronize()
        info["sdpa_flash"] = True
    except Exception as e:
        info["sdpa_flash"] = f"no ({type(e).__name__}: {e})"[:200]
else:
    info["device"] = f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
print(json.dumps(info))
"""


def probe(python: str, env: dict, timeout_s: float = 120) -> dict:
    try:
        out = subprocess.run(
            [python, "-c", PROBE],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"probe timed out after {timeout_s:.0f} s"}
    lines = out.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"error": f"probe failed (exit {out.returncode}): {out.stderr.strip()[-600:]}"}


def ds_report(python: str, env: dict, timeout_s: float = 90) -> str:
    try:
        out = subprocess.run(
            [python, "-c", "from deepspeed.env_report import cli_main; cli_main()"],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
        )
        return out.stdout + out.stderr
    except subprocess.TimeoutExpired:
        return f"ds_report timed out after {timeout_s:.0f} s\n"


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


# --- the table -----------------------------------------------------------------------------------

OPTIMIZER_NAMES = {
    "torch-foreach": "torch AdamW (foreach)",
    "torch-fused": "torch AdamW (fused)",
    "ds-fused": "DeepSpeed FusedAdam",
}


def _fmt(value, spec: str, missing: str = "-") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else missing


def table(results: list[dict]) -> str:
    lines = [
        "| row | model | ZeRO | act. ckpt | optimizer | precision | micro x accum | tokens/s "
        "| TFLOP/s | MFU | peak mem GiB | step s | first step s | status |",
        "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        status = "ok" if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        status = status.replace("|", "/")
        accum = r.get("accum")
        lines.append(
            f"| {r['name']} | {r['preset']} | {r['zero']} | {'on' if r['ckpt'] else 'off'} "
            f"| {OPTIMIZER_NAMES.get(r['optimizer'], r['optimizer'])} | {r['precision']} "
            f"| {r['micro']} x {accum if accum is not None else '?'} "
            f"| {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('tflops'), '.1f')} "
            f"| {_fmt(r.get('mfu') and 100 * r['mfu'], '.1f')}{'%' if r.get('mfu') else ''} "
            f"| {_fmt(r.get('peak_mem_gib'), '.1f')} | {_fmt(r.get('step_s'), '.2f')} "
            f"| {_fmt(r.get('first_step_s'), '.0f')} | {status} |"
        )
    return "\n".join(lines)


def reading(results: list[dict], *, cpu: bool) -> str:
    ok = [r for r in results if r["status"] == "ok"]
    failed = [r["name"] for r in results if r["status"] not in ("ok", "skipped")]
    parts = []
    if cpu:
        parts.append(
            "CPU smoke of the GPU benchmark's code path (tiny preset, fp32, ds_configs/cpu.json); "
            "MFU is against this CPU's measured fp32 peak and means nothing for GPUs."
        )
    one_b = [r for r in ok if r["preset"] == "1b"]
    if one_b:
        best = max(one_b, key=lambda r: r["mfu"])
        verdict = "meets" if best["mfu"] >= GOAL_MFU else "misses"
        parts.append(
            f"Best 1b row: {best['name']} at {100 * best['mfu']:.1f}% MFU "
            f"({best['tflops']:.0f} TFLOP/s, {best['tokens_per_s']:,.0f} tokens/s), which "
            f"{verdict} the {100 * GOAL_MFU:.0f}% goal (llm-foundry: "
            f"{100 * LLM_FOUNDRY_1B_MFU:.1f}% for 1B on H100)."
        )
    if failed:
        parts.append(f"Rows that did not finish: {', '.join(failed)} (reasons in the table).")
    if not ok:
        parts.append("No row was measured.")
    return " ".join(parts)


# --- main ----------------------------------------------------------------------------------------


def main(argv=None) -> int:
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
    args = p.parse_args(argv)
    cpu = args.cpu_smoke or args.smoke
    t0 = float(os.environ.get("ANNEAL_BENCH_T0") or time.time())
    budget = args.budget_s if args.budget_s is not None else (900.0 if cpu else 470.0)
    deadline = t0 + budget
    python = sys.executable

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

    if not cpu and not args.logdir:  # `make bench`: no arguments
        info = probe(python, env)
        if not info.get("cuda_available"):
            print(
                json.dumps(
                    {
                        "bench": "gpu",
                        "skipped": "no CUDA GPU here; bench/gpu.sh LOGDIR "
                        "runs it on one, --smoke runs its CPU smoke",
                        "probe": info.get("error") or info.get("device"),
                    }
                )
            )
            return 0
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
    rows_log, results_path = logdir / "rows.log", logdir / "results.jsonl"
    rows_log.write_text("")
    results_path.write_text("")

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

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

    info = probe(python, env)
    log(f"python {python}: " + json.dumps(info))
    (logdir / "env.txt").write_text(json.dumps(info, indent=2) + "\n")
    if "error" in info:
        log(f"cannot run: {info['error']}")
        return 2
    if not cpu and not info.get("cuda_available"):
        log("no CUDA GPU visible to this python: nothing to measure (--cpu-smoke runs on CPU)")
        return 2
    if not cpu and info.get("peak_flops") != H100_H200_PEAK:
        log(
            f"note: {info.get('device')} is not an H100/H200 SXM: MFU is against "
            f"{info.get('peak_flops', 0) / 1e12:.0f} TFLOP/s"
        )
    data = Path(args.data) if args.data else prepare_data(python, work, env, log)

    results: list[dict] = []
    interrupted = []

    def on_signal(signum, frame):  # the outer timeout: stop the row, still write the table
        interrupted.append(signum)
        for proc in list(_CURRENT):
            kill_session(proc)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    last_wall: dict[str, float] = {}
    try:
        for row in rows:
            left = deadline - time.time() - TABLE_RESERVE_S
            est = last_wall.get(row.preset, 0) * 1.15 or row.est_s
            if row.optimizer == "ds-fused" and row.preset in last_wall:
                est += row.est_s - 75  # the JIT build on top of a measured row of this size
            skip = None
            if row.needs_nvcc and not info.get("nvcc"):
                skip = "no nvcc on PATH (FusedAdam is JIT-built with it)"
            elif left < est:
                skip = f"out of time ({left:.0f} s left, needs ~{est:.0f} s)"
            if skip:
                result = {**dataclasses.asdict(row), "status": "skipped", "reason": skip}
            else:
                log(f"{row.name}: start (timeout {min(row.timeout_s, left):.0f} s)")
                try:
                    result = measure(
                        row,
                        python=python,
                        data=data,
                        work=work,
                        rows_log=rows_log,
                        cpu=cpu,
                        timeout_s=min(row.timeout_s, left),
                        env=env,
                        inject=inject.get(row.name, ()),
                    )
                except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
                    # A bug or a surprise in the driver costs this row, not the table.
                    result = {**dataclasses.asdict(row), "status": "error"}
                    result["reason"] = f"driver: {type(e).__name__}: {e}"
                if result["status"] == "ok":
                    last_wall[row.preset] = result["wall_s"]
            for k in ("est_s", "timeout_s"):
                result.pop(k, None)
            results.append(result)
            with open(results_path, "a") as f:
                f.write(json.dumps(result) + "\n")
            if result["status"] == "ok":
                log(
                    f"{row.name}: {result['tokens_per_s']:,.0f} tokens/s, {result['tflops']:.1f} "
                    f"TFLOP/s, MFU {100 * result['mfu']:.1f}%, peak {result['peak_mem_gib']:.1f} "
                    f"GiB (first step after {result['first_step_s']:.0f} s, row "
                    f"{result['wall_s']:.0f} s)"
                )
            else:
                log(f"{row.name}: {result['status']}: {result['reason']}")
    except KeyboardInterrupt:
        log(f"interrupted (signal {interrupted or 'SIGINT'}): the table holds the rows so far")

    if deadline - time.time() > 30 and not interrupted:  # diagnostics, after the figures
        with open(logdir / "env.txt", "a") as f:
            f.write("\n" + ds_report(python, env, timeout_s=min(60, deadline - time.time() - 5)))
    text = table(results)
    words = reading(results, cpu=cpu)
    device = info.get("device", "?")
    versions = (
        f"torch {info.get('torch')} (CUDA {info.get('torch_cuda')}), "
        f"DeepSpeed {str(info.get('deepspeed')).split()[0]}, "
        f"transformers {str(info.get('transformers')).split()[0]}, Python {info.get('python')}"
    )
    peaks = sorted({r["peak_flops"] for r in results if r.get("peak_flops")})
    peak = info.get("peak_flops") or (peaks[0] if peaks else None)
    seqs = sorted({r["seq_len"] for r in results})
    header = (
        f"Device: {device}; {versions}. Sequence {', '.join(map(str, seqs))}; SDPA attention "
        f"(flash kernel: {info.get('sdpa_flash', 'n/a')}). MFU = (6N + 12*L*H*Q*T) x tokens/s "
        f"/ peak, peak {_fmt(peak and peak / 1e12, ',.4g')} TFLOP/s"
        f"{' (measured fp32 matmul rate of this CPU)' if cpu else ' (dense bf16)'}; tokens/s is "
        f"the median of the measured steps after the warmup steps; peak memory is torch's peak "
        f"allocated."
    )
    if not cpu and peaks and peaks != [peak]:
        header += f" Warning: the runs divided by peaks {peaks}, not {peak}."
    print("\n" + header + "\n\n" + text + "\n\n" + words, flush=True)
    (logdir / "table.md").write_text(header + "\n\n" + text + "\n\n" + words + "\n")
    if args.report:
        cmd = "bash bench/gpu.sh " + ("--cpu-smoke " if cpu else "") + "LOGDIR"
        Path(args.report).write_text(
            f"### GPU: 1b and 125m on one {device} (`bench/gpu.sh`)\n\n```\n{cmd}\n```\n\n"
            f"{header}\n\n{text}\n\n{words}\n"
        )
    print(
        json.dumps(
            {
                "bench": "gpu",
                "cpu_smoke": cpu,
                "device": device,
                "logdir": str(logdir),
                "rows": [
                    {
                        k: r.get(k)
                        for k in (
                            "name",
                            "status",
                            "tokens_per_s",
                            "tflops",
                            "mfu",
                            "peak_mem_gib",
                            "reason",
                        )
                    }
                    for r in results
                ],
            }
        )
    )
    measured = any(r["status"] == "ok" for r in results)
    required_failed = any(
        r["status"] not in ("ok", "skipped") and not r["optional"] for r in results
    )
    return 0 if measured and not required_failed and not interrupted else 1


if __name__ == "__main__":
    sys.exit(main())
