"""Training throughput: the recipe against a plain PyTorch loop (or a bare DeepSpeed engine).

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

--smoke: 2 ranks, the reference and the group's last stage (ZeRO-3; ``--bare``: one stage), one
round of 3 steps, each run's ranks forked from tests/scripts/ranks.py instead of started by
torchrun or the deepspeed runner (``train_run.launcher``: the same loops and collectives after
one import of torch and DeepSpeed, not one a rank plus the runner's); the step-1 losses of the
two sides must agree.

An A/B of DeepSpeed options is one command: ``--stages`` keeps only the listed recipe stages
beside the reference, and each ``--arm LABEL=STAGE:KEY=VALUE[;KEY=VALUE]`` adds a recipe run at
that stage with those ``--set`` overrides, alternating with the rest. For example ZeRO-2 with
and without ``overlap_comm``, against DDP:

    .venv/bin/python bench/bench_train.py --models tiny --ranks 2 --stages 2 --repeats 6 \
        --arm "overlap=2:ds.zero_optimization.overlap_comm=true"

``--bare``: what Anneal's loop costs on top of DeepSpeed. At each ZeRO stage (``--stages``,
default 1,2,3) and rank count, the recipe against a bare DeepSpeed engine of the same model,
batches, AdamW, clip and stage (``reference.py --engine deepspeed``; on 2 ranks both under
``deepspeed --num_gpus 2``). A stage's two runs are a pair, run back to back, which one first
alternating between rounds; the pairs rotate. The ratio is recipe / bare within a round, the
median over rounds. ``--loss plain`` gives the recipe runs ``train.loss=plain``: the loss over
the full logits, as the reference loops compute it (the recipe's default, the chunked loss, is
cheaper on CPU). ``--bare-zero shipped`` gives the bare engine the ds_config's whole
``zero_optimization`` (by default only its stage), to tell the shipped settings from the loop.

    .venv/bin/python bench/bench_train.py --bare [--repeats 2 --steps 8 --skip 2] [--report F]

``--bare --models tiny-moe`` (``bench/bench_moe.py``): the sparse model at ZeRO-1 and 2 (its
ZeRO-3 is not benchmarked), expert-parallel over the ranks, the recipe against a bare AutoEP engine
of the same objective, each stage's pair joined by its dense twin (tiny, equal active
parameters) in the same recipe: triples instead of pairs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from run_all import DEFAULT_DATA, ensure_data, machine_line  # noqa: E402
from train_report import against_bare, against_reference, report  # noqa: E402
from train_run import ACCUM, MICRO, RECIPE, run_one  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Model:
    """A model of the benchmark: its recipe, the ``--set`` overrides on the recipe's preset and
    the fp32 ds_config its runs take (``--set ds.zero_optimization.stage`` picks the stage)."""

    preset: str
    sets: tuple = ()
    recipe: str = RECIPE
    ds_config: str = "cpu.json"
    dense_twin: str | None = None
    """A sparse model's dense preset of equal active parameters: under ``--bare`` each stage's
    pair gains a third run, that preset trained by the same recipe and stage, whose step time
    the sparse one is read against. Sparse models run only under ``--bare``, at ZeRO-1/2
    (Anneal trains them at ZeRO-3 too; this benchmark does not run it), and on N ranks with
    ``autoep_size`` N."""
    stages: tuple = (1, 2, 3)


MODELS = {
    "tiny": Model("tiny"),  # 7.4M parameters at vocab 8192, seq 256
    "small": Model(  # 34M: the tiny preset widened and deepened
        "tiny",
        sets=(
            "model.hidden_size=512",
            "model.intermediate_size=1376",
            "model.num_hidden_layers=8",
            "model.num_attention_heads=8",
        ),
    ),
    # tiny's attention and 8 experts of width 344, 2 a token: tiny's active parameters
    "tiny-moe": Model(
        "tiny-moe",
        recipe="recipes/pretrain_moe_tiny.py",
        ds_config="cpu_zero2.json",
        dense_twin="tiny",
        stages=(1, 2),
    ),
}
DEFAULTS = {"models": "tiny,small", "repeats": 3, "steps": 24, "skip": 3}
# --bare: 24 runs of 8 steps, about 13 min on 2 quiet cores, half of it process start-up.
BARE_DEFAULTS = {"models": "tiny", "repeats": 2, "steps": 8, "skip": 2}
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


def plan_pairs(ranks: int, stages, model: str = "tiny") -> list[tuple]:
    """``--bare``: one (bare engine, recipe) pair per ZeRO stage, the model's (1, 2 and 3 for a
    dense one) unless ``stages``. A sparse model's pair runs at expert-parallel degree ``ranks``
    and gains a third run, its dense twin in the same recipe at the same stage."""
    spec = MODELS[model]
    twin = spec.dense_twin
    ep = (f"ds.expert_parallel.autoep_size={ranks}",)
    out = []
    for s in stages or spec.stages:
        if twin is None:
            out.append(
                ((f"bare ZeRO-{s}", "bare", ranks, s), (f"recipe ZeRO-{s}", "recipe", ranks, s))
            )
            continue
        out.append(
            (
                (f"bare ZeRO-{s}", "bare", ranks, s, ep),
                (f"recipe ZeRO-{s}", "recipe", ranks, s, ep),
                (f"dense {twin} recipe ZeRO-{s}", "recipe", ranks, s, (f"model.preset={twin}",)),
            )
        )
    return out


def round_order(group: list, pairs: list, r: int) -> list[tuple]:
    """Round ``r``'s runs: the group rotated by ``r``; with ``pairs``, the pairs rotated by
    ``r`` and each pair back to back, its bare run first in every other round (a sparse model's
    triple reversed whole: bare, recipe, dense, then dense, recipe, bare)."""
    if not pairs:
        return group[r % len(group) :] + group[: r % len(group)]
    indexed = list(enumerate(pairs))
    turned = indexed[r % len(pairs) :] + indexed[: r % len(pairs)]
    return [x for k, pair in turned for x in (pair if (r + k) % 2 == 0 else pair[::-1])]


def cpu_peak_flops() -> float:
    import torch

    from anneal.hardware import device_peak_flops

    torch.set_num_threads(os.cpu_count() or 1)
    return device_peak_flops(torch.device("cpu"))


def flops_per_token(model: str, data: str) -> float:
    from anneal.config.run import ModelConfig, RunConfig
    from anneal.config.run_checks import apply_overrides
    from anneal.data.prepared_dir import PreparedDir
    from anneal.model import flops_per_token as fpt
    from anneal.resolution.preset import model_preset

    meta = PreparedDir(data).meta()
    spec = MODELS[model]
    cfg = apply_overrides(
        RunConfig(out="", ds_config=spec.ds_config, model=ModelConfig(preset=spec.preset)),
        list(spec.sets),
    )
    return fpt(model_preset(cfg.model, meta["vocab_size"]))  # a sparse model's: active


def measure(args, model: str, ranks: int, group: list, pairs: list, scratch: Path) -> dict:
    """Every run of one model and rank count, ``--repeats`` rounds in ``round_order``: each
    run's name -> its results, one per round."""
    steps = args.small_steps if model == "small" else args.steps
    tokens = MICRO * ACCUM * ranks * 256
    sets = [*MODELS[model].sets, f"optim.global_batch_tokens={tokens}", "train.val_samples=0"]
    sets += [f"train.loss={args.loss}"] if args.loss else []  # the reference loops ignore it
    flags = ("--shipped-zero",) if args.bare_zero == "shipped" else ()
    runs = {spec[0]: [] for spec in group}
    for r in range(args.repeats):
        for spec in round_order(group, pairs, r):
            res = run_one(
                spec,
                data=args.data,
                steps=steps,
                skip=args.skip,
                sets=sets,
                tokens_per_step=tokens,
                scratch=scratch,
                flags=flags,
                model=MODELS[model],
                forked=args.smoke,
            )
            runs[spec[0]].append(res)
            print(
                f"  {model} {ranks} rank(s) {spec[0]}: {res['tokens_per_s']:,.0f} tokens/s",
                flush=True,
            )
    return runs


def bench(args) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="anneal-bench-train-"))
    peak = cpu_peak_flops()
    rows = []
    try:
        for model in args.models:
            fpt = flops_per_token(model, args.data)
            for ranks in args.ranks:
                if args.bare:
                    pairs = plan_pairs(ranks, args.stages, model)
                    group = [spec for pair in pairs for spec in pair]
                    runs = measure(args, model, ranks, group, pairs, scratch)
                    rows += against_bare(model, ranks, runs, pairs, fpt, peak)
                else:
                    group = plan_group(ranks, args.stages, args.arm, args.smoke)
                    runs = measure(args, model, ranks, group, [], scratch)
                    rows += against_reference(model, ranks, runs, fpt, peak)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"peak_flops": peak, "rows": rows}


def parse_stages(text: str | None) -> list[int] | None:
    if text is None:
        return None
    given = [x.strip() for x in text.split(",")]
    if not given or not all(x in ("0", "1", "2", "3") for x in given):
        raise SystemExit(
            f"bench_train: --stages {text!r}: give ZeRO stages 0-3, "
            "comma-separated, for example --stages 2 or --stages 1,3"
        )
    return [int(x) for x in given]


def check_models(args) -> None:
    """SystemExit for a model this comparison cannot run: an unknown one, or a sparse one
    outside ``--bare`` (the plain loop has no expert layer) or at ZeRO-3 (refused for it)."""
    for model in args.models:
        if model not in MODELS:
            raise SystemExit(f"bench_train: --models {model}: choose from {', '.join(MODELS)}")
        spec = MODELS[model]
        if spec.dense_twin and not args.bare:
            raise SystemExit(
                f"bench_train: --models {model} is sparse: it runs only under --bare (the recipe "
                "against a bare DeepSpeed AutoEP engine); the plain PyTorch loop has no expert "
                "layer"
            )
        refused = sorted(set(args.stages or ()) - set(spec.stages))
        if refused:
            raise SystemExit(
                f"bench_train: --stages {','.join(map(str, refused))} with --models {model}: it "
                f"is benchmarked at ZeRO {', '.join(map(str, spec.stages))} only (Anneal trains a "
                "sparse model at ZeRO-3 too; this benchmark has not been run there)"
            )


def main(argv: list[str] | None = None, *, bench_name: str = "train") -> None:
    """The command line (``argv``: sys.argv's by default); ``bench_name`` names the closing
    JSON line (``bench_moe.py`` passes "moe")."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DEFAULT_DATA), help="stdlib corpus (prepared if missing)")
    p.add_argument("--models", help="tiny,small (--bare: tiny); tiny-moe (sparse) with --bare only")
    p.add_argument("--ranks", help="rank counts, e.g. 1,2 (default; --smoke: 2)")
    p.add_argument("--repeats", type=int, help="rounds: 3 (--bare: 2)")
    p.add_argument("--steps", type=int, help="steps per run, tiny model: 24 (--bare: 8)")
    p.add_argument("--small-steps", type=int, default=10, help="steps per run, small model")
    p.add_argument("--skip", type=int, help="first steps left out of the rate: 3 (--bare: 2)")
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
    p.add_argument("--bare", action="store_true", help="recipe vs a bare DeepSpeed engine")
    p.add_argument(
        "--bare-zero",
        choices=("defaults", "shipped"),
        default="defaults",
        help="--bare: the bare engine's zero_optimization besides the stage: DeepSpeed's "
        "defaults, or the ds_config's whole section",
    )
    p.add_argument(
        "--loss",
        choices=("chunked", "plain"),
        help="the recipe's train.loss (default: the recipe's own, chunked); plain computes the "
        "loss over the full logits, as the reference loops do",
    )
    args = p.parse_args(argv)
    models_given = args.models
    for key, value in (BARE_DEFAULTS if args.bare else DEFAULTS).items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    args.arm = [parse_arm(a) for a in args.arm]
    if args.bare and args.arm:
        raise SystemExit("bench_train: --arm adds recipe runs beside the reference, not --bare")
    args.stages = parse_stages(args.stages)
    if args.smoke:  # the given models (tiny by default), a few steps, one stage
        args.repeats, args.steps, args.skip = 1, 3, 1
        args.models = models_given or "tiny"
        sparse = any(MODELS.get(m, MODELS["tiny"]).dense_twin for m in args.models.split(","))
        args.stages = args.stages or ([2 if sparse else 3] if args.bare else None)
    args.models = args.models.split(",")
    check_models(args)
    # --smoke: 2 ranks (DDP and the recipe's data parallelism) for CI's time; test_bench_train
    # runs the 1-rank arms against each other
    args.ranks = [int(r) for r in (args.ranks or ("2" if args.smoke else "1,2")).split(",")]
    args.data = str(ensure_data(args.data))
    out = bench(args)
    if args.smoke:
        bad = [r for r in out["rows"] if r["step1_loss_diff"] > 1e-4]
        if bad:
            raise SystemExit(f"bench_train: step-1 losses differ between the sides: {bad}")
    print(json.dumps({"bench": bench_name, "machine": machine_line(), **out}))
    if args.report:
        Path(args.report).write_text(report(args, out))


if __name__ == "__main__":
    main()
