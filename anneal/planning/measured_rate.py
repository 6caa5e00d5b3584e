"""The training rate this machine reached for a run's shape, kept from run to run, so that the
next forecast of the same shape on a CPU uses it instead of an assumed MFU.

A CPU's MFU depends on the shape far more than a GPU's does (small matmuls, framework overhead,
threads shared with other work): issue 46 measured 2-20% where 45% was assumed, so a forecast
was off 5x either way. After its first steps a run on a CPU writes what it measured (FLOP/s of
one process, the median of its steps after the first) to ``$XDG_CACHE_HOME/anneal/`` under its
shape (``shape_key``); ``python -m launcher run --device cpu`` without ``--mfu`` forecasts the
same shape at that rate and says where it comes from. A rate, not an MFU, is kept: the CPU's
peak is measured again at each launch, and a busy machine's would move an MFU.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from anneal.files import write_atomic
from anneal.hardware import cache_dir
from anneal.json_values import is_finite_number

RATE_FILE = "measured_rate.json"
MIN_STEPS = 3
"""Train rows a run needs (the first, which warms up, left out) before its rate is kept."""


def cache_file() -> Path:
    """Where the rates are kept: beside the CPU's peak (``anneal.hardware.cache_dir``)."""
    return cache_dir() / RATE_FILE


def shape_key(launch) -> str:
    """What the rate of a run depends on, besides the machine: the device, the ranks, the
    model's shape, the sequence, the micro-batch, the ZeRO stage, the precision, activation
    checkpointing, and ``train.float8`` and ``train.compile`` where on (float8 ran about 5x
    slower on this CPU; a key without them is the one runs kept before they existed)
    (``launch``: ``anneal.resolution.resolve.Launch``)."""
    p = launch.preset
    model = (
        f"h{p.hidden_size}-l{p.num_hidden_layers}-i{p.intermediate_size}-a{p.num_attention_heads}"
        f"-v{p.vocab_size}"
    )
    train = launch.cfg.train
    return (
        f"{launch.device_type}|ranks{launch.world_size}|{model}|seq{launch.seq_len}|micro"
        f"{launch.micro_batch}|zero{launch.zero_stage}|{'bf16' if launch.bf16 else 'fp32'}|ac"
        f"{int(bool(launch.cfg.model.activation_checkpointing))}"
        + (f"|float8-{train.float8}" if train.float8 != "off" else "")
        + (f"|compile-{train.compile}" if train.compile != "off" else "")
    )


def rate_of(train_rows: list[dict], *, flops_per_token: float, world_size: int) -> float | None:
    """FLOP/s of one process over ``train_rows`` (the median after the first); None when
    fewer than ``MIN_STEPS`` rows follow the first."""
    tput = [r["tokens_per_s"] for r in train_rows[1:] if is_finite_number(r.get("tokens_per_s"))]
    if len(tput) < MIN_STEPS:
        return None
    return statistics.median(tput) * flops_per_token / world_size


def remember(key: str, flops_per_s: float, *, run_dir: Path) -> None:
    """Keep ``flops_per_s`` for ``key`` (the newest run of a shape replaces the older); a cache
    that cannot be written is left as it is (the forecast then assumes its MFU, as before)."""
    path = cache_file()
    known = _read(path)
    known[key] = {"flops_per_s": flops_per_s, "run": str(run_dir), "unix": int(time.time())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(known, indent=1, sort_keys=True))
    except OSError:
        pass


def recall(key: str) -> tuple[float, str] | None:
    """(FLOP/s of one process, where it was measured) for ``key``, or None."""
    entry = _read(cache_file()).get(key)
    if not isinstance(entry, dict) or not is_finite_number(entry.get("flops_per_s")):
        return None
    if entry["flops_per_s"] <= 0:
        return None
    return float(entry["flops_per_s"]), str(entry.get("run", "an earlier run"))


def _read(path: Path) -> dict:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}
