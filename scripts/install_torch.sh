#!/usr/bin/env bash
# Install torch into the venv: the CPU build where no NVIDIA GPU is present (never the
# multi-GB CUDA build), the normal PyPI (CUDA) build where one is.
# Usage: scripts/install_torch.sh VENV_PYTHON TORCH_VERSION
set -euo pipefail
py=$1
version=$2
if "$py" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$version' else 1)" 2>/dev/null; then
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  exec "$py" -m pip install -q "torch==$version"
fi
# CPU only: a local wheel if the machine has one, else PyTorch's CPU index.
for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
  if ls "$dir"/torch-"$version"+cpu-*.whl >/dev/null 2>&1; then
    exec "$py" -m pip install -q --find-links "$dir" "torch==$version+cpu"
  fi
done
exec "$py" -m pip install -q "torch==$version" --index-url https://download.pytorch.org/whl/cpu
