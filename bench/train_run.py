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
) -> list:
    """The run's command line. ``kind``: "plain" (the PyTorch reference, torchrun on several
    ranks), "bare" (the bare DeepSpeed engine, with the reference's ``flags``) or "recipe";
    ``recipe`` (the reference loops read its defaults) with the fp32 ``ds_config``."""
    py = sys.executable
    common = ["--data", data, "--max-steps", str(steps), "--ds-config", ds_config]
    common += [f"--set={s}" for s in sets]
    common += [] if stage is None else [f"--set=ds.zero_optimization.stage={stage}"]
    rows = ["--rows", str(out / "steps.jsonl")]
    if kind == "plain":
        torchrun = [py, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
        launch = [py] if ranks == 1 else [*torchrun, "--master_port", str(free_port())]
        return launch + ["bench/reference.py", recipe, *common, *rows]
    launch = [str(Path(py).parent / "deepspeed"), "--num_gpus", str(ranks)]
    launch = [py] if ranks == 1 else [*launch, "--master_port", str(free_port())]
    if kind == "bare":  # the reference takes no --local_rank
        launch = launch if ranks == 1 else [*launch, "--no_local_rank"]
        engine = ["--engine", "deepspeed", *flags]
        return launch + ["bench/reference.py", recipe, *common, *rows, *engine]
    return launch + [recipe, *common, "--out", str(out / "run"), "--resume", "none"]


def step_rows(kind: str, out: Path) -> list[dict]:
    if kind != "recipe":
        return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    from anneal.observe.metrics import read_metrics

    return read_metrics(out / "run", "train")


def run_one(
    spec, *, data, steps, skip, sets, tokens_per_step, scratch: Path, flags=(), model=None
) -> dict:
    """Run ``spec`` (name, kind, ranks, ZeRO stage[, extra --set overrides]) of ``model``
    (its recipe and ds_config: ``bench_train.MODELS``; None: the tiny recipe on cpu.json)."""
    name, kind, ranks, stage, *extra = spec
    out = Path(tempfile.mkdtemp(dir=scratch))
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    sets = [*sets, *(extra[0] if extra else ())]
    where = {} if model is None else {"recipe": model.recipe, "ds_config": model.ds_config}
    cmd = command(
        kind, ranks, stage, data=data, steps=steps, out=out, sets=sets, flags=flags, **where
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
