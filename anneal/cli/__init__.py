"""``anneal`` subcommands. Each parses its own flags and calls the library."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import sys
from pathlib import Path

from anneal.errors import UserError

# --- data ------------------------------------------------------------------------------------


def _data_prepare(args: argparse.Namespace) -> int:
    import shlex

    from anneal.data.prepare import prepare
    from anneal.data.prepared import unigram_entropy_bits_per_byte

    meta = prepare(
        inputs=args.input,
        out=Path(args.out),
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        tokenizer=Path(args.tokenizer) if args.tokenizer else None,
        tokenizer_sample_mb=args.tokenizer_sample_mb,
        text_field=args.text_field,
        include=args.include,
        exclude=args.exclude,
        on_error=args.on_error,
        streaming=args.streaming,
        val_fraction=args.val_fraction,
        seq_len=args.seq_len,
        seed=args.seed,
        workers=args.workers,
        dtype=args.dtype,
        shard_tokens=args.shard_tokens,
        force=args.force,
        progress=not args.quiet,
        command=shlex.join(["anneal", *sys.argv[1:]]),
    )
    splits = meta["splits"]
    skipped = meta["skipped"]
    baseline_split = "val" if splits["val"]["tokens"] else "train"
    print(
        f"prepared {args.out}: vocab {meta['vocab_size']} ({meta['dtype']}), "
        f"train {splits['train']['tokens']:,} tokens / {splits['train']['documents']} docs, "
        f"val {splits['val']['tokens']:,} tokens / {splits['val']['documents']} docs, "
        f"in {meta['seconds']} s; unigram baseline "
        f"{unigram_entropy_bits_per_byte(Path(args.out), baseline_split):.3f} bits/byte "
        f"({baseline_split})"
        + (f"; skipped {skipped['records']} bad records" if skipped["records"] else "")
        + (f", {skipped['empty_files']} empty files" if skipped["empty_files"] else "")
    )
    return 0


def _data_synth(args: argparse.Namespace) -> int:
    from anneal.data.synth import write_markov

    meta = write_markov(
        out=Path(args.out),
        order=args.order,
        alphabet=args.alphabet,
        seed=args.seed,
        documents=args.documents,
        doc_chars=args.doc_chars,
        concentration=args.concentration,
        force=args.force,
    )
    synth = meta["synth"]
    print(
        f"wrote {args.out}: {synth['documents']} documents x {synth['doc_chars']:,} characters "
        f"from an order-{synth['order']} Markov source over {synth['alphabet']} symbols; "
        f"entropy rate {synth['entropy_bits_per_char']:.4f} bits/char "
        f"(unigram {synth['unigram_entropy_bits_per_char']:.4f})"
    )
    return 0


def _data_verify(args: argparse.Namespace) -> int:
    from anneal.data.prepared import verify

    found = verify(Path(args.dir))
    what = f"{found['shards']} shard files ({found['bytes'] / 1e6:,.1f} MB)"
    what += " and the tokenizer match" if found["tokenizer"] else " match"
    print(f"verified {args.dir}: {what} the sha256 recorded in meta.json")
    return 0


def _add_data_commands(sub) -> None:
    """Defaults come from the library: PrepareConfig, ReadOptions and write_markov."""
    import inspect

    from anneal.data import tokenizer as toklib
    from anneal.data.prepare import DTYPES, PrepareConfig
    from anneal.data.readers import ON_ERROR, ReadOptions
    from anneal.data.synth import write_markov

    cfg = PrepareConfig(inputs=(), out=Path())
    read = ReadOptions()
    markov = {k: p.default for k, p in inspect.signature(write_markov).parameters.items()}
    data = sub.add_parser("data", help="prepare token data, write synthetic corpora")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser(
        "prepare",
        help="train a tokenizer, tokenize and pack shards",
        description="Read the inputs, train (or reuse) a tokenizer, tokenize in parallel and "
        "pack into train/val shards. See docs/data.md.",
    )
    prep.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="SRC[:WEIGHT]",
        help="stdlib | FILE (.txt, .jsonl[.gz], .parquet, ...) | DIR | GLOB | hf:NAME[?config=C"
        "&split=S]; repeat to blend, with weights (web.jsonl:0.7 --input code/:0.3) or by size",
    )
    prep.add_argument("--out", required=True, help="output data directory")
    prep.add_argument(
        "--vocab-size", type=int, default=cfg.vocab_size, help="trained tokenizer size"
    )
    prep.add_argument("--model-type", choices=toklib.MODEL_TYPES, default=cfg.model_type)
    prep.add_argument(
        "--tokenizer",
        help="reuse a SentencePiece .model or a Hugging Face tokenizer directory (no training)",
    )
    prep.add_argument(
        "--tokenizer-sample-mb",
        type=float,
        default=cfg.tokenizer_sample_mb,
        help=f"MB of training text the tokenizer learns from (default {cfg.tokenizer_sample_mb:g})",
    )
    prep.add_argument(
        "--text-field", default=read.text_field, help="JSONL key / column with the text"
    )
    prep.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="only files of a directory matching this glob (repeatable)",
    )
    prep.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="leave out files of a directory matching this glob (repeatable)",
    )
    prep.add_argument(
        "--on-error",
        choices=ON_ERROR,
        default=read.on_error,
        help="a bad record (invalid JSON or UTF-8, missing field): stop with its file and line, "
        "or skip it and count it in meta.json",
    )
    prep.add_argument("--streaming", action="store_true", help="stream hf: datasets")
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=cfg.val_fraction,
        help=f"share of documents held out for validation (default {cfg.val_fraction:g}; 0: "
        "no validation data)",
    )
    prep.add_argument(
        "--seq-len",
        type=int,
        default=cfg.seq_len,
        help="the validation split must hold one window of this context plus one token, or "
        f"prepare fails (default {cfg.seq_len}, the smallest preset's)",
    )
    prep.add_argument("--seed", type=int, default=cfg.seed)
    prep.add_argument(
        "--workers", type=int, default=cfg.workers, help="processes (default 0: all cores)"
    )
    prep.add_argument("--dtype", choices=DTYPES, default=cfg.dtype)
    prep.add_argument(
        "--shard-tokens", type=int, default=cfg.shard_tokens, help="ids per shard file"
    )
    prep.add_argument("--quiet", action="store_true", help="no progress line")
    prep.add_argument(
        "--force", action="store_true", help="replace an --out that an earlier prepare wrote"
    )
    prep.set_defaults(func=_data_prepare)

    synth = data_sub.add_parser(
        "synth",
        help="write text from a random source of known entropy",
        description="Write documents drawn from a random order-K Markov source and record its "
        "exact entropy rate (bits per character) in meta.json. Prepare it with "
        "`anneal data prepare --input DIR`; a model's val_bpb can approach that rate but never "
        "go below it.",
    )
    synth.add_argument(
        "--order", type=int, default=markov["order"], help="characters of context (K)"
    )
    synth.add_argument(
        "--alphabet", type=int, default=markov["alphabet"], help="symbols (N, at most 52)"
    )
    synth.add_argument("--seed", type=int, default=markov["seed"])
    synth.add_argument("--documents", type=int, default=markov["documents"])
    synth.add_argument(
        "--doc-chars", type=int, default=markov["doc_chars"], help="characters per document"
    )
    synth.add_argument(
        "--concentration",
        type=float,
        default=markov["concentration"],
        help="Dirichlet concentration of each transition row: lower is more predictable",
    )
    synth.add_argument("--out", required=True)
    synth.add_argument(
        "--force", action="store_true", help="replace an --out that an earlier synth wrote"
    )
    synth.set_defaults(func=_data_synth)

    verify = data_sub.add_parser(
        "verify",
        help="re-hash every shard of a prepared directory against meta.json",
        description="Read every shard file of a prepared data directory and compare its sha256 "
        "with the one meta.json recorded when it was written (and the tokenizer with "
        "tokenizer_sha256). Exit 0 when all match; 2 with the list of files that do not.",
    )
    verify.add_argument("dir", metavar="DIR", help="a directory written by `anneal data prepare`")
    verify.set_defaults(func=_data_verify)


# ---------------------------------------------------------------------------------------------
# Planning: plan, fit, estimate (anneal/scaling/, anneal/scaling/memory.py; docs/planning.md).
# Every default below is read from the library (a signature or a module constant), never typed
# again here; tests/test_cli.py checks that.


def _default(fn, name: str):
    """The default of parameter ``name`` of ``fn``, for argparse."""
    return inspect.signature(fn).parameters[name].default


def _plan(args: argparse.Namespace) -> int:
    import json

    from anneal import scaling

    mfu, mfu_source = args.mfu, None
    if mfu is None and args.mfu_from:
        mfu, mfu_source = scaling.mfu_from_run(args.mfu_from)
    result = scaling.plan(
        flops=args.flops,
        params=args.params,
        tokens=args.tokens,
        target_loss=args.target_loss,
        gpus=args.gpus,
        hours=args.hours,
        gpu=args.gpu,
        mfu=mfu,
        mfu_source=mfu_source,
        fit=scaling.load_fit(args.fit),
        tokens_per_param=scaling.parse_rule(args.rule) if args.rule else None,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
    )
    print(json.dumps(result.to_dict()) if args.json else scaling.format_plan(result))
    return 0


def _fit(args: argparse.Namespace) -> int:
    import json

    from anneal import scaling
    from anneal.scaling.fit import claim_fit_outputs

    if bool(args.runs) == bool(args.csv):
        raise UserError("anneal fit: give run directories or --csv FILE (one of the two).")
    points = scaling.read_csv(args.csv) if args.csv else [scaling.read_run(r) for r in args.runs]
    out = Path(args.out)
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    claim_fit_outputs(out, plot, force=args.force)  # before the fit, which takes time
    result = scaling.fit_points(
        points, n_bootstrap=args.bootstrap, grid_starts=args.starts, seed=args.seed
    )
    out = scaling.write_fit(result, out)
    try:
        result.to_fit()
        from anneal.observe.plots import plot_fit

        plot_fit(result, plot)
    except UserError as e:  # no compute-optimal frontier to draw
        plot = None
        logging.warning("no plot: %s", e)
    if args.json:
        print(json.dumps({**result.to_json(), "fit_file": str(out), "plot": plot and str(plot)}))
    else:
        print(scaling.format_fit(result))
        print(f"wrote {out}" + (f" and {plot}" if plot else ""))
    return 0


def _estimate(args: argparse.Namespace) -> int:
    import json

    from anneal.config.ds import find_ds_config, load_ds_config
    from anneal.hardware import get_gpu
    from anneal.scaling import memory

    preset = memory.load_model(args.model)
    if args.vocab_size:
        preset = preset.with_vocab(args.vocab_size)
    run_ds = memory.run_ds_config(args.model) if not args.ds_config else None
    if run_ds is not None:
        ds = run_ds
    else:
        ds = load_ds_config(find_ds_config(args.ds_config or memory.DEFAULT_DS_CONFIG))
    zero = memory.ZeroSetup.from_ds_config(ds)
    if args.gpu_mem_gib is not None:
        if not args.gpu_mem_gib > 0:
            raise UserError(f"--gpu-mem-gib {args.gpu_mem_gib}: must be positive.")
        capacity, capacity_name = int(args.gpu_mem_gib * memory.GiB), f"{args.gpu_mem_gib:g} GiB"
    else:
        spec = get_gpu(args.gpu)
        capacity, capacity_name = spec.memory_bytes, spec.name
    work = memory.Workload(
        micro_batch=ds["train_micro_batch_size_per_gpu"]
        if args.micro_batch is None
        else args.micro_batch,
        seq_len=preset.seq_len if args.seq is None else args.seq,
        n_gpus=args.nodes * args.gpus_per_node,
        activation_checkpointing=args.activation_checkpointing,
        eager_attention=args.eager_attention,
    )
    est = memory.estimate(preset, zero, work, capacity=capacity)
    lever_list = []
    if not est.fits:
        lever_list = memory.levers(preset, zero, work, capacity=capacity, runtime_bytes=est.runtime)
    if args.json:
        doc = {
            **est.to_dict(),
            "model": preset.name,
            "param_count": memory.count_params(preset),
            "zero_stage": zero.stage,
            "n_gpus": work.n_gpus,
            "micro_batch": work.micro_batch,
            "seq_len": work.seq_len,
            "levers": [dataclasses.asdict(lever) for lever in lever_list],
        }
        print(json.dumps(doc))
    else:
        print(
            memory.format_estimate(
                est,
                preset=preset,
                zero=zero,
                work=work,
                capacity_name=capacity_name,
                lever_list=lever_list,
            )
        )
    return 0


def _add_planning_commands(sub) -> None:
    import math

    from anneal import scaling
    from anneal.hardware import DEFAULT_GPU, GPUS
    from anneal.model import NOMINAL_VOCAB
    from anneal.scaling import memory

    gpus = " | ".join(GPUS)
    plan = sub.add_parser(
        "plan",
        help="what to train for a budget: compute-optimal N and D, loss, steps, GPU-hours",
        description="Give exactly one budget: --flops, --gpus with --hours, --params, --tokens "
        "or --target-loss. FLOPs are 6ND. See docs/planning.md.",
    )
    plan.add_argument("--flops", type=float, help="training compute C in FLOPs")
    plan.add_argument("--gpus", type=int, help="GPUs (with --hours: the budget; else wall-clock)")
    plan.add_argument("--hours", type=float, help="wall-clock hours on --gpus")
    plan.add_argument(
        "--gpu", default=_default(scaling.plan, "gpu"), help=f"{gpus} (default %(default)s)"
    )
    plan.add_argument(
        "--mfu",
        type=float,
        help=f"model FLOPs utilisation in (0, 1] (default {scaling.DEFAULT_MFU})",
    )
    plan.add_argument("--mfu-from", metavar="RUN_DIR", help="use the MFU measured in a run")
    plan.add_argument("--params", type=float, help="model size N in parameters")
    plan.add_argument("--tokens", type=float, help="training tokens D")
    plan.add_argument("--target-loss", type=float, help="final loss in nats/token")
    plan.add_argument(
        "--fit",
        default=scaling.DEFAULT_FIT,
        help=f"{' | '.join(scaling.FITS)} | a file from `anneal fit` (default %(default)s)",
    )
    plan.add_argument("--rule", help="tokens-per-param=R instead of the fit's frontier")
    plan.add_argument(
        "--global-batch",
        type=int,
        default=_default(scaling.plan, "global_batch"),
        help="sequences per optimizer step (default %(default)s)",
    )
    plan.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=_plan)

    fit = sub.add_parser(
        "fit",
        help="fit L(N, D) = E + A/N^alpha + B/D^beta to finished runs",
        description=f"Hoffmann et al. 2022 approach 3: Huber loss (delta {scaling.HUBER_DELTA:g}) "
        "on log-loss, L-BFGS from a grid of starts, bootstrap 95% intervals. "
        "See docs/planning.md.",
    )
    fit.add_argument("runs", nargs="*", metavar="RUN_DIR", help="finished run directories")
    fit.add_argument("--csv", help="CSV with columns params,tokens,loss instead of runs")
    fit.add_argument("--out", default="scaling_fit.json", help="fit file to write")
    fit.add_argument("--plot", help="PNG to write (default: --out with .png)")
    fit.add_argument(
        "--force",
        action="store_true",
        help="replace an --out (and its plot) that an earlier `anneal fit` wrote",
    )
    fit.add_argument(
        "--bootstrap",
        type=int,
        default=_default(scaling.fit_points, "n_bootstrap"),
        help="bootstrap resamples (default %(default)s)",
    )
    grid_size = math.prod(len(v) for v in scaling.INIT_GRID.values())
    fit.add_argument(
        "--starts",
        type=int,
        default=_default(scaling.fit_points, "grid_starts"),
        help=f"L-BFGS from this many best grid points (default all {grid_size})",
    )
    fit.add_argument(
        "--seed",
        type=int,
        default=_default(scaling.fit_points, "seed"),
        help="seed of the bootstrap resamples (default %(default)s)",
    )
    fit.add_argument("--json", action="store_true", help="print one JSON object")
    fit.set_defaults(func=_fit)

    est = sub.add_parser(
        "estimate",
        help="per-GPU memory of a run: ZeRO model states, activations, buffers; levers",
        description="See docs/planning.md.",
    )
    est.add_argument("--model", required=True, help="preset name or a config.json")
    est.add_argument(
        "--ds-config",
        help="DeepSpeed JSON (default: the run's when --model is a run's config.json, else "
        f"{memory.DEFAULT_DS_CONFIG})",
    )
    est.add_argument(
        "--nodes", type=int, default=memory.DEFAULT_NODES, help="(default %(default)s)"
    )
    est.add_argument(
        "--gpus-per-node",
        type=int,
        default=memory.DEFAULT_GPUS_PER_NODE,
        help="(default %(default)s)",
    )
    est.add_argument("--seq", type=int, help="tokens per sequence (default: the model's)")
    est.add_argument("--micro-batch", type=int, help="default: the ds_config's")
    est.add_argument("--activation-checkpointing", action="store_true")
    est.add_argument(
        "--eager-attention",
        action="store_true",
        help="count stored attention scores (Anneal's SDPA attention stores none)",
    )
    est.add_argument(
        "--vocab-size", type=int, help=f"default: the model's (presets: {NOMINAL_VOCAB})"
    )
    est.add_argument("--gpu", default=DEFAULT_GPU, help=f"{gpus} (default %(default)s)")
    est.add_argument("--gpu-mem-gib", type=float, help="device memory instead of --gpu")
    est.add_argument("--json", action="store_true", help="print one JSON object")
    est.set_defaults(func=_estimate)


# ---------------------------------------------------------------------------------------------
# A run, after (or while) it trains: export, plot, report, generate (docs/observability.md).


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
    from anneal.observe import plots

    if args.schedule:
        if args.run:
            raise UserError("anneal plot: give a RUN directory or --schedule CONFIG, not both.")
        path = plots.plot_schedule_file(
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
    return 1 if args.strict and any(s.status == report.PROBLEM for s in signals) else 0


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


def _add_run_commands(sub) -> None:
    exp = sub.add_parser(
        "export",
        help="write a verified Hugging Face model directory from a run's checkpoint",
        description="Convert a ZeRO checkpoint (any stage) to config.json, safetensors shards, "
        "generation_config.json and the tokenizer, one tensor at a time, then load it with "
        "transformers and compare logits with the checkpoint. See docs/observability.md.",
    )
    exp.add_argument("run", metavar="RUN", help="run directory (the recipe's --out)")
    exp.add_argument("--out", required=True, help="directory to write (must be new or empty)")
    exp.add_argument("--tag", help="checkpoint tag, e.g. step00000300 (default: the newest)")
    exp.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    exp.add_argument("--shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    exp.add_argument("--force", action="store_true", help="replace a non-empty --out")
    exp.add_argument(
        "--tokenizer", help="prepared data directory with the run's tokenizer (default: the run's)"
    )
    exp.add_argument(
        "--every-save", action="store_true", help="export every intact checkpoint to OUT/<tag>"
    )
    exp.add_argument("--json", action="store_true", help="print one JSON object per export")
    exp.set_defaults(func=_export)

    plot = sub.add_parser(
        "plot",
        help="PNG charts of a run (RUN/plots/) or of an LR schedule",
        description="`anneal plot RUN` writes loss, LR, grad-norm and throughput charts to "
        "RUN/plots/. `anneal plot --schedule ds_configs/zero3_bf16.json --steps 100000` draws "
        "the warmup-cosine schedule alone.",
    )
    plot.add_argument("run", metavar="RUN", nargs="?", help="run directory")
    plot.add_argument(
        "--schedule", metavar="CONFIG", help="a ds_config JSON (or a name in ds_configs/)"
    )
    plot.add_argument("--steps", type=int, help="total optimizer steps (with --schedule)")
    plot.add_argument("--peak-lr", type=float, help='peak LR when the config says "auto"')
    plot.add_argument("--warmup-steps", type=int, help='warmup steps when the config says "auto"')
    plot.add_argument("--out", help="output directory (RUN) or PNG file (--schedule)")
    plot.add_argument("--dark", action="store_true", help="dark theme")
    plot.set_defaults(func=_plot)

    rep = sub.add_parser(
        "report",
        help="health of a run: each signal of the seed's table marked healthy or problem",
    )
    rep.add_argument("run", metavar="RUN", help="run directory")
    rep.add_argument("--json", action="store_true", help="print one JSON list")
    rep.add_argument("--strict", action="store_true", help="exit 1 when a signal is a problem")
    rep.set_defaults(func=_report)

    gen = sub.add_parser("generate", help="sample text from an exported model directory")
    gen.add_argument("model_dir", metavar="DIR", help="a directory written by `anneal export`")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64, help="at most (stops at EOS)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=50, help="0: no top-k filter")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]; 1: off")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anneal",
        description="Anneal: LLM pretraining on "
        "DeepSpeed. Training runs through recipes/pretrain_*.py.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_data_commands(sub)
    _add_planning_commands(sub)
    _add_run_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:  # anything else is a bug or the environment: keep its traceback
        print(f"anneal {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
