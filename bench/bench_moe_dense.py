"""Sparse against dense at equal active compute: the tiny-moe preset (8 experts, 2 per token,
each half the dense width) against the tiny dense preset, same tokens, same schedule, same
data order, validation bits per byte along the way.

Both are the demo's run (scripts/demo.py: 2,048 tokens per step, peak LR 7e-4, WSD with its
20% cooldown, on the embedded stdlib corpus, validated on the whole val split) on 2 CPU ranks,
one model after the other, for each ``--seeds`` (the init; the data order is the same). The
active parameters per token are equal but for the router (256 x 8 per layer: 8,192 of 7.4M);
the sparse model holds 13.7M in all. The result (each validation point of each run, and the
final gap against the spread over seeds) is printed, as one JSON line too, and with
``--report`` written as a markdown fragment (``bench/run_all.py`` appends it to
docs/benchmarks.md).

    .venv/bin/python bench/bench_moe_dense.py [--steps 320] [--seeds 0,1] [--report F]
    .venv/bin/python bench/bench_moe_dense.py --smoke        (CI: a few steps, no figures kept)

--smoke: both models, 4 steps, one seed, one validation on 16 windows, each run's 2 ranks
forked by tests/scripts/ranks.py instead of the deepspeed runner (``train_run.launcher``: the
same recipe and ranks, not the runner's extra interpreters; 58 s of CPU before, alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from demo import BATCH_TOKENS, MICRO_BATCH, PEAK_LR, SCHEDULE, VAL_WINDOWS  # noqa: E402
from run_all import DEFAULT_DATA, ensure_data, machine_line  # noqa: E402
from train_run import launcher  # noqa: E402

from anneal.observe.metrics import read_metrics  # noqa: E402

RECIPES = {"dense": "recipes/pretrain_tiny.py", "sparse": "recipes/pretrain_moe_tiny.py"}


def command(
    kind: str,
    *,
    out: Path,
    data: Path,
    steps: int,
    seed: int,
    every: int,
    windows: int,
    forked: bool = False,
) -> list[str]:
    """The demo's command for ``kind`` (its recipe) on 2 ranks, validated every ``every``
    steps on ``windows`` sequences of the val split; ``forked``: see ``train_run.launcher``."""
    return [
        *launcher("recipe", 2, forked),
        RECIPES[kind],
        *("--out", str(out), "--data", str(data), "--max-steps", str(steps)),
        *("--ds-config", "cpu_zero2.json", "--val-every", str(every), "--save-every", "0"),
        *("--seed", str(seed)),
        *("--set", f"ds.train_micro_batch_size_per_gpu={MICRO_BATCH}"),
        *("--set", f"train.val_samples={windows}"),
        *("--set", f"optim.schedule={SCHEDULE}"),
        *("--set", f"optim.global_batch_tokens={BATCH_TOKENS}"),
        *("--set", f"optim.lr={PEAK_LR}"),
    ]


def run(kind: str, *, work: Path, seed: int, **how) -> dict:
    """One run of ``kind`` with ``seed`` in ``work``; ``how``: ``command``'s other keywords."""
    out = work / f"{kind}-seed{seed}"
    t0 = time.perf_counter()
    subprocess.run(
        command(kind, out=out, seed=seed, **how),
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    val = {r["step"]: r["val_bpb"] for r in read_metrics(out, "val")}
    train = read_metrics(out, "train")
    return {
        "kind": kind,
        "seed": seed,
        "wall_s": round(time.perf_counter() - t0, 1),
        "val_bpb": val,
        "final_val_bpb": val[max(val)],
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in train),
        "final_aux_loss": train[-1].get("aux_loss"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=320)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--every", type=int, default=40, help="validate every N steps")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--report", help="write the runs and the gap here, as markdown")
    p.add_argument(
        "--smoke", action="store_true", help="4 steps, one seed, one short validation, nothing kept"
    )
    args = p.parse_args()
    steps, seeds, every = args.steps, [int(s) for s in args.seeds.split(",")], args.every
    windows = VAL_WINDOWS
    if args.smoke:
        steps, seeds, every, windows = 4, [0], 4, 16
    data = ensure_data(args.data)
    with tempfile.TemporaryDirectory(prefix="bench-moe-dense-") as tmp:
        runs = [
            run(
                kind,
                work=Path(tmp),
                data=data,
                steps=steps,
                seed=seed,
                every=every,
                windows=windows,
                forked=args.smoke,
            )
            for seed in seeds
            for kind in RECIPES
        ]
    for r in runs:
        curve = ", ".join(f"{s}: {b:.4f}" for s, b in sorted(r["val_bpb"].items()))
        print(f"{r['kind']:6} seed {r['seed']}: {r['wall_s']} s, val bpb {curve}")
    final = {k: [r["final_val_bpb"] for r in runs if r["kind"] == k] for k in RECIPES}
    gaps = [d - s for d, s in zip(final["dense"], final["sparse"], strict=True)]
    spread = {k: max(v) - min(v) for k, v in final.items()}
    print(
        f"final val bpb: dense {final['dense']}, sparse {final['sparse']}; dense - sparse per "
        f"seed {[round(g, 4) for g in gaps]}; spread over seeds: dense {spread['dense']:.4f}, "
        f"sparse {spread['sparse']:.4f}"
    )
    print(json.dumps({"bench": "moe_dense", "steps": steps, "runs": runs, "gaps": gaps}))
    if args.report and not args.smoke:
        Path(args.report).write_text(fragment(runs, steps=steps, gaps=gaps))


def fragment(runs: list[dict], *, steps: int, gaps: list[float]) -> str:
    """The markdown of ``--report``: one row per run, its validation curve and final bpb."""
    points = sorted(runs[0]["val_bpb"])
    head = "| model | seed | " + " | ".join(f"bpb @ {s}" for s in points) + " | tokens/s |"
    rows = [head, "|" + "---|" * (len(points) + 3)]
    for r in runs:
        bpb = " | ".join(f"{r['val_bpb'][s]:.4f}" for s in points)
        rows.append(f"| {r['kind']} | {r['seed']} | {bpb} | {r['median_tokens_per_s']:,.0f} |")
    return (
        f"### Sparse against dense at equal active compute ({steps} steps)\n\n"
        f"`.venv/bin/python bench/bench_moe_dense.py --steps {steps}` on {machine_line()}: "
        f"dense - sparse final validation bits per byte per seed: "
        f"{', '.join(f'{g:.4f}' for g in gaps)}.\n\n" + "\n".join(rows) + "\n"
    )


if __name__ == "__main__":
    main()
