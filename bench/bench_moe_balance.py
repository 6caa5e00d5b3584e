"""The router is trained: from a router made to send most tokens to two of its eight experts,
the load-balancing loss moves the load toward uniform; with its weight at 0 it does not.

The start: the tiny-moe preset, initialised as Anneal does (seed 0), then each layer's router
pushed toward experts 0 and 1: their rows of the router get ``--skew`` times the unit direction
of that layer's mean input over a batch of the corpus (scaled by 1 / its norm), so a typical
token's logits for those two experts rise by about ``--skew``. Saved with ``save_pretrained``
beside the corpus's tokenizer, it is the ``--init-from`` of two runs of
recipes/pretrain_moe_tiny.py, identical but for ``model.moe_aux_loss_coef`` (0.01, the recipe's,
and 0). Each step's max/mean load per layer comes from the metrics (``moe_max_mean``: 1 is
uniform, 4 is every token on two of eight experts); the result is the mean over layers at the
first step and over the last ``--tail`` steps, and their ratio.

    .venv/bin/python bench/bench_moe_balance.py [--steps 120] [--skew 4] [--report F]
    .venv/bin/python bench/bench_moe_balance.py --smoke        (CI: 3 steps of the recipe's
                                                                coefficient only, nothing kept)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from run_all import DEFAULT_DATA, ensure_data, machine_line  # noqa: E402

from anneal.observe.metrics import read_metrics  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
COEFS = (0.01, 0.0)


def skewed_model(out: Path, data: Path, *, skew: float, shape: dict | None = None) -> Path:
    """The tiny-moe model (``shape``: preset fields to override) with each router pushed toward
    experts 0 and 1, saved with the corpus's tokenizer as a Hugging Face directory."""
    import dataclasses

    import torch

    from anneal.data.prepared_dir import PreparedDir
    from anneal.data.stream import PackedSplit
    from anneal.model import PRESETS, build_model, init_weights_

    meta = PreparedDir.of(data).meta()
    preset = dataclasses.replace(PRESETS["tiny-moe"], **(shape or {}))
    preset = preset.with_vocab(meta["vocab_size"])
    model = build_model(preset)
    init_weights_(model, std=preset.initializer_range, seed=0)
    train = PackedSplit(data, "train", seq_len=preset.seq_len)
    x, _ = train.batch(list(range(min(8, train.n_windows))))
    inputs = {}
    hooks = [
        layer.mlp.register_forward_pre_hook(
            lambda _m, args, i=i: inputs.__setitem__(i, args[0].detach())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(input_ids=x)
        for i, layer in enumerate(model.model.layers):
            mean = inputs[i].reshape(-1, preset.hidden_size).mean(0)
            push = skew * mean / mean.square().sum()  # logit + skew along the mean input
            layer.mlp.gate.weight[:2] += push
    for h in hooks:
        h.remove()
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        shutil.copyfile(data / name, out / name)
    return out


def train(model_dir: Path, out: Path, data: Path, *, coef: float, steps: int) -> list[dict]:
    """recipes/pretrain_moe_tiny.py from ``model_dir`` on one rank; its train rows."""
    cmd = [
        sys.executable,
        "recipes/pretrain_moe_tiny.py",
        *("--init-from", str(model_dir), "--out", str(out), "--data", str(data)),
        *("--max-steps", str(steps), "--val-every", "0", "--save-every", "0"),
        *("--set", f"model.moe_aux_loss_coef={coef}", "--set", "optim.global_batch_tokens=2048"),
        *("--set", "ds.train_micro_batch_size_per_gpu=8", "--set", "optim.lr=1e-3"),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return read_metrics(out, "train")


def summary(rows: list[dict], *, tail: int) -> dict:
    """Mean over layers of max/mean load: at step 1 and over the last ``tail`` steps."""
    per_step = [statistics.fmean(r["moe_max_mean"]) for r in rows]
    first, last = per_step[0], statistics.fmean(per_step[-tail:])
    return {"first": first, "last": last, "ratio": first / last, "curve": per_step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--skew", type=float, default=4.0)
    p.add_argument("--tail", type=int, default=10, help="steps averaged at the end")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--report", help="write the result here, as markdown")
    p.add_argument("--smoke", action="store_true", help="3 steps, one run, nothing kept")
    args = p.parse_args()
    steps, tail = (3, 1) if args.smoke else (args.steps, args.tail)
    coefs = COEFS[:1] if args.smoke else COEFS  # smoke: the same path once, for CI's time
    data = ensure_data(args.data)
    with tempfile.TemporaryDirectory(prefix="bench-moe-balance-") as tmp:
        model_dir = skewed_model(Path(tmp) / "hf", data, skew=args.skew)
        result = {
            coef: summary(
                train(model_dir, Path(tmp) / f"run{coef}", data, coef=coef, steps=steps), tail=tail
            )
            for coef in coefs
        }
    for coef, r in result.items():
        print(
            f"aux coef {coef}: max/mean load {r['first']:.3f} at step 1 -> {r['last']:.3f} over "
            f"the last {tail} steps (falls {r['ratio']:.2f}x)"
        )
    print(
        json.dumps(
            {
                "bench": "moe_balance",
                "steps": steps,
                "skew": args.skew,
                **{str(c): {k: v for k, v in r.items() if k != "curve"} for c, r in result.items()},
            }
        )
    )
    if args.report and not args.smoke:
        lines = [
            f"### The router is trained ({steps} steps from a router skewed by {args.skew:g})",
            "",
            f"`.venv/bin/python bench/bench_moe_balance.py --steps {steps} --skew {args.skew:g}`"
            f" on {machine_line()}:",
            "",
            f"| aux loss coefficient | max/mean at step 1 | last {tail} steps | falls by |",
            "|---|---|---|---|",
            *(
                f"| {c:g} | {r['first']:.3f} | {r['last']:.3f} | {r['ratio']:.2f}x |"
                for c, r in result.items()
            ),
        ]
        Path(args.report).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
