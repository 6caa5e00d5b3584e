"""What the benchmarked python has: its versions, the device, its peak and whether SDPA's flash
kernel runs. A script run by the python under test (``python bench/gpu_probe.py``), so that it
answers for that interpreter and its PYTHONPATH, not for the driver's; it prints one JSON line.

``--quick`` answers only whether torch sees a CUDA GPU and which device it is, without importing
DeepSpeed and the rest: what ``make bench`` needs to say that there is nothing to measure here.

The driver side, ``probe()`` and ``ds_report()``, runs it and DeepSpeed's report in a child with
a timeout and turns any failure into a line of text.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()


def probe(python: str, env: dict, timeout_s: float = 120, *, quick: bool = False) -> dict:
    """This script's answer from ``python``, or ``{"error": ...}`` saying why there is none."""
    try:
        out = subprocess.run(
            [python, str(SCRIPT), *(["--quick"] if quick else [])],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"probe timed out after {timeout_s:.0f} s"}
    lines = out.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"error": f"probe failed (exit {out.returncode}): {out.stderr.strip()[-600:]}"}


def ds_report(python: str, env: dict, timeout_s: float = 90) -> str:
    try:
        out = subprocess.run(
            [python, "-c", "from deepspeed.env_report import cli_main; cli_main()"],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
        )
        return out.stdout + out.stderr
    except subprocess.TimeoutExpired:
        return f"ds_report timed out after {timeout_s:.0f} s\n"


# --- the script ----------------------------------------------------------------------------------


def _versions(info: dict) -> None:
    for mod in ("deepspeed", "transformers", "sentencepiece", "numpy", "flash_attn"):
        try:
            m = __import__(mod)
            info[mod] = f"{m.__version__} ({os.path.dirname(m.__file__)})"
        except Exception as e:
            info[mod] = f"missing ({type(e).__name__})"
    nvcc = shutil.which("nvcc")
    info["nvcc"] = nvcc
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        info["nvcc_version"] = out.strip().splitlines()[-1] if out.strip() else "?"
    info["cuda_home"] = os.environ.get("CUDA_HOME")


def _cuda_device(info: dict, torch) -> None:
    from anneal.hardware import device_peak_flops

    dev = torch.device("cuda", 0)
    info["device"] = torch.cuda.get_device_name(dev)
    info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    info["memory_gib"] = round(torch.cuda.get_device_properties(dev).total_memory / 2**30, 1)
    info["bf16"] = torch.cuda.is_bf16_supported()
    info["peak_flops"] = device_peak_flops(dev)
    try:  # the kernel SDPA picks for the model's shapes: causal bf16, head dim 128
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(1, 16, 2048, 128, device=dev, dtype=torch.bfloat16)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.cuda.synchronize()
        info["sdpa_flash"] = True
    except Exception as e:
        info["sdpa_flash"] = f"no ({type(e).__name__}: {e})"[:200]


def main(argv: list[str]) -> None:
    quick = argv == ["--quick"]
    if str(REPO) not in sys.path:  # anneal.hardware, from this checkout
        sys.path.insert(0, str(REPO))
    info = {"python": sys.version.split()[0], "executable": sys.executable}
    import torch

    info["torch"] = torch.__version__
    info["cuda_available"] = torch.cuda.is_available()
    info["torch_cuda"] = torch.version.cuda
    if not quick:
        _versions(info)
    if torch.cuda.is_available() and quick:
        info["device"] = torch.cuda.get_device_name(0)
    elif torch.cuda.is_available():
        _cuda_device(info, torch)
    else:
        info["device"] = (
            f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        )
    print(json.dumps(info))


if __name__ == "__main__":
    main(sys.argv[1:])
