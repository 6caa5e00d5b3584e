"""Muon beside AdamW (issue 42): a short LR sweep of each on one small shape, and their step
times side by side.

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
"""

from __future__ import annotations

import argparse
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


def command(*, out: Path, data: Path, steps: int, seed: int, every: int, sets: list[str]):
    items = [*SHAPE, "train.val_samples=64", "optim.warmup_max_share=0.1", *sets]
    items.append(f"optim.warmup_tokens={int(0.1 * steps) * 1024}")
    return [
        sys.executable,
        "recipes/pretrain_tiny.py",
        *("--out", str(out), "--data", str(data), "--max-steps", str(steps)),
        *("--ds-config", "cpu_zero2.json", "--val-every", str(every), "--save-every", "0"),
        *("--seed", str(seed)),
        *[x for item in items for x in ("--set", item)],
    ]


def run(label: str, sets: list[str], *, work: Path, data: Path, steps: int, seed: int) -> dict:
    out = work / f"{label}-seed{seed}"
    every = max(1, steps // 6)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run(
        command(out=out, data=data, steps=steps, seed=seed, every=every, sets=sets),
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
        "median_step_s": statistics.median(1024 / r["tokens_per_s"] for r in train[1:] or train),
        "grad_norm_first_last": [train[0]["grad_norm"], train[-1]["grad_norm"]],
    }


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
    args = p.parse_args()
    steps, seeds = args.steps, [int(s) for s in args.seeds.split(",")]
    lrs, ds_lrs = (
        [float(x) for x in args.lrs.split(",")],
        [float(x) for x in args.ds_lrs.split(",") if x],
    )
    if args.smoke:
        steps, seeds, lrs, ds_lrs = 3, [0], [3e-3], []
    data = ensure_data(args.data)
    with tempfile.TemporaryDirectory(prefix="bench-muon-") as tmp:
        runs = [
            run(label, sets, work=Path(tmp), data=data, steps=steps, seed=seed)
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


if __name__ == "__main__":
    main()
