"""Peak memory per rank while ``--init-from`` loads a Hugging Face checkpoint
(``anneal.hf.load_weights``), ZeRO-3 against each rank holding its own copy (ZeRO-0/1/2).

The parent writes a Llama checkpoint with ``save_pretrained`` (fp32 safetensors; --hidden and
--layers set its size), then starts ``deepspeed --num_gpus N`` on this file twice (stage 3 and
stage 1). Each rank builds the model as the engine does (under ``deepspeed.zero.Init`` for
ZeRO-3), resets its peak resident set (``/proc/self/clear_refs``), loads the weights and reports
its resident set before, the peak during and after the load (VmRSS, VmHWM), beside the model's
fp32 size and its largest tensor. CPU only; DeepSpeed's engine (optimizer states) is not built,
so the figures are the load's own.

python bench/bench_init_from.py --hidden 1024 --layers 8 --ranks 2
python bench/bench_init_from.py --smoke      (CI: a micro model, hidden 128, 2 layers, vocab
                                             1,000: that the script runs; the figures mean nothing)

--smoke also forks each launch's ranks from tests/scripts/ranks.py instead of starting them
through the deepspeed runner (``train_run.RANKS_SCRIPT``): the same ranks and loads, without the
runner's two interpreters that import torch and DeepSpeed first (the forked ranks share their
imported pages, so the figures would mean nothing there either).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 2**30


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def make_checkpoint(out: Path, *, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out))
    return out


def rank_main(directory: Path, stage: int) -> None:
    """One rank: build as the engine does, load, report memory (rank order by all_gather)."""
    import deepspeed
    import torch

    from anneal.config.run import ModelConfig
    from anneal.dist import all_gather, init_distributed, rank, shutdown
    from anneal.hf.load import pretrained_preset, read_hf_config
    from anneal.hf.load_weights import load_pretrained_
    from anneal.model import build_model, hf_model_config, model_class

    init_distributed(600)
    doc = read_hf_config(directory)
    preset = pretrained_preset(directory, data_vocab=doc["vocab_size"], model=ModelConfig())
    gather = None
    if stage == 3:
        model_class(hf_model_config(preset))
        ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = build_model(preset)
        gather = lambda ps: deepspeed.zero.GatheredParameters(ps, modifier_rank=0)  # noqa: E731
    else:
        model = build_model(preset)
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    counts = load_pretrained_(model, directory, gather=gather)
    row = {
        "rank": rank(),
        "rss_before_gib": before / GIB,
        "peak_gib": _status("VmHWM") / GIB,
        "rss_after_gib": _status("VmRSS") / GIB,
        "bytes_read_gib": counts["bytes_read"] / GIB,
    }
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the allocator kept but nothing holds
    row["rss_trimmed_gib"] = _status("VmRSS") / GIB
    largest = max(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    rows = all_gather(row)
    if rank() == 0:
        elements = counts["elements"]
        print(
            "RESULT "
            + json.dumps(
                {
                    "stage": stage,
                    "model_gib": elements * 4 / GIB,
                    "largest_tensor_gib": largest * 4 / GIB,
                    "ranks": rows,
                }
            )
        )
    torch.distributed.barrier()
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a micro model: the script runs (CI)")
    p.add_argument("--rank-of", nargs=2, metavar=("DIR", "STAGE"), help=argparse.SUPPRESS)
    args, _ = p.parse_known_args()
    if args.smoke:  # it loaded the full 0.63 GiB model before: 77 s of CPU of CI's smoke run
        args.hidden, args.layers, args.vocab = 128, 2, 1000
    if args.rank_of:
        return rank_main(Path(args.rank_of[0]), int(args.rank_of[1]))
    from train_run import RANKS_SCRIPT  # bench/, the script's folder

    from anneal.dist import free_port

    with tempfile.TemporaryDirectory(prefix="anneal-init-from-") as tmp:
        directory = make_checkpoint(
            Path(tmp) / "model", hidden=args.hidden, layers=args.layers, vocab=args.vocab
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        for stage in (3, 1):
            runner = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(args.ranks)]
            # not 29500: another run on this host may hold it
            runner += ["--master_port", str(free_port())]
            forked = [sys.executable, str(RANKS_SCRIPT), str(args.ranks)]
            cmd = [*(forked if args.smoke else runner), __file__]
            cmd += ["--rank-of", str(directory), str(stage)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            result = json.loads(
                next(x for x in out.splitlines() if "RESULT " in x).split(" ", 1)[1]
            )
            print(format_result(result))


def format_result(r: dict) -> str:
    lines = [
        f"ZeRO-{r['stage']}: model {r['model_gib']:.3f} GiB fp32, largest tensor "
        f"{r['largest_tensor_gib']:.3f} GiB"
    ]
    for row in sorted(r["ranks"], key=lambda x: x["rank"]):
        grew = row["peak_gib"] - row["rss_before_gib"]
        lines.append(
            f"  rank {row['rank']}: RSS {row['rss_before_gib']:.3f} GiB before, peak "
            f"{row['peak_gib']:.3f} GiB during the load (+{grew:.3f}), "
            f"{row['rss_after_gib']:.3f} after ({row['rss_trimmed_gib']:.3f} after malloc_trim); "
            f"read {row['bytes_read_gib']:.3f} GiB"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
