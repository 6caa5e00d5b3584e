"""One run of the training benchmark: its command line (the recipe, or a reference loop of
``bench/reference.py``), its process with the peak RSS of its tree, and its tokens/s from the
wall clock of its step rows. ``bench_train.py`` plans the runs and compares them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from anneal.dist import free_port  # noqa: E402
from anneal.hardware import process_memory_bytes  # noqa: E402

RECIPE = "recipes/pretrain_tiny.py"
RANKS_SCRIPT = ROOT / "tests" / "scripts" / "ranks.py"
"""Starts several ranks forked from one import (``forked``: the smoke runs), where torchrun and
the deepspeed runner start an interpreter a rank and one or two of their own."""
MICRO, ACCUM = 4, 2  # cpu.json's micro-batch; accumulation 2 so the no-sync path is measured


class PeakRss:
    """Peak of the RSS summed over a process and its descendants, sampled every 0.2 s."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = process_memory_bytes(self.pid, tree=True)
            self.peak = max(self.peak, total)
            self._stop.wait(0.2)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def launcher(kind: str, ranks: int, forked: bool = False) -> list[str]:
    """What starts a run of ``kind`` on ``ranks``: the interpreter for one rank; torchrun for the
    plain loop and the deepspeed runner for the others (the bare engine without
    ``--local_rank``, which the reference does not take); ``RANKS_SCRIPT`` for any when ``forked``
    (the same rank variables, no ``--local_rank``), as ``--smoke`` runs them for CI's time: a
    smoke run checks the benchmark's code (the same loops, engines and collectives), not the
    launchers (the deepspeed runner's launches are tested in tests/launcher/ and by
    ``tests.conftest.run_recipe``'s ``runner``)."""
    py = sys.executable
    if ranks == 1:
        return [py]
    if forked:
        return [py, str(RANKS_SCRIPT), str(ranks)]
    if kind == "plain":
        torchrun = [py, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
        return [*torchrun, "--master_port", str(free_port())]
    runner = [str(Path(py).parent / "deepspeed"), "--num_gpus", str(ranks)]
    runner += ["--master_port", str(free_port())]
    return [*runner, "--no_local_rank"] if kind == "bare" else runner


def command(
    kind: str,
    ranks: int,
    stage: int | None,
    *,
    data,
    steps,
    out: Path,
    sets,
    flags=(),
    recipe: str = RECIPE,
    ds_config: str = "cpu.json",
    forked: bool = False,
) -> list:
    """The run's command line. ``kind``: "plain" (the PyTorch reference), "bare" (the bare
    DeepSpeed engine, with the reference's ``flags``) or "recipe"; ``recipe`` (the reference
    loops read its defaults) with the fp32 ``ds_config``; started by ``launcher``."""
    common = ["--data", data, "--max-steps", str(steps), "--ds-config", ds_config]
    common += [f"--set={s}" for s in sets]
    common += [] if stage is None else [f"--set=ds.zero_optimization.stage={stage}"]
    rows = ["--rows", str(out / "steps.jsonl")]
    launch = launcher(kind, ranks, forked)
    if kind == "plain":
        return launch + ["bench/reference.py", recipe, *common, *rows]
    if kind == "bare":
        engine = ["--engine", "deepspeed", *flags]
        return launch + ["bench/reference.py", recipe, *common, *rows, *engine]
    return launch + [recipe, *common, "--out", str(out / "run"), "--resume", "none"]


def step_rows(kind: str, out: Path) -> list[dict]:
    if kind != "recipe":
        return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    from anneal.observe.metrics import read_metrics

    return read_metrics(out / "run", "train")


def run_one(
    spec,
    *,
    data,
    steps,
    skip,
    sets,
    tokens_per_step,
    scratch: Path,
    flags=(),
    model=None,
    forked: bool = False,
) -> dict:
    """Run ``spec`` (name, kind, ranks, ZeRO stage[, extra --set overrides]) of ``model``
    (its recipe and ds_config: ``bench_train.MODELS``; None: the tiny recipe on cpu.json);
    ``forked``: see ``command``."""
    name, kind, ranks, stage, *extra = spec
    out = Path(tempfile.mkdtemp(dir=scratch))
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    sets = [*sets, *(extra[0] if extra else ())]
    where = {} if model is None else {"recipe": model.recipe, "ds_config": model.ds_config}
    cmd = command(
        kind,
        ranks,
        stage,
        data=data,
        steps=steps,
        out=out,
        sets=sets,
        flags=flags,
        forked=forked,
        **where,
    )
    log = out / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        rss = PeakRss(proc.pid)
        rc = proc.wait()
        peak = rss.stop()
    if rc != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"bench_train: {name} ({ranks} rank(s)) failed (exit {rc}):\n{tail}")
    rows = step_rows(kind, out)
    if len(rows) != steps:
        raise SystemExit(f"bench_train: {name}: {len(rows)} step rows, expected {steps} ({log})")
    span = rows[-1]["time"] - rows[skip - 1]["time"]
    result = {
        "tokens_per_s": tokens_per_step * (steps - skip) / span,
        "peak_rss_mib": peak / 2**20,
        "loss": [r["loss"] for r in rows],
    }
    shutil.rmtree(out, ignore_errors=True)
    return result
