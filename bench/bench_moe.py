"""Mixture of Experts throughput: Anneal's sparse step against a bare DeepSpeed AutoEP engine
running the same loop, and against the dense step at equal active parameters, in one run
(docs/benchmarks.md, "Mixture of Experts").

This is ``bench_train.py --bare --models tiny-moe`` with its own defaults. Per ZeRO stage (1 and
2; ZeRO-3, which sparse models train at too, is not benchmarked here) and rank count, three runs
back to back: the bare engine (``reference.py --engine deepspeed``: the same Qwen3-MoE model and
init, batches, torch AdamW, clip, stage and ``expert_parallel`` section, the same objective: the
language-model loss + ``aux_loss_coef`` x the load-balancing loss + ``z_loss_coef`` x the router
z-loss), the recipe (``recipes/pretrain_moe_tiny.py``), and the dense twin (the tiny preset: the
same attention, one SwiGLU of 688 against 8 experts of 344, 2 a token) in the same recipe. On N
ranks the sparse runs are expert-parallel N (``autoep_size`` N); the dense twin is data-parallel
N. The order within a triple reverses every other round, and the triples rotate.

    .venv/bin/python bench/bench_moe.py [--ranks 1,2] [--repeats 2] [--steps 8] [--report F]
    .venv/bin/python bench/bench_moe.py --smoke     (CI: 3 steps at ZeRO-2 on 2 ranks, no
                                                     figures kept; the triple's ranks forked
                                                     from tests/scripts/ranks.py, as
                                                     bench_train.py --smoke starts them)

Every option of bench_train.py applies (``--stages 2``, ``--bare-zero shipped``, ...).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if "--smoke" in args and "--ranks" not in args:
        args = [*args, "--ranks", "2"]  # expert parallel; bench_train's own smoke runs 1 rank
    bench_train.main(["--bare", "--models", "tiny-moe", *args], bench_name="moe")


if __name__ == "__main__":
    main()
