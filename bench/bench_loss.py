"""The chunked loss (``train.loss=chunked``, ``anneal/train/loss.py``) against the plain one
over the full logits, and the other memory-light candidates, on CPU: the loss's peak memory
and the training step's time, for a micro model with a 32k vocabulary at 4096 tokens.

    python bench/bench_loss.py            # body,plain,chunked,chunked:1024: about 7 minutes
    python bench/bench_loss.py --arms torch,checkpointed,ds-vocab-parallel,ds-tiled \
        --rounds 1 --steps 1                                             # about 3 minutes
    python bench/bench_loss.py --seq 256 --rounds 1 --steps 1   # short: under a minute
    python bench/bench_loss.py --smoke    # CI: seq 256, vocab 4096, one round of one step, the
                                          # arms one after the other in one child process

(docs/benchmarks.md, "The chunked loss": times on 2 shared cores.)

Each arm runs in a fresh process on one thread (under ``--smoke`` the arms share one, whose peak
RSS is then the largest arm's so far: its figures are not kept): it builds the same micro Llama
(seed 0, fp32, SDPA), takes one warm-up step, then ``--steps`` timed training steps (forward,
loss, backward, torch AdamW, zero grads) on one sequence of ``--seq`` random tokens, and reports
the median step time and its peak RSS (``getrusage``: large tensors are mmapped and unmapped
when freed, so the peak RSS follows the peak of live tensors). The loss's memory is an arm's
peak RSS minus that of the ``body`` arm, whose loss is the mean square of the last hidden states
(the same model without its head's matmul; the head weight still gets a zero gradient and its
AdamW state, so the baseline holds every parameter's gradient and state as the other arms do).
Rounds run the arms in alternating order; medians over the rounds are reported with the range of
the single rounds.

The arms: ``plain`` (the model's (T, V) logits, then ``F.cross_entropy``: Anneal's
``train.loss=plain``), ``chunked`` (Anneal's default: the head's matmul and the cross-entropy
``--chunk`` tokens at a time, gradients computed in forward; ``chunked:N`` for N tokens a
chunk), ``torch`` (torch's
``F.linear_cross_entropy`` with ``LinearCrossEntropyOptions()``), ``checkpointed`` (torchtitan's
way: each chunk under ``torch.utils.checkpoint``, so backward recomputes its logits),
``ds-vocab-parallel`` (DeepSpeed's ``vocab_parallel_linear_cross_entropy``, no TP group) and
``ds-tiled`` (DeepSpeed's ``TiledFusedLogitsLoss``). Every arm's loss is checked against the
plain one (1e-5 relative).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ARMS = ("body", "plain", "chunked", "torch", "checkpointed", "ds-vocab-parallel", "ds-tiled")
DEFAULT_ARMS = "body,plain,chunked,chunked:1024"
SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4)
"""The micro model: the ``tiny`` preset's width, two layers."""


def build(vocab: int, seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=seq, use_cache=False, **SHAPE)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).float()


def loss_fn(arm: str, model, chunk: int):
    """``fn(x, y) -> loss`` for one arm."""
    import torch
    import torch.nn.functional as F

    from anneal.train import loss as losslib

    head = model.lm_head

    def hidden(x):
        return model.model(input_ids=x).last_hidden_state.reshape(-1, head.in_features)

    if arm == "body":  # the head's weight still gets a (zero) gradient and AdamW state
        return lambda x, y: hidden(x).square().mean() + 0.0 * head.weight.sum()
    if arm == "plain":
        return lambda x, y: losslib.next_token_loss(model(input_ids=x).logits, y)
    if arm.startswith("chunked"):  # chunked:N: N tokens a chunk
        assert losslib.install(model, chunk_tokens=int(arm.partition(":")[2] or chunk))

        def chunked(x, y):
            with losslib.targets(model, y):
                return losslib.next_token_loss(model(input_ids=x).logits, y)

        return chunked
    if arm == "torch":
        options = torch.nn.LinearCrossEntropyOptions()
        return lambda x, y: F.linear_cross_entropy(
            hidden(x), head.weight, y.reshape(-1), options=options
        )
    if arm == "checkpointed":
        from torch.utils.checkpoint import checkpoint

        def piece(h, t):
            return F.cross_entropy(head(h).float(), t, reduction="sum")

        def checkpointed(x, y):
            h, t = hidden(x), y.reshape(-1)
            parts = [
                checkpoint(piece, h[s : s + chunk], t[s : s + chunk], use_reentrant=False)
                for s in range(0, t.numel(), chunk)
            ]
            return torch.stack(parts).sum() / t.numel()

        return checkpointed
    if arm == "ds-vocab-parallel":
        from deepspeed.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy

        return lambda x, y: vocab_parallel_linear_cross_entropy(
            hidden(x), head.weight, y.reshape(-1), chunk_size=chunk
        )
    if arm == "ds-tiled":
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        def piece(self, h, t):
            return F.cross_entropy(self.lm_head(h).float().reshape(-1, head.out_features), t)

        def tiled(x, y):
            h = model.model(input_ids=x).last_hidden_state  # (B, T, H): sharded along T
            shards = max(1, y.numel() // chunk)
            return TiledFusedLogitsLoss.apply(
                piece, model, h, y, None, shards, [head.weight], "mean"
            )

        return tiled
    raise SystemExit(f"unknown arm {arm!r}: one of {', '.join(ARMS)} (chunked:N for a chunk size)")


def run_arm(arm: str, *, vocab: int, seq: int, steps: int, chunk: int) -> dict:
    """One arm in this process (a fresh one but under ``--smoke``): its median step time and
    peak RSS."""
    import torch

    torch.set_num_threads(1)
    model = build(vocab, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (1, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    fn = loss_fn(arm, model, chunk)
    times, first = [], None
    for i in range(steps + 1):
        t0 = time.perf_counter()
        loss = fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i == 0:
            first = loss.item()
        else:
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"arm": arm, "step_s": statistics.median(times), "peak_rss": peak, "loss": first}


def child(arms: list[str], args) -> list[dict]:
    """``arms`` run one after the other in one fresh process (one arm a process, but under
    ``--smoke``), each arm's result in order."""
    cmd = [sys.executable, __file__, "--child", ",".join(arms), *_shape_flags(args)]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"arm(s) {', '.join(arms)} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(arms) :]]


def _shape_flags(args) -> list[str]:
    return [
        f"--vocab={args.vocab}",
        f"--seq={args.seq}",
        f"--steps={args.steps}",
        f"--chunk={args.chunk}",
    ]


def summarize(rounds: list[list[dict]], arms: list[str]) -> dict:
    """Per arm: median step time and loss memory over rounds, with their ranges; the ratios
    to plain per round (memory: plain / arm; time: arm / plain), medians and ranges."""
    out = {}
    for arm in arms:
        rows = [next(r for r in rnd if r["arm"] == arm) for rnd in rounds]
        body = [next(r for r in rnd if r["arm"] == "body")["peak_rss"] for rnd in rounds]
        plain = [next(r for r in rnd if r["arm"] == "plain") for rnd in rounds]
        mem = [r["peak_rss"] - b for r, b in zip(rows, body, strict=True)]
        entry = {
            "step_s": statistics.median(r["step_s"] for r in rows),
            "step_s_range": [min(r["step_s"] for r in rows), max(r["step_s"] for r in rows)],
            "loss_mib": statistics.median(mem) / 2**20,
            "loss_mib_range": [min(mem) / 2**20, max(mem) / 2**20],
            "loss_value": rows[0]["loss"],
        }
        if arm not in ("body", "plain"):
            time_ratio = [r["step_s"] / p["step_s"] for r, p in zip(rows, plain, strict=True)]
            mem_ratio = [  # inf: the arm's peak was within the baseline's
                (p["peak_rss"] - b) / m if m > 0 else math.inf
                for p, b, m in zip(plain, body, mem, strict=True)
            ]
            entry |= {
                "time_vs_plain": statistics.median(time_ratio),
                "time_vs_plain_range": [min(time_ratio), max(time_ratio)],
                "memory_fall": statistics.median(mem_ratio),
                "memory_fall_range": [min(mem_ratio), max(mem_ratio)],
                "loss_rel_to_plain": abs(rows[0]["loss"] - plain[0]["loss"]) / plain[0]["loss"],
            }
        out[arm] = entry
    return out


def table(summary: dict) -> str:
    lines = [
        "| arm | step (s), median [range] | x plain's time | loss memory (MiB) | plain / arm |",
        "|---|---|---|---|---|",
    ]
    for arm, e in summary.items():
        lo, hi = e["step_s_range"]
        t = (
            f"{e['time_vs_plain']:.3f} [{e['time_vs_plain_range'][0]:.3f}-"
            f"{e['time_vs_plain_range'][1]:.3f}]"
            if "time_vs_plain" in e
            else ""
        )
        m = (
            f"{e['memory_fall']:.1f}x [{e['memory_fall_range'][0]:.1f}-"
            f"{e['memory_fall_range'][1]:.1f}]"
            if "memory_fall" in e
            else ""
        )
        mem = "0 (the baseline)" if arm == "body" else f"{e['loss_mib']:.0f}"
        lines.append(f"| {arm} | {e['step_s']:.3f} [{lo:.3f}-{hi:.3f}] | {t} | {mem} | {m} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=DEFAULT_ARMS, help="comma-separated; body and plain always")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm and round")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512, help="tokens per chunk (chunked arms)")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--report", help="write a markdown fragment for docs/benchmarks.md here")
    p.add_argument(
        "--smoke", action="store_true", help="seq 256, vocab 4096, one round of one step"
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        for arm in args.child.split(","):
            res = run_arm(arm, vocab=args.vocab, seq=args.seq, steps=args.steps, chunk=args.chunk)
            print(json.dumps(res), flush=True)
        return 0
    if args.smoke:
        args.seq, args.vocab, args.rounds, args.steps, args.chunk = 256, 4096, 1, 1, 64
    arms = ["body", "plain", *[a for a in args.arms.split(",") if a not in ("body", "plain")]]
    rounds = []
    for i in range(args.rounds):
        order = arms if i % 2 == 0 else arms[::-1]
        # --smoke: every arm in one process (one import of torch; its figures are not kept)
        rounds.append(
            child(order, args) if args.smoke else [r for a in order for r in child([a], args)]
        )
        print(f"round {i + 1}: " + ", ".join(f"{r['arm']} {r['step_s']:.3f} s" for r in rounds[-1]))
    summary = summarize(rounds, arms)
    for arm, e in summary.items():
        if "loss_rel_to_plain" in e and e["loss_rel_to_plain"] > 1e-5:
            raise SystemExit(f"arm {arm}: loss {e['loss_value']} is not plain's")
    import torch

    doc = {
        "command": "python bench/bench_loss.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {_cpu_name()}, 1 thread",
        "versions": {"torch": torch.__version__, **_versions()},
        "shape": {**SHAPE, "vocab": args.vocab, "seq": args.seq, "chunk": args.chunk},
        "rounds": rounds,
        "summary": summary,
    }
    print(table(summary))
    print(json.dumps({k: v for k, v in doc.items() if k != "rounds"}))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.report:
        Path(args.report).write_text(
            f"### The chunked loss (`bench/bench_loss.py`, {doc['date']})\n\n"
            f"`{doc['command']}`; {doc['machine']}; shape {doc['shape']}.\n\n"
            f"{table(summary)}\n"
        )
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _versions() -> dict:
    import deepspeed
    import transformers

    return {"transformers": transformers.__version__, "deepspeed": deepspeed.__version__}


if __name__ == "__main__":
    raise SystemExit(main())
