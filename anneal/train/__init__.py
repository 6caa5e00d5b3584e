"""Training: the Trainer and its loop (``trainer``), a rank's way in (``entry``: checks, engine,
checkpoint, then the Trainer), building the engine (``engine``: the one call of
``deepspeed.initialize``), one optimizer step and the loss on held-out windows
(``step``), and what watches a run (``observers``). Recipes call ``run(cfg)``."""

from anneal.train.engine import build_engine, resolve_run, setup_process
from anneal.train.entry import run
from anneal.train.loss import next_token_loss
from anneal.train.observers import ExportAfterSave, Observer
from anneal.train.step import StepShape, TrainState, train_step, validate
from anneal.train.trainer import Trainer

__all__ = [
    "ExportAfterSave",
    "Observer",
    "StepShape",
    "TrainState",
    "Trainer",
    "build_engine",
    "next_token_loss",
    "resolve_run",
    "run",
    "setup_process",
    "train_step",
    "validate",
]
