"""``anneal`` subcommands. Each parses its own flags and calls the library."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _data_prepare(args: argparse.Namespace) -> int:
    from anneal.data.prepare import prepare, unigram_entropy_bits_per_byte

    meta = prepare(
        inputs=args.input,
        out=Path(args.out),
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        seed=args.seed,
        force=args.force,
    )
    splits = meta["splits"]
    print(
        f"prepared {args.out}: vocab {meta['vocab_size']} ({meta['dtype']}), "
        f"train {splits['train']['tokens']:,} tokens / {splits['train']['documents']} docs, "
        f"val {splits['val']['tokens']:,} tokens / {splits['val']['documents']} docs, "
        f"in {meta['seconds']} s; unigram baseline "
        f"{unigram_entropy_bits_per_byte(Path(args.out), 'val'):.3f} bits/byte"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anneal",
        description="Anneal: LLM pretraining on "
        "DeepSpeed. Training runs through recipes/pretrain_*.py.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="prepare token data").add_subparsers(
        dest="data_command", required=True
    )
    prep = data.add_parser("prepare", help="train a tokenizer, tokenize and pack shards")
    prep.add_argument(
        "--input",
        action="append",
        required=True,
        help="source; 'stdlib' is the embedded default corpus",
    )
    prep.add_argument("--out", required=True, help="output data directory")
    prep.add_argument("--vocab-size", type=int, default=8192)
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=0.02,
        help="share of documents held out for validation",
    )
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--force", action="store_true", help="replace an existing --out")
    prep.set_defaults(func=_data_prepare)
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
