"""Launched by tests/eval/test_eval_lm.py under `deepspeed --num_gpus 2`: downstream scoring in
lockstep.

Builds Anneal's real engine (the tiny preset at the test's small shapes, ZeRO-3 over both ranks,
freshly initialised from one seed) and scores the local tasks under argv[2] twice with
``EngineLM``: split over the two data-parallel replicas (``data_replica``), then with each rank
scoring every row itself (replica (0, 1)), the reference. Each rank writes argv[1] + ".<rank>":
how many times the model's forward ran (a hook on the module, not the adapter's counter) in the
split scoring, and both documents with their per-request samples.

argv: OUT_PREFIX TASK_DIR DATA_DIR RUN_DIR [overrides...]
"""

import dataclasses
import json
import sys
from pathlib import Path

from anneal.config.run import ModelConfig, RunConfig, TrainConfig
from anneal.config.run_checks import apply_overrides
from anneal.dist import init_distributed, rank, shutdown
from anneal.eval.lm import EngineLM
from anneal.eval.score import score
from anneal.eval.tasks import load_tasks
from anneal.train import build_engine, resolve_run
from anneal.train.engine import data_replica

LIMIT = 5  # per task: odd, so that one replica has no row in some last batch
BATCH_SIZE = 2


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out_prefix, task_dir, data_dir, run_dir, *overrides = argv
    init_distributed()
    cfg = RunConfig(
        out=run_dir,
        ds_config="cpu.json",
        model=ModelConfig(preset="tiny"),
        train=TrainConfig(max_steps=10, seed=7),
    )
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=data_dir))
    cfg = apply_overrides(cfg, overrides)
    launch = resolve_run(cfg, overrides)
    engine = build_engine(launch)
    calls = [0]
    engine.module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    docs = {}
    for how, replica in (("split", data_replica(engine)), ("one_replica", (0, 1))):
        loaded = load_tasks(
            [task_dir], data_dir=None, work_dir=Path(run_dir), num_fewshot=None, limit=LIMIT
        )
        lm = EngineLM(
            engine, data_dir, replica=replica, batch_size=BATCH_SIZE, max_length=launch.seq_len
        )
        before = calls[0]
        kw = dict(step=0, tokens=None, limit=LIMIT, num_fewshot=None, source="loop")
        docs[how] = score(lm, loaded, samples=True, **kw)
        docs[how]["forward_calls"] = calls[0] - before
        docs[how]["adapter_calls"] = lm.forward_calls
        docs[how]["replica"] = list(replica)
    with open(f"{out_prefix}.{rank()}", "w") as f:
        json.dump(docs, f, default=str)


if __name__ == "__main__":
    main()
    shutdown()
