"""Training throughput: the recipe against a plain PyTorch loop of the same model, side by side.

One process: the plain loop (``bench/reference.py``) against the recipe at ZeRO-0, 1 and 3.
Two ranks: torch DDP with gloo (the same reference under ``torch.distributed.run``) against the
recipe at ZeRO-1, 2 and 3 under ``deepspeed --num_gpus 2``. Everything in fp32 with torch's AdamW
(``ds_configs/cpu.json``, only the stage changed), micro-batch 4 x accumulation 2 x the preset's
sequence per rank, the same init, batches, clip and schedule. Within each group the runs
alternate, in a rotated order, for ``--repeats`` rounds; each run is a fresh process.

A run's tokens/s is wall clock between the end of step ``--skip`` and the end of its last step
(the ``time`` of each metrics row), so it counts everything the loop does between steps. The
ratio is recipe / reference of the medians. MFU divides by this machine's measured fp32 matmul
peak (``anneal.hardware``, all cores); peak RSS is summed over the run's process tree.

    .venv/bin/python bench/bench_train.py [--models tiny,small] [--repeats 3] [--report F]
    .venv/bin/python bench/bench_train.py --smoke        (CI: a few steps, no figures kept)

An A/B of DeepSpeed options is one command: ``--stages`` keeps only the listed recipe stages
beside the reference, and each ``--arm LABEL=STAGE:KEY=VALUE[;KEY=VALUE]`` adds a recipe run at
that stage with those ``--set`` overrides, alternating with the rest. For example ZeRO-2 with
and without ``overlap_comm``, against DDP:

    .venv/bin/python bench/bench_train.py --models tiny --ranks 2 --stages 2 --repeats 6 \
        --arm "overlap=2:ds.zero_optimization.overlap_comm=true"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from run_all import DEFAULT_DATA, ensure_data, machine_line  # noqa: E402

from anneal.dist import free_port  # noqa: E402
from anneal.hardware import process_memory_bytes  # noqa: E402

RECIPE = "recipes/pretrain_tiny.py"
MICRO, ACCUM = 4, 2  # cpu.json's micro-batch; accumulation 2 so the no-sync path is measured
MODELS = {
    "tiny": [],  # 7.4M parameters at vocab 8192, seq 256
    "small": [  # 34M: the tiny preset widened and deepened
        "model.hidden_size=512",
        "model.intermediate_size=1376",
        "model.num_hidden_layers=8",
        "model.num_attention_heads=8",
    ],
}
# (name, kind, ranks, ZeRO stage[, extra --set overrides]): the reference comes first.
GROUPS = {
    1: [
        ("plain loop", "plain", 1, None),
        ("recipe ZeRO-0", "recipe", 1, 0),
        ("recipe ZeRO-1", "recipe", 1, 1),
        ("recipe ZeRO-3", "recipe", 1, 3),
    ],
    2: [
        ("torch DDP (gloo)", "plain", 2, None),
        ("recipe ZeRO-1", "recipe", 2, 1),
        ("recipe ZeRO-2", "recipe", 2, 2),
        ("recipe ZeRO-3", "recipe", 2, 3),
    ],
}


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


def command(kind: str, ranks: int, stage: int | None, *, data, steps, out: Path, sets) -> list:
    py = sys.executable
    common = ["--data", data, "--max-steps", str(steps), "--ds-config", "cpu.json"]
    common += [f"--set={s}" for s in sets]
    if kind == "plain":
        torchrun = [py, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
        launch = [py] if ranks == 1 else [*torchrun, "--master_port", str(free_port())]
        return launch + ["bench/reference.py", RECIPE, *common, "--rows", str(out / "steps.jsonl")]
    launch = (
        [py]
        if ranks == 1
        else [
            str(Path(py).parent / "deepspeed"),
            "--num_gpus",
            str(ranks),
            "--master_port",
            str(free_port()),
        ]
    )
    stage_set = [] if stage is None else [f"--set=ds.zero_optimization.stage={stage}"]
    return launch + [RECIPE, *common, "--out", str(out / "run"), "--resume", "none", *stage_set]


def step_rows(kind: str, out: Path) -> list[dict]:
    if kind == "plain":
        return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    from anneal.observe.metrics import read_metrics

    return read_metrics(out / "run", "train")


def parse_arm(text: str) -> tuple[str, int, list[str]]:
    """``LABEL=STAGE:KEY=VALUE[;KEY=VALUE...]`` -> (label, stage, overrides)."""
    label, eq, rest = text.partition("=")
    stage, colon, sets = rest.partition(":")
    overrides = [x.strip() for x in sets.split(";") if x.strip()]
    if not (
        eq
        and colon
        and label.strip()
        and stage.strip() in ("0", "1", "2", "3")
        and overrides
        and all("=" in x for x in overrides)
    ):
        raise SystemExit(
            f"bench_train: --arm {text!r} is not LABEL=STAGE:KEY=VALUE[;KEY=VALUE...]. The "
            "stage is 0-3 and each KEY=VALUE is a recipe --set override, for example "
            "--arm 'overlap=2:ds.zero_optimization.overlap_comm=true'."
        )
    return label.strip(), int(stage), overrides


def plan_group(ranks: int, stages, arms, smoke: bool = False) -> list[tuple]:
    """The runs of one rank count: the reference, the recipe at ``stages`` (None: the group's
    own), then one run per ``--arm``; under ``--smoke`` only the reference, the group's last
    stage and the arms."""
    ref, *recipe = GROUPS[ranks]
    if smoke:
        recipe = recipe[-1:]
    if stages is not None:
        recipe = [(f"recipe ZeRO-{s}", "recipe", ranks, s) for s in stages]
    extra = [(f"recipe ZeRO-{st} {label}", "recipe", ranks, st, tuple(o)) for label, st, o in arms]
    return [ref, *recipe, *extra]


def run_one(spec, *, data, steps, skip, sets, tokens_per_step, scratch: Path) -> dict:
    name, kind, ranks, stage, *extra = spec
    out = Path(tempfile.mkdtemp(dir=scratch))
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    sets = [*sets, *(extra[0] if extra else ())]
    cmd = command(kind, ranks, stage, data=data, steps=steps, out=out, sets=sets)
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


def cpu_peak_flops() -> float:
    import torch

    from anneal.hardware import device_peak_flops

    torch.set_num_threads(os.cpu_count() or 1)
    return device_peak_flops(torch.device("cpu"))


def flops_per_token(model: str, data: str) -> float:
    from anneal.config.run import ModelConfig, RunConfig
    from anneal.config.run_checks import apply_overrides
    from anneal.model import flops_per_token as fpt

    meta = json.loads((Path(data) / "meta.json").read_text())
    cfg = apply_overrides(
        RunConfig(out="", ds_config="cpu.json", model=ModelConfig(preset="tiny")), MODELS[model]
    )
    return fpt(cfg.model.resolve(meta["vocab_size"]))


def bench(args) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="anneal-bench-train-"))
    peak = cpu_peak_flops()
    results = {}
    try:
        for model in args.models:
            steps, skip = (args.steps if model == "tiny" else args.small_steps), args.skip
            fpt = flops_per_token(model, args.data)
            for ranks in args.ranks:
                group = plan_group(ranks, args.stages, args.arm, args.smoke)
                tokens = MICRO * ACCUM * ranks * 256
                sets = [*MODELS[model], f"optim.global_batch_tokens={tokens}"]
                sets.append("train.eval_samples=0")
                runs = {spec[0]: [] for spec in group}
                for r in range(args.repeats):
                    order = group[r % len(group) :] + group[: r % len(group)]
                    for spec in order:
                        res = run_one(
                            spec,
                            data=args.data,
                            steps=steps,
                            skip=skip,
                            sets=sets,
                            tokens_per_step=tokens,
                            scratch=scratch,
                        )
                        runs[spec[0]].append(res)
                        print(
                            f"  {model} {ranks} rank(s) {spec[0]}: "
                            f"{res['tokens_per_s']:,.0f} tokens/s",
                            flush=True,
                        )
                ref = statistics.median(x["tokens_per_s"] for x in runs[group[0][0]])
                ref_loss = runs[group[0][0]][0]["loss"]
                for name, rs in runs.items():
                    tps = [x["tokens_per_s"] for x in rs]
                    med = statistics.median(tps)
                    results[f"{model}|{ranks}|{name}"] = {
                        "model": model,
                        "ranks": ranks,
                        "run": name,
                        "tokens_per_s": round(med),
                        "min": round(min(tps)),
                        "max": round(max(tps)),
                        "ratio": round(med / ref, 3),
                        "mfu": round(fpt * med / peak, 4),
                        "peak_rss_mib": round(statistics.median(x["peak_rss_mib"] for x in rs)),
                        "step1_loss_diff": abs(rs[0]["loss"][0] - ref_loss[0]),
                    }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"peak_flops": peak, "rows": list(results.values())}


def ab_flags(args) -> str:
    flags = "" if args.stages is None else " --stages " + ",".join(map(str, args.stages))
    for label, stage, sets in args.arm:
        flags += f' --arm "{label}={stage}:{";".join(sets)}"'
    return flags


def report(args, out: dict) -> str:
    load = open("/proc/loadavg").read().split()[:3]
    lines = [
        "### Training throughput: recipe vs a plain PyTorch loop (`bench/bench_train.py`)",
        "",
        f"`.venv/bin/python bench/bench_train.py --models {','.join(args.models)} "
        f"--ranks {','.join(map(str, args.ranks))} "
        f"--repeats {args.repeats} --steps {args.steps} --small-steps {args.small_steps} "
        f"--skip {args.skip}{ab_flags(args)}`; fp32, torch AdamW, micro-batch {MICRO} x "
        f"accumulation {ACCUM} x seq 256 per rank; median of {args.repeats} alternating repeats "
        f"(min-max); MFU against the measured fp32 matmul peak of "
        f"{out['peak_flops'] / 1e9:.0f} GFLOP/s; load average at the end {' '.join(load)}.",
        "",
        "| model | ranks | run | tokens/s (min-max) | vs reference | MFU | peak RSS MiB "
        "| step-1 loss diff |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in out["rows"]:
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['run']} | {r['tokens_per_s']:,} "
            f"({r['min']:,}-{r['max']:,}) | {r['ratio']:.2f}x | {r['mfu']:.0%} | "
            f"{r['peak_rss_mib']:,} | {r['step1_loss_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DEFAULT_DATA), help="stdlib corpus (prepared if missing)")
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=24, help="steps per run, tiny model")
    p.add_argument("--small-steps", type=int, default=10, help="steps per run, small model")
    p.add_argument("--skip", type=int, default=3, help="first steps left out of the rate")
    p.add_argument("--smoke", action="store_true", help="a few steps of tiny, no figures kept")
    p.add_argument("--report", help="write a markdown fragment here")
    p.add_argument("--stages", help="recipe ZeRO stages to run beside the reference, e.g. 2 or 1,3")
    p.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="LABEL=STAGE:KEY=VALUE[;...]",
        help="an extra recipe run with these --set overrides; repeatable",
    )
    args = p.parse_args()
    args.arm = [parse_arm(a) for a in args.arm]
    if args.stages is not None:
        given = [x.strip() for x in args.stages.split(",")]
        if not given or not all(x in ("0", "1", "2", "3") for x in given):
            raise SystemExit(
                f"bench_train: --stages {args.stages!r}: give ZeRO stages 0-3, "
                "comma-separated, for example --stages 2 or --stages 1,3"
            )
        args.stages = [int(x) for x in given]
    if args.smoke:
        args.models, args.ranks, args.repeats, args.steps, args.skip = "tiny", "1,2", 1, 3, 1
    args.models = args.models.split(",")
    args.ranks = [int(r) for r in args.ranks.split(",")]
    args.data = str(ensure_data(args.data))
    out = bench(args)
    if args.smoke:
        bad = [r for r in out["rows"] if r["step1_loss_diff"] > 1e-4]
        if bad:
            raise SystemExit(f"bench_train: step-1 losses differ from the reference: {bad}")
    print(json.dumps({"bench": "train", "machine": machine_line(), **out}))
    if args.report:
        Path(args.report).write_text(report(args, out))


if __name__ == "__main__":
    main()
