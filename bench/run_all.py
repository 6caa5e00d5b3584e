"""`make bench`: run every bench/bench_*.py and append their figures to docs/benchmarks.md.

    .venv/bin/python bench/run_all.py                 all, figures appended under a dated header
    .venv/bin/python bench/run_all.py --only train    some (names without bench_ and .py)
    .venv/bin/python bench/run_all.py --smoke         CI: each script's few-step smoke mode;
                                                      nothing is written
    .venv/bin/python bench/run_all.py --smoke --jobs 2   two scripts at a time (smoke only:
                                                      measured side by side, figures mean nothing)
    .venv/bin/python bench/run_all.py --data DIR      the corpus the training benchmarks read
                                                      (default data/stdlib; prepared if missing)

Each script takes ``--smoke`` and ``--report PATH`` (a markdown fragment of its results) and
prints one JSON line. A script that fails is named at the end and makes the exit status 1; the
fragments of the others are still appended.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOC = ROOT / "docs" / "benchmarks.md"
DEFAULT_DATA = ROOT / "data" / "stdlib"
# The scripts that read the prepared corpus and take --data (bench_gpu prepares its own, with the
# interpreter it benchmarks).
TAKES_DATA = {
    "bench_async_save.py",
    "bench_checkpoint.py",
    "bench_demo.py",
    "bench_docmask.py",
    "bench_eval.py",
    "bench_moe.py",
    "bench_moe_balance.py",
    "bench_moe_dense.py",
    "bench_muon.py",
    "bench_train.py",
}


def ensure_data(data: str | Path) -> Path:
    """The stdlib corpus at ``data`` (vocab 8192, as `make demo` prepares it): prepared here if
    ``data/meta.json`` is missing, as in a fresh clone that has not run `make demo`. Returned
    absolute, so that the check, the preparation (run from the repository root) and the scripts'
    children all mean the same directory."""
    data = Path(data).resolve()
    if not (data / "meta.json").is_file():
        print(f"== preparing {data} (anneal data prepare --input stdlib)", flush=True)
        cmd = [sys.executable, "-m", "anneal.cli", "data", "prepare", "--input", "stdlib"]
        subprocess.run([*cmd, "--out", str(data)], cwd=ROOT, check=True)
    return data


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    packages = ", ".join(
        f"{n} {v(n)}" for n in ("torch", "deepspeed", "transformers", "sentencepiece", "datasets")
    )
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    return (
        f"{os.cpu_count()} vCPUs ({cpu}), {mem:.0f} GiB RAM, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}; {packages}; load average "
        f"before the run {load}"
    )


def run_one(
    script: Path, tmp: Path, smoke: bool, data: Path | None, *, alone: bool
) -> tuple[int, str, Path]:
    """Runs one benchmark script: (its exit status, what to print, its fragment's path). Alone,
    its output streams through as it comes; beside others it is collected and returned, so that
    the log keeps each script's lines together."""
    frag = tmp / f"{script.stem}.md"
    extra = ["--smoke"] if smoke else ["--report", str(frag)]
    if script.name in TAKES_DATA:
        extra += ["--data", str(data)]
    head = f"== {script.name} {' '.join(extra)}\n"
    start = time.time()
    cmd = [sys.executable, str(script), *extra]
    if alone:
        print(head, end="", flush=True)
        rc, cpu = _wait_with_cpu(subprocess.Popen(cmd, cwd=ROOT))
        print(f"== {script.name}: exit {rc} in {time.time() - start:.0f} s, {cpu}", flush=True)
        return rc, "", frag
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = head + proc.stdout.read()
    rc, cpu = _wait_with_cpu(proc)
    return rc, output + f"== {script.name}: exit {rc} in {time.time() - start:.0f} s, {cpu}\n", frag


def _wait_with_cpu(proc: subprocess.Popen) -> tuple[int, str]:
    """``proc``'s exit status once it ends, and the CPU seconds it and the processes it waited
    for used (``wait4``'s own figure for this one script, whichever others run beside it)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, f"{usage.ru_utime + usage.ru_stime:.1f} s of CPU"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a few steps each; nothing written")
    p.add_argument("--only", help="comma-separated names, e.g. train,prepare")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="stdlib corpus (prepared if missing)")
    p.add_argument("--jobs", type=int, default=1, help="scripts at a time (with --smoke only)")
    args = p.parse_args()
    if args.jobs < 1 or (args.jobs > 1 and not args.smoke):
        print(
            f"run_all: --jobs {args.jobs}: scripts run side by side only in --smoke mode (a "
            "benchmark measured beside another measures the other too); use --jobs 1, or add "
            "--smoke"
        )
        return 2
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        wanted = {f"bench_{n.strip()}.py" for n in args.only.split(",")}
        unknown = wanted - {s.name for s in scripts}
        if unknown:
            names = ", ".join(s.stem.removeprefix("bench_") for s in scripts)
            print(f"run_all: no such benchmark {sorted(unknown)}; choose from {names}")
            return 2
        scripts = [s for s in scripts if s.name in wanted]
    header = machine_line()
    data = ensure_data(args.data) if TAKES_DATA & {s.name for s in scripts} else None
    frags, failed = [], []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        runs = [
            pool.submit(run_one, script, Path(tmp), args.smoke, data, alone=args.jobs == 1)
            for script in scripts
        ]
        for script, run in zip(scripts, runs, strict=True):
            rc, output, frag = run.result()  # in order: each script's output in one piece
            print(output, end="", flush=True)
            if rc != 0:
                failed.append(script.name)
            elif frag.is_file():
                frags.append(frag.read_text().strip())
    if frags and not args.smoke:
        when = time.strftime("%Y-%m-%d %H:%M %Z")
        command = "make bench" + (f" (bench/run_all.py --only {args.only})" if args.only else "")
        with open(DOC, "a") as f:
            f.write(f"\n## `{command}`, {when}\n\nMachine: {header}.\n\n")
            f.write("\n\n".join(frags) + "\n")
        print(f"appended {len(frags)} result(s) to {DOC.relative_to(ROOT)}")
    if failed:
        print(f"run_all: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
