"""Muon beside AdamW (issue 42): a short LR sweep of each on one small shape, and their step
times side by side at two larger ones.

Each run is the tiny recipe on one CPU process (fp32, ZeRO-2, ``cpu_zero2.json``) at a smaller
shape (hidden 128, 4 layers, 4 heads, MLP 352, context 128: 0.80M parameters in matrices that
Muon takes, 2.1M in the embedding and head that stay on AdamW), 8 sequences a step, warmup
10% of the run and cosine to 0.1, on the embedded stdlib corpus; validated at the end on 64
windows. For each seed: AdamW at each of ``--lrs``, Muon with the RMS-matched update
(``optim.muon_scale=rms``, Anneal's default) at the same LRs, and Muon with DeepSpeed's own
scale at ``--ds-lrs``. Printed: the final validation loss of every run, the best of each
optimizer, the steps Muon's best took to reach AdamW's best final validation loss (from its
validation points), the median step time of each, and DeepSpeed's logged ``grad_norm`` under
Muon (the norm after Newton-Schulz, which the resolution keeps from clipping). One JSON line
too; ``--report`` writes a markdown fragment (``bench/run_all.py`` appends it to
docs/benchmarks.md).

    .venv/bin/python bench/bench_muon.py [--steps 150] [--seeds 0] [--lrs 1e-3,3e-3,1e-2]
                                         [--ds-lrs 3e-3,2e-2] [--report F]
    .venv/bin/python bench/bench_muon.py --smoke         (CI: 3 steps of each optimizer)
    .venv/bin/python bench/bench_muon.py --larger ...    (the sweep at hidden 256, 6 layers)
    .venv/bin/python bench/bench_muon.py --speed [--shape tiny|h512] [--rounds R] [--warmup W]
                                         [--measure M]

``--speed`` times the two optimizers' steps side by side, one CPU process a run, fp32, ZeRO-2,
launches alternating AdamW, Muon, AdamW, Muon, ... (``--rounds``); of each run the steps after
``--warmup`` are timed (``tokens / tokens_per_s`` of each step's metrics row). ``--shape``:

- ``tiny`` (the default): the tiny preset as shipped (hidden 256, 4 layers, MLP 688, context
  256: 7.4M parameters) at its recipe's 16,384 tokens a step (micro-batch 16, accumulation 4);
  2 rounds of 2 + 4 steps by default;
- ``h512``: a shape a user could train, larger than any the sweep takes: hidden 512, 8 layers,
  8 heads, MLP 1376, context 512 (33.7M parameters, 25.3M of them on Muon) at 32,768 tokens a
  step (micro-batch 8, accumulation 8). A step of either optimizer took 61-97 s on this 2-core
  CPU beside other work, so its defaults are 2 rounds of 1 + 1 steps: the whole measurement
  took 9 min 40 s at load 2.3-2.9 (docs/benchmarks.md).

Printed: each run's steps and the load average after it, each run's median step, Muon's over
AdamW's per round and over all, and the ratio that ``anneal.model.muon.newton_schulz_flops``
predicts (1 + Newton-Schulz's FLOPs over the model's FLOPs a step: 1.037 at ``tiny``, 1.050 at
``h512``). ``--smoke`` does not run ``--speed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_all import DEFAULT_DATA, ensure_data, machine_line  # noqa: E402

from anneal.model import flops_per_token, get_preset  # noqa: E402
from anneal.model.muon import newton_schulz_flops  # noqa: E402
from anneal.observe.metrics import read_metrics  # noqa: E402

SHAPE = (
    "model.hidden_size=128",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=4",
    "model.intermediate_size=352",
    "model.seq_len=128",
    "ds.train_micro_batch_size_per_gpu=8",
    "optim.global_batch_tokens=1024",
)


# --larger: the tiny preset's width (hidden 256, MLP 688) at 6 layers, the sweep's context and
# tokens a step: 4.7M parameters on Muon, 4.2M in the embedding and head
LARGER = (
    "model.hidden_size=256",
    "model.num_hidden_layers=6",
    "model.num_attention_heads=4",
    "model.intermediate_size=688",
    "model.seq_len=128",
    "ds.train_micro_batch_size_per_gpu=8",
    "optim.global_batch_tokens=1024",
)


@dataclasses.dataclass(frozen=True)
class SpeedShape:
    """A shape ``--speed`` times: the tiny preset's fields it changes (``model.*``), the
    micro-batch and tokens a step, and the ``--rounds``/``--warmup``/``--measure`` that keep the
    whole measurement within about 15 minutes on a quiet machine."""

    model: dict
    micro_batch: int
    tokens: int
    rounds: int
    warmup: int
    measure: int

    def sets(self) -> list[str]:
        return [
            *(f"model.{key}={value}" for key, value in self.model.items()),
            f"ds.train_micro_batch_size_per_gpu={self.micro_batch}",
            f"optim.global_batch_tokens={self.tokens}",
            "train.log_every=1",
            "train.val_samples=8",  # the run's one validation, at its end, untimed
        ]

    def preset(self):
        tiny = get_preset("tiny")
        heads = self.model.get("num_attention_heads", tiny.num_attention_heads)
        return dataclasses.replace(tiny, num_key_value_heads=heads, **self.model)


SPEED_SHAPES = {
    # the tiny preset as its recipe ships it: 7.4M parameters, 16,384 tokens a step
    "tiny": SpeedShape({}, micro_batch=16, tokens=64 * 256, rounds=2, warmup=2, measure=4),
    # twice the width, twice the depth, twice the context: 33.7M parameters (25.3M in the 56
    # matrices on Muon), 32,768 tokens a step (micro-batch 8, accumulation 8); a step of either
    # optimizer took 61-97 s here (docs/benchmarks.md), so a launch of 2 steps is 2-4 minutes
    "h512": SpeedShape(
        {
            "hidden_size": 512,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "intermediate_size": 1376,
            "seq_len": 512,
        },
        micro_batch=8,
        tokens=64 * 512,
        rounds=2,
        warmup=1,
        measure=1,
    ),
}


def command(*, out: Path, data: Path, steps: int, seed: int, every: int, sets: list[str], shape):
    items = [*shape, "train.val_samples=64", "optim.warmup_max_share=0.1", *sets]
    items.append(f"optim.warmup_tokens={int(0.1 * steps) * 1024}")
    return [
        sys.executable,
        "recipes/pretrain_tiny.py",
        *("--out", str(out), "--data", str(data), "--max-steps", str(steps)),
        *("--ds-config", "cpu_zero2.json", "--val-every", str(every), "--save-every", "0"),
        *("--seed", str(seed)),
        *[x for item in items for x in ("--set", item)],
    ]


def run(
    label: str, sets: list[str], *, work: Path, data: Path, steps: int, seed: int, shape=SHAPE
) -> dict:
    out = work / f"{label}-seed{seed}"
    every = max(1, steps // 6)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run(
        command(out=out, data=data, steps=steps, seed=seed, every=every, sets=sets, shape=shape),
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    val = {r["step"]: r["val_loss"] for r in read_metrics(out, "val")}
    train = read_metrics(out, "train")
    tokens = {r["step"]: r["tokens"] for r in train}
    return {
        "label": label,
        "seed": seed,
        "wall_s": round(time.perf_counter() - t0, 1),
        "val_loss": val,
        "tokens": {s: tokens[s] for s in val},
        "final_val_loss": val[max(val)],
        "median_step_s": statistics.median(step_times(out, min(1, steps - 1))),
        "grad_norm_first_last": [train[0]["grad_norm"], train[-1]["grad_norm"]],
    }


def step_times(out: str | Path, warmup: int) -> list[float]:
    """Seconds of each step after the first ``warmup``, from the run's train rows."""
    rows = read_metrics(Path(out), "train")
    per_step = rows[0]["tokens"] / rows[0]["step"]  # a fresh run: tokens counted from 0
    return [per_step / r["tokens_per_s"] for r in rows if r["step"] > warmup]


def sweep(lrs: list[float], ds_lrs: list[float]) -> list[tuple[str, list[str]]]:
    """(label, --set items) of every run of one seed."""
    runs = [(f"adamw@{lr:g}", [f"optim.lr={lr}"]) for lr in lrs]
    runs += [(f"muon-rms@{lr:g}", ["optim.optimizer=muon", f"optim.lr={lr}"]) for lr in lrs]
    runs += [
        (
            f"muon-ds@{lr:g}",
            ["optim.optimizer=muon", "optim.muon_scale=deepspeed", f"optim.muon_lr={lr}"]
            + [f"optim.lr={lrs[len(lrs) // 2]}"],
        )
        for lr in ds_lrs
    ]
    return runs


def steps_to_reach(run: dict, target: float) -> int | None:
    """The first validation step at which ``run`` is at or below ``target``; None if never."""
    hits = [s for s, loss in sorted(run["val_loss"].items()) if loss <= target]
    return hits[0] if hits else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", default="0")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    p.add_argument("--ds-lrs", default="3e-3,2e-2")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--report", help="write the sweep as markdown here")
    p.add_argument("--smoke", action="store_true", help="3 steps of each optimizer, nothing kept")
    p.add_argument("--larger", action="store_true", help="the sweep at hidden 256, 6 layers")
    p.add_argument("--speed", action="store_true", help="AdamW's and Muon's step side by side")
    p.add_argument("--shape", choices=SPEED_SHAPES, default="tiny", help="--speed: the model")
    p.add_argument("--rounds", type=int, help="--speed: AdamW-then-Muon launches")
    p.add_argument("--warmup", type=int, help="--speed: untimed steps a run")
    p.add_argument("--measure", type=int, help="--speed: timed steps a run")
    args = p.parse_args()
    if args.speed:
        shape = SPEED_SHAPES[args.shape]
        return speed(
            shape=args.shape,
            rounds=shape.rounds if args.rounds is None else args.rounds,
            warmup=shape.warmup if args.warmup is None else args.warmup,
            measure=shape.measure if args.measure is None else args.measure,
            data=args.data,
        )
    steps, seeds = args.steps, [int(s) for s in args.seeds.split(",")]
    lrs, ds_lrs = (
        [float(x) for x in args.lrs.split(",")],
        [float(x) for x in args.ds_lrs.split(",") if x],
    )
    if args.smoke:
        steps, seeds, lrs, ds_lrs = 3, [0], [3e-3], []
    data, shape = ensure_data(args.data), LARGER if args.larger else SHAPE
    with tempfile.TemporaryDirectory(prefix="bench-muon-") as tmp:
        runs = [
            run(label, sets, work=Path(tmp), data=data, steps=steps, seed=seed, shape=shape)
            for seed in seeds
            for label, sets in sweep(lrs, ds_lrs)
        ]
    for r in runs:
        curve = ", ".join(f"{s}: {v:.4f}" for s, v in sorted(r["val_loss"].items()))
        print(
            f"{r['label']:16} seed {r['seed']}: {r['wall_s']} s, step {r['median_step_s']:.3f} s,"
            f" grad_norm {r['grad_norm_first_last']}, val loss {curve}"
        )
    summary = summarize(runs, seeds)
    if args.smoke:  # the speed mode's reading, on the smoke's two runs
        summary["speed"] = side_by_side([[r["median_step_s"]] for r in runs], predicted=None)
    print(json.dumps({"bench": "muon", "steps": steps, "summary": summary, "runs": runs}))
    if args.report and not args.smoke:
        Path(args.report).write_text(fragment(runs, summary, steps=steps))


def summarize(runs: list[dict], seeds: list[int]) -> dict:
    """Per seed: each optimizer's best LR and final loss, and the steps Muon's best took to
    reach AdamW's best final loss."""
    out = {}
    for seed in seeds:
        mine = [r for r in runs if r["seed"] == seed]
        best = {}
        for kind in ("adamw", "muon-rms", "muon-ds"):
            of_kind = [r for r in mine if r["label"].startswith(kind + "@")]
            if of_kind:
                best[kind] = min(of_kind, key=lambda r: r["final_val_loss"])
        target = best["adamw"]["final_val_loss"]
        out[seed] = {
            kind: {
                "label": r["label"],
                "final_val_loss": r["final_val_loss"],
                "steps_to_adamw_final": steps_to_reach(r, target),
                "median_step_s": r["median_step_s"],
            }
            for kind, r in best.items()
        }
    return out


def fragment(runs: list[dict], summary: dict, *, steps: int) -> str:
    rows = [
        "| run | seed | final val loss | step s | grad_norm first, last |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        first, last = r["grad_norm_first_last"]
        rows.append(
            f"| {r['label']} | {r['seed']} | {r['final_val_loss']:.4f} | "
            f"{r['median_step_s']:.3f} | {first:.3g}, {last:.3g} |"
        )
    return (
        f"### Muon beside AdamW: LR sweep ({steps} steps)\n\n"
        f"`.venv/bin/python bench/bench_muon.py --steps {steps}` on {machine_line()}.\n"
        f"Best per optimizer and seed: `{json.dumps(summary)}`\n\n" + "\n".join(rows) + "\n"
    )


def predicted_ratio(shape: SpeedShape) -> dict:
    """Muon's step over AdamW's if Newton-Schulz ran at the model's FLOP rate, at ``shape``."""
    preset = shape.preset()
    model = flops_per_token(preset, seq_len=preset.seq_len) * shape.tokens
    ns = newton_schulz_flops(preset)
    return {"ns_gflop": ns / 1e9, "model_gflop": model / 1e9, "ratio": 1 + ns / model}


def side_by_side(times: list[list[float]], *, predicted: dict | None) -> dict:
    """``times``: AdamW's run, Muon's, AdamW's, ... Per round and over all: each median step
    and Muon's over AdamW's."""
    rounds = [
        {
            "adamw_s": statistics.median(times[i]),
            "muon_s": statistics.median(times[i + 1]),
            "ratio": statistics.median(times[i + 1]) / statistics.median(times[i]),
        }
        for i in range(0, len(times) - 1, 2)
    ]
    adamw = statistics.median(t for ts in times[0::2] for t in ts)
    muon = statistics.median(t for ts in times[1::2] for t in ts)
    return {
        "rounds": rounds,
        "adamw_s": adamw,
        "muon_s": muon,
        "ratio": muon / adamw,
        "predicted": predicted,
    }


def speed(*, shape: str, rounds: int, warmup: int, measure: int, data: str) -> None:
    """AdamW and Muon launched in turn, ``rounds`` times, at ``SPEED_SHAPES[shape]``."""
    data, steps, times = ensure_data(data), warmup + measure, []
    sets = SPEED_SHAPES[shape].sets()
    sets = {"adamw": sets, "muon": [*sets, "optim.optimizer=muon"]}
    with tempfile.TemporaryDirectory(prefix="bench-muon-speed-") as tmp:
        for i in range(rounds):
            for kind in ("adamw", "muon"):
                out = Path(tmp) / f"{kind}-{i}"
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
                cmd = [
                    sys.executable,
                    "recipes/pretrain_tiny.py",
                    *("--out", str(out), "--data", str(data), "--max-steps", str(steps)),
                    *("--ds-config", "cpu_zero2.json", "--val-every", "0", "--save-every", "0"),
                    *[x for item in sets[kind] for x in ("--set", item)],
                ]
                subprocess.run(cmd, cwd=ROOT, check=True, env=env, stdout=subprocess.DEVNULL)
                times.append(step_times(out, warmup))
                print(
                    f"{kind} round {i}: steps {[round(t, 3) for t in times[-1]]} s "
                    f"(load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    result = side_by_side(times, predicted=predicted_ratio(SPEED_SHAPES[shape]))
    print(
        f"{shape}: Muon's step over AdamW's: {result['ratio']:.3f} (predicted from FLOPs: "
        f"{result['predicted']['ratio']:.3f}); {machine_line()}"
    )
    print(
        json.dumps(
            {"bench": "muon-speed", "shape": shape, "warmup": warmup, "measure": measure, **result}
        )
    )


if __name__ == "__main__":
    main()
