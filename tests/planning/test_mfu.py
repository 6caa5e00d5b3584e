"""The peak FLOP/s behind MFU (anneal/hardware.py): GPU names map to the right dense bf16 peak
(variants such as the H100 PCIe before the SXM family), unknown short names are clear errors,
and the CPU peak is measured once and then read from its cache, unless that cache is old, from
before its format held the time, or too small (measured on a busy machine: issue 33). MFU is
never over 1 in a row or on the console. The MFU of real runs is checked in
tests/planning/test_scaling_sweep.py."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from anneal import hardware
from anneal.errors import UserError
from anneal.observe.metrics import Mfu
from anneal.observe.progress import ProgressBar


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("Tesla V100-SXM2-16GB", 989e12),  # unknown: reported against the H100, with a warning
    ],
)
def test_gpu_names_map_to_dense_bf16_peaks(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert hardware.device_peak_flops(torch.device("cuda")) == peak


def test_short_gpu_names_and_memory():
    assert hardware.get_gpu("H100").peak_flops == 989e12
    assert hardware.get_gpu("h200").memory_bytes == 143771 * 2**20
    assert hardware.get_gpu("a100").peak_flops == 312e12
    with pytest.raises(UserError, match="--gpu mi300: unknown GPU; choose one of h100, h200"):
        hardware.get_gpu("mi300")


def test_cpu_peak_is_measured_once_then_cached(tmp_path):
    """The first call measures and caches the peak with the time; another process reads a
    fresh cached figure (here ten times the measured one, which the quick check cannot beat);
    this process keeps the figure it decided on, so the runs of one sweep share one peak."""
    first = hardware._cpu_peak_flops(tmp_path)
    cache = tmp_path / "cpu_peak_flops.json"
    stored = json.loads(cache.read_text())
    key = hardware._cpu_key()
    assert stored.keys() == {key} and stored[key]["flops"] == first and first > 1e8
    assert abs(stored[key]["measured_unix"] - time.time()) < 60
    stored[key]["flops"] = 10 * first
    cache.write_text(json.dumps(stored))  # another process must read, not measure
    assert hardware._cpu_peak_uncached(cache, key) == 10 * first
    assert hardware._cpu_peak_flops(tmp_path) == first  # this process: decided once


@pytest.mark.parametrize(
    "entry",
    [
        {"flops": 1e6, "measured_unix": "now"},  # too small: a 1024 matmul in 2,000 s
        {"flops": 1e15, "measured_unix": 0},  # measured in 1970: old
        1e15,  # the format before issue 33: a bare number, no time
        {"flops": "fast"},  # malformed
    ],
    ids=["too-small", "old", "bare-number", "malformed"],
)
def test_a_cached_cpu_peak_that_is_too_small_or_old_is_measured_again(tmp_path, entry):
    """Issue 33: a peak measured once on a busy machine (21 GFLOP/s against 65-118) was trusted
    forever, and CPU MFU read 146-198%. A cached figure that a quick check beats, one older than
    a week, a bare number of the old format or a malformed entry is measured again and the
    cache rewritten; another CPU's entry is kept."""
    if isinstance(entry, dict) and entry.get("measured_unix") == "now":
        entry = {**entry, "measured_unix": time.time()}
    cache = tmp_path / "cpu_peak_flops.json"
    cache.write_text(json.dumps({hardware._cpu_key(): entry, "other-cpu-1-1": 5.0}))
    peak = hardware._cpu_peak_flops(tmp_path)
    stored = json.loads(cache.read_text())
    assert 1e8 < peak < 1e15, peak
    assert stored[hardware._cpu_key()]["flops"] == peak and stored["other-cpu-1-1"] == 5.0


def test_mfu_is_never_over_one(caplog):
    """A step faster than the peak (the peak is too small) is logged and shown as 100%, with
    one warning; an ordinary step keeps its ratio. The console line caps a row of an older run
    (146%) too."""
    mfu = Mfu(flops_per_token=1e9, peak_flops=1e12, world_size=2)
    with caplog.at_level(logging.WARNING, logger="anneal.observe.metrics"):
        assert mfu(500.0) == pytest.approx(0.25)
        assert mfu(2920.0) == 1.0 and mfu(3960.0) == 1.0
    assert [r.getMessage()[:35] for r in caplog.records] == ["training ran at 146% of the peak FL"]
    row = {"step": 5, "loss": 3.0, "tokens_per_s": 2920.0, "mfu": 1.46}
    assert "mfu 100.00%" in ProgressBar(max_steps=10, interactive=False, enabled=False).line(row)
