"""Document masking against none at equal tokens (``data.document_mask``; docs/training.md,
"Documents in a packed window"): the tiny preset on the embedded stdlib corpus, the same
tokens, schedule, init and data order, masked and unmasked one after the other for each seed
(so that a change of the machine's load falls on both), each validated on the whole val split
with its own setting. Reported: each run's final validation bits per byte, the difference per
seed against the spread over seeds, the median tokens/s of each side (after the first steps),
and how much of the corpus a window's mask touches (the windows that hold a boundary).

    .venv/bin/python bench/bench_docmask.py [--steps 120] [--seeds 0,1,2] [--report F]
    .venv/bin/python bench/bench_docmask.py --smoke        (CI: 2 steps, one seed, nothing kept)
    .venv/bin/python bench/bench_docmask.py --long-context [--steps 4]
    .venv/bin/python bench/bench_docmask.py --kernel [--steps 30]

``--long-context``: masking on at 4096 tokens, many short documents (about 9 tokens each, a
corpus made here), micro shapes (hidden 64, 2 layers, 4 heads), Ulysses SP=2 on 2 CPU ranks
against SP=1 on 1 rank at the same 2 samples a step (ZeRO-2): the largest relative difference of
the per-step losses and of the validation loss.

``--kernel``: what the mask itself costs where it applies, in one process: the tiny model's
forward and backward on a micro-batch of 4 x 256 tokens whose every window holds a boundary
(the stdlib val windows that do), without position ids (as off) and with the documents'
positions (the mask), alternating, ``--steps`` times each; the median seconds of each.
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

from run_all import DEFAULT_DATA, ensure_data, machine_line  # noqa: E402

from anneal.observe.metrics import read_metrics  # noqa: E402

SEQ_LEN, MICRO, BATCH_TOKENS, PEAK_LR = 256, 4, 8 * 256, 7e-4
SIDES = {"off": "false", "on": "true"}


def command(*, out: Path, data: Path, steps: int, seed: int, mask: str, val: int) -> list[str]:
    """The tiny recipe on one rank (ds_configs/cpu.json, fp32), validated after the last step on
    ``val`` windows of the val split."""
    return [
        sys.executable,
        "recipes/pretrain_tiny.py",
        *("--out", str(out), "--data", str(data), "--max-steps", str(steps)),
        *("--ds-config", "cpu.json", "--val-every", "0", "--save-every", "0"),
        *("--seed", str(seed)),
        *("--set", f"data.document_mask={mask}"),
        *("--set", f"model.seq_len={SEQ_LEN}"),
        *("--set", f"ds.train_micro_batch_size_per_gpu={MICRO}"),
        *("--set", f"optim.global_batch_tokens={BATCH_TOKENS}"),
        *("--set", f"optim.lr={PEAK_LR}"),
        *("--set", "optim.schedule=wsd"),
        *("--set", f"train.val_samples={val}"),
        *("--set", "train.log_every=10"),
    ]


def run(side: str, *, work: Path, data: Path, steps: int, seed: int, val: int) -> dict:
    out = work / f"{side}-seed{seed}"
    t0 = time.perf_counter()
    cmd = command(out=out, data=data, steps=steps, seed=seed, mask=SIDES[side], val=val)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    train = read_metrics(out, "train")
    final = read_metrics(out, "val")[-1]
    return {
        "side": side,
        "seed": seed,
        "wall_s": round(time.perf_counter() - t0, 1),
        "val_bpb": final["val_bpb"],
        "val_loss": final["val_loss"],
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[2:] or train),
    }


def boundaries(data: Path) -> dict:
    """Of the val split's windows of SEQ_LEN + 1 tokens: the share that holds an end-of-text
    token (before its last place), and the share of tokens that follow one in their window
    (what masking changes)."""
    import numpy as np

    from anneal.data.prepared_dir import PreparedDir
    from anneal.data.stream import PackedSplit

    split = PackedSplit(data, "val", seq_len=SEQ_LEN)
    eos = PreparedDir(data).eos_id(PreparedDir(data).meta())
    ids = np.stack([split.window(j)[:-1] for j in range(split.n_windows)])
    after = np.cumsum(ids == eos, axis=1) - (ids == eos) > 0
    return {
        "windows": split.n_windows,
        "with_boundary": float((ids == eos).any(1).mean()),
        "tokens_after_a_boundary": float(after.mean()),
    }


def long_context(work: Path, *, steps: int) -> dict:
    """SP=2 against SP=1 with masking at 4096 tokens on short documents (module docstring)."""
    from anneal.data.prepare import prepare
    from anneal.dist import free_port

    words = "the quick brown fox jumps over a lazy dog while seven ducks watch".split()
    src = work / "docs.txt"
    src.write_text("\n\n".join(" ".join(words[i % 11 : i % 11 + 1 + i % 3]) for i in range(20000)))
    data = work / "docs"
    prepare(inputs=[str(src)], out=data, vocab_size=300, val_fraction=0.2, progress=False)
    shape = [
        *("model.hidden_size=64", "model.num_hidden_layers=2", "model.intermediate_size=176"),
        *("model.num_attention_heads=4", "model.seq_len=4096", "train.val_samples=4"),
        *("ds.train_micro_batch_size_per_gpu=1", "ds.gradient_accumulation_steps=2"),
        *("data.document_mask=true", "train.log_every=1"),
    ]
    out = {}
    for sp in (1, 2):
        run_dir = work / f"sp{sp}"
        args = ["recipes/pretrain_tiny.py", "--out", str(run_dir), "--data", str(data)]
        args += ["--max-steps", str(steps), "--ds-config", "cpu_zero2.json", "--save-every", "0"]
        args += [x for item in [*shape, f"ds.sequence_parallel_size={sp}"] for x in ("--set", item)]
        deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2"]
        start = [*deepspeed, "--master_port", str(free_port())] if sp == 2 else [sys.executable]
        t0 = time.perf_counter()
        subprocess.run([*start, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        train, val = read_metrics(run_dir, "train"), read_metrics(run_dir, "val")[-1]
        out[sp] = {"wall_s": round(time.perf_counter() - t0, 1), "train": train, "val": val}
    rel = [
        abs(a["loss"] - b["loss"]) / abs(a["loss"])
        for a, b in zip(*(out[s]["train"] for s in (1, 2)), strict=True)
    ]
    val_rel = abs(out[2]["val"]["val_loss"] - out[1]["val"]["val_loss"]) / out[1]["val"]["val_loss"]
    return {
        "steps": steps,
        "losses_sp1": [r["loss"] for r in out[1]["train"]],
        "max_rel_loss_diff": max(rel),
        "val_loss_sp1": out[1]["val"]["val_loss"],
        "val_rel_diff": val_rel,
        "wall_s": {sp: out[sp]["wall_s"] for sp in out},
    }


def kernel(data: Path, *, steps: int) -> dict:
    """The mask's own cost on one micro-batch (module docstring)."""
    import numpy as np
    import torch

    from anneal.data.documents import document_positions
    from anneal.data.prepared_dir import PreparedDir
    from anneal.data.stream import PackedSplit
    from anneal.model import build_model, get_preset, init_weights_

    split = PackedSplit(data, "val", seq_len=SEQ_LEN)
    eos = PreparedDir(data).eos_id(PreparedDir(data).meta())
    windows = [split.window(j)[:-1] for j in range(split.n_windows)]
    x = torch.from_numpy(np.stack([w for w in windows if (w == eos).any()][:MICRO]))
    model = build_model(get_preset("tiny").with_vocab(split.vocab_size))
    init_weights_(model, std=0.02, seed=0)
    inputs = {"off": {"input_ids": x}, "on": {"input_ids": x}}
    inputs["on"]["position_ids"] = document_positions(x, eos)
    times = {"off": [], "on": []}
    for _ in range(steps + 2):  # the first two of each: warmup, left out
        for side, given in inputs.items():
            t0 = time.perf_counter()
            model(**given, labels=x).loss.backward()
            times[side].append(time.perf_counter() - t0)
    median = {side: statistics.median(t[2:]) for side, t in times.items()}
    return {"median_s": median, "on_over_off": median["on"] / median["off"], "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, help="default 120; 4 with --long-context")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--report", help="write the runs and the differences here, as markdown")
    p.add_argument("--smoke", action="store_true", help="2 steps, one seed, nothing kept")
    p.add_argument("--long-context", action="store_true", help="SP=2 against SP=1 at 4096")
    p.add_argument("--kernel", action="store_true", help="the mask's cost on one micro-batch")
    args = p.parse_args()
    if args.kernel:
        found = kernel(ensure_data(args.data), steps=args.steps or 30)
        print(json.dumps({"bench": "docmask_kernel", **found}))
        return
    if args.long_context:
        with tempfile.TemporaryDirectory(prefix="bench-docmask-long-") as tmp:
            found = long_context(Path(tmp), steps=args.steps or 4)
        print(json.dumps({"bench": "docmask_long_context", **found}))
        return
    steps, seeds, val = args.steps or 120, [int(s) for s in args.seeds.split(",")], 1_000_000
    if args.smoke:
        steps, seeds, val = 2, [0], 8
    data = ensure_data(args.data)
    with tempfile.TemporaryDirectory(prefix="bench-docmask-") as tmp:
        runs = [
            run(side, work=Path(tmp), data=data, steps=steps, seed=seed, val=val)
            for seed in seeds
            for side in SIDES
        ]
    by = {s: [r for r in runs if r["side"] == s] for s in SIDES}
    diffs = [on["val_bpb"] - off["val_bpb"] for off, on in zip(by["off"], by["on"], strict=True)]
    spread = {s: max(r["val_bpb"] for r in v) - min(r["val_bpb"] for r in v) for s, v in by.items()}
    speed = {s: statistics.median(r["median_tokens_per_s"] for r in v) for s, v in by.items()}
    share = boundaries(data)
    for r in runs:
        print(
            f"{r['side']:3} seed {r['seed']}: {r['wall_s']} s, val bpb {r['val_bpb']:.4f}, "
            f"{r['median_tokens_per_s']:,.0f} tokens/s"
        )
    print(
        f"on - off val bpb per seed {[round(d, 4) for d in diffs]}; spread over seeds: off "
        f"{spread['off']:.4f}, on {spread['on']:.4f}; tokens/s off {speed['off']:,.0f}, on "
        f"{speed['on']:,.0f}; val windows with a boundary {share['with_boundary']:.3f}"
    )
    result = {"bench": "docmask", "steps": steps, "runs": runs, "diffs": diffs, **share}
    print(json.dumps(result))
    if args.report and not args.smoke:
        Path(args.report).write_text(fragment(runs, steps=steps, diffs=diffs, speed=speed, **share))


def fragment(runs, *, steps: int, diffs, speed, windows, with_boundary, tokens_after_a_boundary):
    """The markdown of ``--report``: one row per run, the differences and the speeds."""
    rows = ["| masking | seed | val bpb | tokens/s | wall s |", "|---|---|---|---|---|"]
    for r in runs:
        rows.append(
            f"| {r['side']} | {r['seed']} | {r['val_bpb']:.4f} | "
            f"{r['median_tokens_per_s']:,.0f} | {r['wall_s']} |"
        )
    return (
        f"### Document masking at equal tokens ({steps} steps)\n\n"
        f"`.venv/bin/python bench/bench_docmask.py --steps {steps}` on {machine_line()}: "
        f"on - off final validation bits per byte per seed "
        f"{', '.join(f'{d:+.4f}' for d in diffs)}; median tokens/s off {speed['off']:,.0f}, "
        f"on {speed['on']:,.0f}. Of the {windows} val windows of {SEQ_LEN + 1} tokens, "
        f"{100 * with_boundary:.1f}% hold a boundary and {100 * tokens_after_a_boundary:.1f}% "
        f"of the tokens follow one.\n\n" + "\n".join(rows) + "\n"
    )


if __name__ == "__main__":
    main()
