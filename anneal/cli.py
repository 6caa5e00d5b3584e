"""``anneal`` subcommands. Each parses its own flags and calls the library."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# --- data ------------------------------------------------------------------------------------


def _data_prepare(args: argparse.Namespace) -> int:
    import shlex

    from anneal.data.prepare import prepare, unigram_entropy_bits_per_byte

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


def _add_data_commands(sub) -> None:
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
    prep.add_argument("--vocab-size", type=int, default=8192, help="trained tokenizer size")
    prep.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    prep.add_argument(
        "--tokenizer",
        help="reuse a SentencePiece .model or a Hugging Face tokenizer directory (no training)",
    )
    prep.add_argument(
        "--tokenizer-sample-mb",
        type=float,
        default=64.0,
        help="MB of training text the tokenizer learns from (default 64)",
    )
    prep.add_argument("--text-field", default="text", help="JSONL key / column with the text")
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
        choices=("stop", "skip"),
        default="stop",
        help="a bad record (invalid JSON or UTF-8, missing field): stop with its file and line, "
        "or skip it and count it in meta.json",
    )
    prep.add_argument("--streaming", action="store_true", help="stream hf: datasets")
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=0.02,
        help="share of documents held out for validation",
    )
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--workers", type=int, default=0, help="processes (default: all cores)")
    prep.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto")
    prep.add_argument(
        "--shard-tokens", type=int, default=16 * 1024 * 1024, help="ids per shard file"
    )
    prep.add_argument("--quiet", action="store_true", help="no progress line")
    prep.add_argument("--force", action="store_true", help="replace an existing --out")
    prep.set_defaults(func=_data_prepare)

    synth = data_sub.add_parser(
        "synth",
        help="write text from a random source of known entropy",
        description="Write documents drawn from a random order-K Markov source and record its "
        "exact entropy rate (bits per character) in meta.json. Prepare it with "
        "`anneal data prepare --input DIR`; a model's val_bpb can approach that rate but never "
        "go below it.",
    )
    synth.add_argument("--kind", choices=("markov",), default="markov")
    synth.add_argument("--order", type=int, default=2, help="characters of context (K)")
    synth.add_argument("--alphabet", type=int, default=8, help="symbols (N, at most 52)")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--documents", type=int, default=64)
    synth.add_argument("--doc-chars", type=int, default=32768, help="characters per document")
    synth.add_argument(
        "--concentration",
        type=float,
        default=0.5,
        help="Dirichlet concentration of each transition row: lower is more predictable",
    )
    synth.add_argument("--out", required=True)
    synth.add_argument("--force", action="store_true", help="replace an existing --out")
    synth.set_defaults(func=_data_synth)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anneal",
        description="Anneal: LLM pretraining on "
        "DeepSpeed. Training runs through recipes/pretrain_*.py.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_data_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"anneal {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
