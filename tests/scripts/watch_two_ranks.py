"""Launched by tests/eval/test_eval_watch.py as two processes of one gloo group: the watcher on two
ranks. Each rank scores through a collective (an all-gather of the step, standing for the
engine's forward calls), rank 0 writes the document, and each rank appends the steps it scored
to OUT.<rank>. argv[3] "signal": rank 1 (only) sends itself SIGUSR1 while the first checkpoint is
scored, so that both ranks must stop after it. Exit: 75 when preempted, else 0.

argv: RUN_DIR OUT_PREFIX [signal]
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from anneal.dist import all_gather, is_main_process, rank
from anneal.eval import results, watch


def main() -> int:
    run, out = Path(sys.argv[1]), Path(sys.argv[2])
    signal_rank_1 = sys.argv[3:] == ["signal"]
    dist.init_process_group("gloo")

    def score(tag_dir: Path) -> None:
        manifest = json.loads((tag_dir / "manifest.json").read_text())
        steps = all_gather(manifest["step"])  # every rank scores the same tag, in step
        assert len(set(steps)) == 1, steps
        if signal_rank_1 and rank() == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        with open(f"{out}.{rank()}", "a") as f:
            f.write(f"{manifest['step']}\n")
        if is_main_process():
            results.write(run, {"step": manifest["step"], "tasks": {}, "failed": {}})

    stop = watch.Stop(run)
    try:
        result = watch.Watcher(run, score, poll_s=0.2).run(stop)
    finally:
        stop.close()
    dist.destroy_process_group()
    return 75 if result == "preempted" else 0


if __name__ == "__main__":
    sys.exit(main())
