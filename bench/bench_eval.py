"""Downstream evaluation's speed: Anneal's in-loop evaluator (``anneal.eval.lm.EngineLM`` over
the training engine) against forward-only calls of the same engine on the same batch shapes, and
against lm-eval's own ``HFLM`` at its best batch size on the same weights saved as a Hugging Face
directory. All three score the shipped task ``anneal_next_line`` (built from the corpus's val
split) in one process, one after another, alternating ``--repeats`` times.

    python bench/bench_eval.py                          # the tiny preset, 2 repeats: ~3 minutes
    python bench/bench_eval.py --smoke                  # a few items, one repeat

(docs/benchmarks.md, "Downstream evaluation".)

- evaluator: ``anneal.eval.score.score`` of the task with ``EngineLM`` at ``--batch-size`` rows
  per forward call: the real (unpadded) tokens of its rows over the wall time of the whole
  scoring (tokenizing, batching, lm-eval's bookkeeping and metrics included);
- forward-only: the same engine called on random ids of exactly the shapes the evaluator's
  forward calls had (recorded by a forward pre-hook), all their padded tokens over the time of
  those calls alone: the most any evaluator could reach on those batches;
- HFLM: ``lm_eval.models.huggingface.HFLM`` on the saved weights (fp32, CPU), at each of
  ``--hf-batch-sizes``, the same real tokens over its wall time; the best is reported.

The issue's goal: evaluator >= 0.8 x forward-only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY = REPO / "recipes" / "pretrain_tiny.py"


def build(data: Path, *, micro_batch: int):
    """The tiny recipe's engine on ``data`` in this process (a world of one), as training
    builds it (ZeRO-2: with one rank ZeRO-3 would only partition over itself, and its module
    would hold no whole weight to save for HFLM)."""
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.dist import init_distributed, world_of_one_env
    from anneal.resolution.resolve import resolve_launch
    from anneal.train.engine import build_engine

    os.environ.update(world_of_one_env())
    init_distributed(600)
    args = ["--data", str(data), "--out", str(Path(tempfile.mkdtemp()) / "run")]
    args += ["--ds-config", "zero2_bf16.json"]  # whole weights in the module, to save for HFLM
    args += ["--set", f"ds.train_micro_batch_size_per_gpu={micro_batch}"]
    cfg, overrides = config_from_args(args, prog=str(TINY), on_cpu=True, **load_recipe(TINY))
    launch = resolve_launch(cfg, overrides, world_size=1, device_type="cpu")
    return launch, build_engine(launch)


def evaluator(engine, loaded, data: Path, *, batch_size: int, seq_len: int, limit):
    """(scoring document, the shapes of its forward calls)."""
    from anneal.eval.lm import EngineLM
    from anneal.eval.score import score

    shapes = []
    hook = engine.module.register_forward_pre_hook(
        lambda _m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    try:
        lm = EngineLM(engine, data, replica=(0, 1), batch_size=batch_size, max_length=seq_len)
        doc = score(lm, loaded, step=0, tokens=0, limit=limit, num_fewshot=None, source="loop")
    finally:
        hook.remove()
    return doc, shapes


def forward_only(engine, shapes: list[tuple[int, int]], vocab: int) -> float:
    """Padded tokens per second of the engine's forward on random ids of ``shapes``."""
    import torch

    batches = [torch.randint(0, vocab, shape) for shape in shapes]
    engine.eval()
    start = time.perf_counter()
    with torch.no_grad():
        for x in batches:
            engine(input_ids=x)
    seconds = time.perf_counter() - start
    engine.train()
    return sum(b * t for b, t in shapes) / seconds


def hflm(model_dir: Path, task_name: str, loaded, *, batch_size: int, limit) -> tuple[float, dict]:
    """(wall seconds, lm-eval's results for the task) of HFLM at ``batch_size``."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(model_dir), batch_size=batch_size, device="cpu", dtype="float32")
    start = time.perf_counter()
    out = evaluate(
        lm,
        {"tasks": {task_name: loaded.tasks[task_name]}, "groups": {}, "group_map": {}},
        limit=limit,
    )
    return time.perf_counter() - start, out["results"][task_name]


def save_hf(engine, data: Path, out: Path) -> Path:
    """The engine's weights as a Hugging Face directory with the corpus's tokenizer files."""
    out.mkdir(parents=True)
    engine.module.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (data / name).is_file():
            shutil.copy(data / name, out / name)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--hf-batch-sizes", default="1,8,16,64")
    parser.add_argument("--limit", type=int, default=0, help="items of the task; 0: all")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--report", help="write a markdown fragment of the results here")
    args = parser.parse_args()
    if args.smoke:
        args.limit, args.repeats, args.hf_batch_sizes = 8, 1, "8"
    limit = args.limit or None

    from anneal.eval.tasks import SHIPPED, load_tasks

    data = Path(args.data).resolve()
    work = Path(tempfile.mkdtemp(prefix="bench_eval-"))
    launch, engine = build(data, micro_batch=args.batch_size)
    loaded = load_tasks(
        [SHIPPED], data_dir=data, work_dir=work / "tasks", num_fewshot=None, limit=limit
    )
    if SHIPPED not in loaded.tasks:
        raise SystemExit(f"bench_eval: {SHIPPED} did not load: {loaded.failed}")
    model_dir = save_hf(engine, data, work / "hf")
    sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    rows = {"evaluator": [], "forward_only": [], **{f"hflm_bs{b}": [] for b in sizes}}
    accuracy = {}
    for _ in range(args.repeats):
        doc, shapes = evaluator(
            engine, loaded, data, batch_size=args.batch_size, seq_len=launch.seq_len, limit=limit
        )
        real = doc["tokens_scored"]
        rows["evaluator"].append(real / doc["seconds"])
        rows["forward_only"].append(forward_only(engine, shapes, launch.preset.vocab_size))
        accuracy["evaluator"] = doc["tasks"][SHIPPED]["metrics"]
        for b in sizes:
            seconds, results = hflm(model_dir, SHIPPED, loaded, batch_size=b, limit=limit)
            rows[f"hflm_bs{b}"].append(real / seconds)
            accuracy[f"hflm_bs{b}"] = {k: v for k, v in results.items() if k.startswith("acc")}
    best = {k: max(v) for k, v in rows.items()}
    hf_best = max((k for k in best if k.startswith("hflm")), key=best.__getitem__)
    result = {
        "bench": "eval",
        "task": SHIPPED,
        "items": doc["tasks"][SHIPPED]["n_samples"],
        "tokens_scored": real,
        "forward_calls": len(shapes),
        "tokens_per_s": {k: round(v) for k, v in best.items()},
        "evaluator_over_forward_only": round(best["evaluator"] / best["forward_only"], 3),
        "evaluator_over_best_hflm": round(best["evaluator"] / best[hf_best], 3),
        "best_hflm": hf_best,
        "accuracy": accuracy,
    }
    print(json.dumps(result))
    if args.report:
        Path(args.report).write_text(report(result, args))
    import deepspeed.comm

    deepspeed.comm.destroy_process_group()
    return 0


def report(r: dict, args) -> str:
    lines = [
        "### Downstream evaluation (`bench/bench_eval.py`)",
        "",
        f"`python bench/bench_eval.py --batch-size {args.batch_size} --hf-batch-sizes "
        f"{args.hf_batch_sizes} --repeats {args.repeats}`: the tiny preset (untrained), "
        f"{r['task']}, {r['items']} items, {r['tokens_scored']:,} real tokens in "
        f"{r['forward_calls']} forward calls; best of {args.repeats}.",
        "",
        "| side | tokens/s |",
        "|---|---:|",
        *(f"| {k} | {v:,} |" for k, v in r["tokens_per_s"].items()),
        "",
        f"evaluator / forward-only {r['evaluator_over_forward_only']}, evaluator / "
        f"{r['best_hflm']} {r['evaluator_over_best_hflm']}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
