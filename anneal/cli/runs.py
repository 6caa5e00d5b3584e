"""``anneal export``, ``plot``, ``report``, ``compare``, ``generate``, ``checkpoint``: a run,
after (or while) it trains (anneal/hf/, anneal/observe/, anneal/resilience/;
docs/observability.md, docs/evaluation.md, docs/resilience.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from anneal.cli.args import path
from anneal.errors import UserError


def _export(args: argparse.Namespace) -> int:
    import json

    from anneal.hf import export

    run = Path(args.run)
    kwargs = dict(
        dtype=args.dtype,
        shard_size=args.shard_size,
        force=args.force,
        tokenizer=Path(args.tokenizer) if args.tokenizer else None,
    )
    if args.every_save:
        if args.tag:
            raise UserError("anneal export: --every-save exports every tag; drop --tag.")
        reports = export.export_every_save(run, out=Path(args.out), **kwargs)
    else:
        reports = [export.export(run, out=Path(args.out), tag=args.tag, **kwargs)]
    for r in reports:
        print(json.dumps(r) if args.json else export.format_report(r))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from anneal.observe import formula_plots, plots

    if args.schedule:
        if args.run:
            raise UserError("anneal plot: give a RUN directory or --schedule CONFIG, not both.")
        path = formula_plots.plot_schedule_file(
            Path(args.schedule),
            steps=args.steps,
            peak_lr=args.peak_lr,
            warmup_steps=args.warmup_steps,
            out=Path(args.out) if args.out else None,
            dark=args.dark,
        )
        print(f"wrote {path}")
        return 0
    if not args.run:
        raise UserError("anneal plot: give a RUN directory, or --schedule CONFIG --steps N.")
    for path in plots.plot_run(
        Path(args.run), out_dir=Path(args.out) if args.out else None, dark=args.dark
    ):
        print(f"wrote {path}")
    return 0


def _report(args: argparse.Namespace) -> int:
    import json

    from anneal.observe import report

    signals = report.health(Path(args.run))
    if args.json:
        print(json.dumps([s.to_dict() for s in signals]))
    else:
        print(report.format_table(signals, run_dir=Path(args.run)))
    problems = any(s.status == report.PROBLEM for s in signals)
    if problems and not args.strict and not args.json:  # the exit status is a choice: say it
        print("  (exit status 0: a problem is a finding; `--strict` exits 1 when there is one)")
    return 1 if args.strict and problems else 0


def _compare(args: argparse.Namespace) -> int:
    from anneal.observe import compare

    print(compare.format_compare(compare.load([Path(r) for r in args.runs])))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from anneal.hf import generate

    text = generate.sample(
        Path(args.model_dir),
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    print(text)
    return 0


def _prune_universal(args: argparse.Namespace) -> int:
    from anneal.resilience import universal

    found = universal.prune_run(Path(args.run), everything=args.all, dry_run=args.dry_run)
    if not found:
        print(f"{args.run}: no universal conversions under checkpoints/{universal.CACHE}/")
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for f in found:
        print(f"{verb if f['removed'] else 'kept'} {f['path']} ({_mib(f['bytes'])}): {f['why']}")
    freed = sum(f["bytes"] for f in found if f["removed"])
    print(f"{'would free' if args.dry_run else 'freed'} {_mib(freed)}")
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def add_commands(sub) -> None:
    """``export``, ``plot``, ``report``, ``compare``, ``generate`` and ``checkpoint``, on the
    top-level subparsers ``sub``."""
    _add_export(sub)
    _add_plot(sub)
    _add_report(sub)
    _add_compare(sub)
    _add_generate(sub)
    _add_checkpoint(sub)


def _add_checkpoint(sub) -> None:
    ckpt = sub.add_parser("checkpoint", help="manage a run's checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", required=True)
    prune = ckpt_sub.add_parser(
        "prune-universal",
        help="remove the universal conversions a run no longer needs",
        description="A resume at another layout converts the checkpoint once to DeepSpeed's "
        "universal format under RUN/checkpoints/.universal/. Each save removes the conversions "
        "of older checkpoints; this removes them on demand: those older than the run's newest "
        "checkpoint, those whose checkpoint is gone, leftovers of a conversion that died, or "
        "with --all every one. Never one a running job is converting or loading. See "
        "docs/resilience.md.",
    )
    prune.add_argument("run", metavar="RUN", type=path, help="run directory (the recipe's --out)")
    prune.add_argument(
        "--all", action="store_true", help="every conversion (a later resume makes it again)"
    )
    prune.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    prune.set_defaults(func=_prune_universal)


def _add_export(sub) -> None:
    exp = sub.add_parser(
        "export",
        help="write a verified Hugging Face model directory from a run's checkpoint",
        description="Convert a ZeRO checkpoint (any stage) to config.json, safetensors shards, "
        "generation_config.json and the tokenizer, one tensor at a time, then load it with "
        "transformers and compare logits with the checkpoint. See docs/observability.md.",
    )
    exp.add_argument("run", metavar="RUN", type=path, help="run directory (the recipe's --out)")
    exp.add_argument(
        "--out", type=path, required=True, help="directory to write (must be new or empty)"
    )
    exp.add_argument("--tag", help="checkpoint tag, e.g. step00000300 (default: the newest)")
    exp.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    exp.add_argument("--shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    exp.add_argument("--force", action="store_true", help="replace a non-empty --out")
    exp.add_argument(
        "--tokenizer",
        type=path,
        help="prepared data directory with the run's tokenizer (default: the run's)",
    )
    exp.add_argument(
        "--every-save", action="store_true", help="export every intact checkpoint to OUT/<tag>"
    )
    exp.add_argument("--json", action="store_true", help="print one JSON object per export")
    exp.set_defaults(func=_export)


def _add_plot(sub) -> None:
    plot = sub.add_parser(
        "plot",
        help="PNG charts of a run (RUN/plots/) or of an LR schedule",
        description="`anneal plot RUN` writes loss, LR, grad-norm and throughput charts to "
        "RUN/plots/ (and downstream.png when the run has downstream scores). "
        "`anneal plot --schedule ds_configs/zero3_bf16.json --steps 100000` draws "
        "the warmup-cosine schedule alone.",
    )
    plot.add_argument("run", metavar="RUN", nargs="?", type=path, help="run directory")
    plot.add_argument(
        "--schedule",
        metavar="CONFIG",
        type=path,
        help="a ds_config JSON (or a name in ds_configs/)",
    )
    plot.add_argument("--steps", type=int, help="total optimizer steps (with --schedule)")
    plot.add_argument("--peak-lr", type=float, help='peak LR when the config says "auto"')
    plot.add_argument("--warmup-steps", type=int, help='warmup steps when the config says "auto"')
    plot.add_argument("--out", type=path, help="output directory (RUN) or PNG file (--schedule)")
    plot.add_argument("--dark", action="store_true", help="dark theme")
    plot.set_defaults(func=_plot)


def _add_report(sub) -> None:
    rep = sub.add_parser(
        "report",
        help="health of a run: each signal of the seed's table marked healthy or problem",
    )
    rep.add_argument("run", metavar="RUN", type=path, help="run directory")
    rep.add_argument("--json", action="store_true", help="print one JSON list")
    rep.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when a signal is a problem (default: exit 0, problems or not)",
    )
    rep.set_defaults(func=_report)


def _add_compare(sub) -> None:
    com = sub.add_parser(
        "compare",
        help="runs side by side: final validation and latest downstream scores, the best marked",
        description="Set the cooldown branches of one parent (or any runs) side by side: each "
        "run's last val_loss and val_bpb and its latest score on each downstream task (with its "
        "stderr), the best of each row marked, and which run wins on what. See "
        "docs/evaluation.md.",
    )
    com.add_argument("runs", metavar="RUN", nargs="+", type=path, help="run directories (2+)")
    com.set_defaults(func=_compare)


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="sample text from an exported model directory")
    gen.add_argument(
        "model_dir", metavar="DIR", type=path, help="a directory written by `anneal export`"
    )
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64, help="at most (stops at EOS)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=50, help="0: no top-k filter")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]; 1: off")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_generate)
