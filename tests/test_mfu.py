"""The peak FLOP/s behind MFU (anneal/hardware.py): GPU names map to the right dense bf16 peak
(variants such as the H100 PCIe before the SXM family), unknown short names are clear errors,
and the CPU peak is measured once and then read from its cache. The MFU of real runs is checked
in tests/test_scaling_sweep.py."""

from __future__ import annotations

import json
import os
import platform

import pytest
import torch

from anneal import hardware
from anneal.errors import UserError


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
    first = hardware._cpu_peak_flops(tmp_path)
    cache = tmp_path / "cpu_peak_flops.json"
    stored = json.loads(cache.read_text())
    key = f"{platform.processor() or platform.machine()}-{os.cpu_count()}-{torch.get_num_threads()}"
    assert stored == {key: first} and first > 1e8
    cache.write_text(json.dumps({key: 123.0}))  # a second call must read, not measure
    assert hardware._cpu_peak_flops(tmp_path) == 123.0
