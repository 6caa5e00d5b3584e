"""``anneal data ...``: prepare token data, write synthetic corpora, verify a prepared directory.

Every default is read from the library (PrepareConfig, ReadOptions, write_markov's signature),
never typed again here, so that the command line and ``anneal.data`` cannot drift apart.
"""

from __future__ import annotations

import argparse
import inspect
import shlex
import sys
from pathlib import Path

from anneal.cli.args import path


def prepare_options(args: argparse.Namespace) -> dict:
    """``anneal data prepare``'s flags as the keywords of :func:`anneal.data.prepare.config`."""
    return {
        "inputs": args.input,
        "out": Path(args.out),
        "vocab_size": args.vocab_size,
        "model_type": args.model_type,
        "tokenizer": Path(args.tokenizer) if args.tokenizer else None,
        "tokenizer_sample_mb": args.tokenizer_sample_mb,
        "text_field": args.text_field,
        "include": args.include,
        "exclude": args.exclude,
        "on_error": args.on_error,
        "streaming": args.streaming,
        "unit_bytes": int(args.unit_mb * 2**20),
        "val_fraction": args.val_fraction,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "workers": args.workers,
        "dtype": args.dtype,
        "shard_tokens": args.shard_tokens,
        "force": args.force,
        "progress": not args.quiet,
        "command": shlex.join(["anneal", *sys.argv[1:]]),
    }


def _data_prepare(args: argparse.Namespace) -> int:
    from anneal.cli.data_prepare import prepare_in_tasks, print_prepared
    from anneal.data.prepare import config, run

    cfg = config(**prepare_options(args))
    if args.tasks is not None or args.task is not None or args.merge:
        return prepare_in_tasks(cfg, args)
    print_prepared(args.out, run(cfg))
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
    from anneal.data.checks import verify

    found = verify(Path(args.dir))
    what = f"{found['shards']} shard files ({found['bytes'] / 1e6:,.1f} MB)"
    what += " and the tokenizer match" if found["tokenizer"] else " match"
    files = f" ({', '.join(found['tokenizer'])})" if found["tokenizer"] else ""
    print(f"verified {args.dir}: {what} the sha256 recorded in meta.json{files}")
    print(f"content sha256 {found['content_sha256']} (every file but provenance.json)")
    if found["uncovered"]:
        print(
            f"note: meta.json records no sha256 for {', '.join(found['uncovered'])} (prepared "
            f"before Anneal recorded every tokenizer file, or added since), so they were not "
            f"verified; prepare the directory again to cover them."
        )
    return 0


def add_commands(sub) -> None:
    """``anneal data`` and its subcommands, on the top-level subparsers ``sub``."""
    data = sub.add_parser("data", help="prepare token data, write synthetic corpora")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    _add_prepare(data_sub)
    _add_synth(data_sub)
    _add_verify(data_sub)


def _add_prepare(data_sub) -> None:
    from anneal.data.prepare_config import PrepareConfig
    from anneal.data.readers import ReadOptions

    cfg = PrepareConfig(inputs=(), out=Path())
    prep = data_sub.add_parser(
        "prepare",
        help="train a tokenizer, tokenize and pack shards",
        description="Read the inputs, train (or reuse) a tokenizer, tokenize in parallel and "
        "pack into train/val shards. See docs/data.md.",
    )
    prep.add_argument(
        "--input",
        action="append",
        type=path,
        required=True,
        metavar="SRC[:WEIGHT]",
        help="stdlib | FILE (.txt, .jsonl[.gz], .parquet, ...) | DIR | GLOB | hf:NAME[?config=C"
        "&split=S]; repeat to blend, with weights (web.jsonl:0.7 --input code/:0.3) or by size",
    )
    prep.add_argument("--out", type=path, required=True, help="output data directory")
    _add_prepare_reading(prep, cfg, ReadOptions())
    _add_prepare_packing(prep, cfg)
    prep.set_defaults(func=_data_prepare)


def _add_prepare_reading(prep: argparse.ArgumentParser, cfg, read) -> None:
    """The tokenizer and how the inputs are read (``PrepareConfig`` ``cfg``, ``ReadOptions``)."""
    from anneal.data import tokenizer
    from anneal.data.readers import ON_ERROR

    prep.add_argument(
        "--vocab-size", type=int, default=cfg.vocab_size, help="trained tokenizer size"
    )
    prep.add_argument("--model-type", choices=tokenizer.MODEL_TYPES, default=cfg.model_type)
    prep.add_argument(
        "--tokenizer",
        type=path,
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
        "--unit-mb",
        type=float,
        default=read.unit_bytes / 2**20,
        help=f"input MB per work unit, the grain workers and tasks share (default "
        f"{read.unit_bytes / 2**20:g}; the output is the same for any)",
    )


def _add_prepare_packing(prep: argparse.ArgumentParser, cfg) -> None:
    """The split, the workers and the shards written (``PrepareConfig`` ``cfg``)."""
    from anneal.data.prepare_config import DTYPE_CHOICES

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
    prep.add_argument("--dtype", choices=DTYPE_CHOICES, default=cfg.dtype)
    prep.add_argument(
        "--shard-tokens", type=int, default=cfg.shard_tokens, help="ids per shard file"
    )
    prep.add_argument("--quiet", action="store_true", help="no progress line")
    prep.add_argument(
        "--tasks",
        type=int,
        metavar="N",
        help="prepare in N tasks (nodes): alone, step 1 writes the plan and the tokenizer into "
        "OUT.parts; then --task I for each I, then --merge (docs/data.md, 'Preparing tens of "
        "terabytes')",
    )
    prep.add_argument(
        "--task", type=int, metavar="I", help="step 2: tokenize and pack task I's share (0..N-1)"
    )
    prep.add_argument(
        "--merge",
        action="store_true",
        help="step 3: write OUT from every task's part (the one-node result), verify, remove "
        "the parts",
    )
    prep.add_argument(
        "--force", action="store_true", help="replace an --out that an earlier prepare wrote"
    )


def _add_synth(data_sub) -> None:
    from anneal.data.synth import write_markov

    markov = {k: p.default for k, p in inspect.signature(write_markov).parameters.items()}
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
    synth.add_argument("--out", type=path, required=True)
    synth.add_argument(
        "--force", action="store_true", help="replace an --out that an earlier synth wrote"
    )
    synth.set_defaults(func=_data_synth)


def _add_verify(data_sub) -> None:
    verify = data_sub.add_parser(
        "verify",
        help="re-hash every shard of a prepared directory against meta.json",
        description="Read every shard file of a prepared data directory and compare its sha256 "
        "with the one meta.json recorded when it was written, and every tokenizer file with "
        "tokenizer_files (tokenizer_sha256 for a directory prepared before it). Exit 0 when all "
        "match; 2 with the list of files that do not.",
    )
    verify.add_argument(
        "dir", metavar="DIR", type=path, help="a directory written by `anneal data prepare`"
    )
    verify.set_defaults(func=_data_verify)
