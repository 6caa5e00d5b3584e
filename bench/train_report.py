"""The training benchmark's rows and report (``bench_train.py``): each run's tokens/s against
the group's reference, or under ``--bare`` against the bare engine of its pair (and a sparse
model's dense twin), and the markdown fragment for docs/benchmarks.md that names the command
that reruns it."""

from __future__ import annotations

import statistics

from train_run import ACCUM, MICRO


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def against_reference(model: str, ranks: int, runs: dict, fpt: float, peak: float) -> list:
    """The rows of the default comparison: each run against the group's first (the reference)."""
    ref_runs = next(iter(runs.values()))
    ref = statistics.median(x["tokens_per_s"] for x in ref_runs)
    rows = []
    for name, rs in runs.items():
        tps = spread([x["tokens_per_s"] for x in rs])
        med = tps["median"]
        rows.append(
            {
                "model": model,
                "ranks": ranks,
                "run": name,
                "tokens_per_s": round(med),
                "min": round(tps["min"]),
                "max": round(tps["max"]),
                "ratio": round(med / ref, 3),
                "mfu": round(fpt * med / peak, 4),
                "peak_rss_mib": round(statistics.median(x["peak_rss_mib"] for x in rs)),
                "step1_loss_diff": abs(rs[0]["loss"][0] - ref_runs[0]["loss"][0]),
            }
        )
    return rows


def against_bare(model: str, ranks: int, runs: dict, pairs: list, fpt: float, peak: float) -> list:
    """The rows of ``--bare``: per stage, both sides' tokens/s, recipe / bare of each round and
    the bare engine's MFU (how much of a step is compute); for a sparse model also its dense
    twin's tokens/s and, per round, the sparse recipe's step time over the dense one's."""
    rows = []
    for bare_spec, recipe_spec, *twin in pairs:
        stage = bare_spec[3]
        bare, recipe = runs[bare_spec[0]], runs[recipe_spec[0]]
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for b, r in zip(bare, recipe, strict=True)]
        dense = {}
        if twin:
            d_runs = runs[twin[0][0]]
            # equal tokens per step: step time sparse / dense = dense tokens/s / sparse tokens/s
            steps = [
                d["tokens_per_s"] / r["tokens_per_s"] for r, d in zip(recipe, d_runs, strict=True)
            ]
            dense = {
                "dense": spread([x["tokens_per_s"] for x in d_runs]),
                "step_over_dense": spread(steps),
            }
        rows.append(
            {
                "model": model,
                "ranks": ranks,
                "stage": stage,
                "bare": spread([x["tokens_per_s"] for x in bare]),
                "recipe": spread([x["tokens_per_s"] for x in recipe]),
                "ratio": spread(ratios),
                "bare_mfu": round(
                    fpt * statistics.median(x["tokens_per_s"] for x in bare) / peak, 4
                ),
                "peak_rss_mib": [
                    round(statistics.median(x["peak_rss_mib"] for x in side))
                    for side in (bare, recipe)
                ],
                "step1_loss_diff": abs(recipe[0]["loss"][0] - bare[0]["loss"][0]),
                **dense,
            }
        )
    return rows


def ab_flags(args) -> str:
    flags = " --bare-zero shipped" if args.bare and args.bare_zero == "shipped" else ""
    flags += f" --loss {args.loss}" if getattr(args, "loss", None) else ""
    flags += "" if args.stages is None else " --stages " + ",".join(map(str, args.stages))
    for label, stage, sets in args.arm:
        flags += f' --arm "{label}={stage}:{";".join(sets)}"'
    return flags


def report(args, out: dict) -> str:
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    cmd = (
        f"`.venv/bin/python bench/bench_train.py{' --bare' if args.bare else ''} "
        f"--models {','.join(args.models)} --ranks {','.join(map(str, args.ranks))} "
        f"--repeats {args.repeats} --steps {args.steps} --small-steps {args.small_steps} "
        f"--skip {args.skip}{ab_flags(args)}`; fp32, torch AdamW, micro-batch {MICRO} x "
        f"accumulation {ACCUM} x seq 256 per rank"
    )
    if args.bare:
        return report_bare(args, out, cmd, load)
    lines = [
        "### Training throughput: recipe vs a plain PyTorch loop (`bench/bench_train.py`)",
        "",
        f"{cmd}; median of {args.repeats} alternating repeats "
        f"(min-max); MFU against the measured fp32 matmul peak of "
        f"{out['peak_flops'] / 1e9:.0f} GFLOP/s; load average at the end {load}.",
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


def report_bare(args, out: dict, cmd: str, load: str) -> str:
    zero = (
        "the ds_config's whole `zero_optimization` section"
        if args.bare_zero == "shipped"
        else "DeepSpeed's defaults for the rest of `zero_optimization`"
    )
    lines = [
        "### Training throughput: recipe vs a bare DeepSpeed engine (`bench_train.py --bare`)",
        "",
        f"{cmd}; the bare engine gets the ds_config's batch, clip, optimizer and ZeRO stage and "
        f"{zero}; tokens/s: median of {args.repeats} rounds (min-max); recipe / bare: the median "
        f"over rounds of the ratio within a round (min-max); MFU of the bare engine against the "
        f"measured fp32 matmul peak of {out['peak_flops'] / 1e9:.0f} GFLOP/s; load average at the "
        f"end {load}.",
        "",
        "| model | ranks | ZeRO | bare engine tokens/s | recipe tokens/s | recipe / bare "
        "| bare MFU | peak RSS MiB bare / recipe | step-1 loss diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    sparse = any("dense" in r for r in out["rows"])
    if sparse:
        lines[0] = (
            "### Mixture of Experts: the recipe vs a bare DeepSpeed AutoEP engine, and vs the "
            "dense step (`bench_moe.py`)"
        )
        lines[2] += (
            " A sparse model's third run per stage is its dense twin of equal active parameters "
            "in the same recipe, stage and ranks (tokens/s: median over rounds); sparse / dense "
            "step: the median over rounds of the sparse recipe's step time over the dense "
            "twin's (min-max). MFU counts the sparse model's active parameters."
        )
        lines[4] += " dense twin tokens/s | sparse / dense step |"
        lines[5] += "---:|---:|"
    for r in out["rows"]:
        b, c, q = r["bare"], r["recipe"], r["ratio"]
        line = (
            f"| {r['model']} | {r['ranks']} | {r['stage']} "
            f"| {b['median']:,.0f} ({b['min']:,.0f}-{b['max']:,.0f}) "
            f"| {c['median']:,.0f} ({c['min']:,.0f}-{c['max']:,.0f}) "
            f"| {q['median']:.3f}x ({q['min']:.3f}-{q['max']:.3f}) | {r['bare_mfu']:.0%} "
            f"| {r['peak_rss_mib'][0]:,} / {r['peak_rss_mib'][1]:,} | {r['step1_loss_diff']:.1e} |"
        )
        if sparse and "dense" in r:
            d, k = r["dense"], r["step_over_dense"]
            line += (
                f" {d['median']:,.0f} ({d['min']:,.0f}-{d['max']:,.0f}) "
                f"| {k['median']:.2f}x ({k['min']:.2f}-{k['max']:.2f}) |"
            )
        elif sparse:
            line += " - | - |"
        lines.append(line)
    return "\n".join(lines) + "\n"
