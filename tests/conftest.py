"""Shared fixtures: a prepared stdlib corpus and helpers that launch real training processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory) -> Path:
    """The embedded corpus, prepared once per test session (about 7 s)."""
    from anneal.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(inputs=["stdlib"], out=out, vocab_size=8192)
    return out


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("RANK", None)
    e["PYTHONPATH"] = str(ROOT)
    return e


def run_recipe(
    args: list[str],
    *,
    ranks: int = 1,
    recipe: str = "recipes/pretrain_tiny.py",
    timeout_s: int = 600,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Train through the recipe: plain python for one rank, the deepspeed runner otherwise."""
    if ranks == 1:
        cmd = [sys.executable, recipe, *args]
    else:
        cmd = [
            str(BIN / "deepspeed"),
            "--num_gpus",
            str(ranks),
            "--master_port",
            str(free_port()),
            recipe,
            *args,
        ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout_s
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def read_metrics(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    return [r for r in rows if r["kind"] == kind]


# Small shapes so that end-to-end runs take seconds of compute on CPU.
SMALL = [
    "--set",
    "model.hidden_size=64",
    "--set",
    "model.num_hidden_layers=2",
    "--set",
    "model.intermediate_size=176",
    "--set",
    "model.num_attention_heads=4",
    "--set",
    "model.seq_len=64",
    "--set",
    "train.eval_samples=16",
    "--set",
    "ds.scheduler.params.warmup_num_steps=2",
    "--set",
    "train.log_every=1",
]
