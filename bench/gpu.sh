#!/usr/bin/env bash
# The GPU benchmark (docs/benchmarks.md, "GPU"): first the tests marked gpu (every row resolved on
# this GPU, three steps of the 125m recipe in bf16), then 1b and 125m on one GPU, bf16, ZeRO-1 and
# ZeRO-3, sequence 2048, act. checkpointing off and on; tokens/s, TFLOP/s, MFU, peak memory.
# Optional rows (MoE: tiny-moe and OLMoE's shape at 8 layers; 1b at 32K, chunked and plain loss;
# 1b with data.document_mask at 2048 and 32K; 125m and 1b with Muon; compile, float8 and
# DeepCompile at 1b and an 8B-like shape; --only NAME,... runs them alone) use the time left of
# 8 min.
#
#   bash bench/gpu.sh LOGDIR [bench_gpu.py options]        the benchmark, logs into LOGDIR
#   bash bench/gpu.sh --cpu-smoke LOGDIR [options]         the same path on CPU (tiny, tiny-moe)
#   bash bench/gpu.sh --fetch-wheels [DIR]                 here, with PyPI: wheels for a GPU
#                                                           machine that lacks DeepSpeed
#
# Set-up, in order: the python (ANNEAL_PYTHON, else the first of .venv/bin/python,
# /opt/torch/.venv/bin/python3, python3 whose torch sees a GPU, or any torch on --cpu-smoke);
# if it cannot import Anneal's training stack (DeepSpeed, transformers, ...), the wheels in
# ANNEAL_WHEELS (default: .whl/ in the repo) are installed with pip --no-index into SCRATCH/site,
# which goes first on PYTHONPATH. SCRATCH is a new private directory (mktemp -d, mode 0700)
# removed on exit: a fixed path under /tmp there would let another user of the host plant a
# sitecustomize.py that this python runs. WORK (data, runs; ANNEAL_BENCH_WORK) defaults to
# SCRATCH/work. Nothing is downloaded on the GPU machine.
# Exit: 0 the gpu tests passed (on --cpu-smoke: skipped) and all rows measured or skipped for
# time; 1 a gpu test failed or could not run (no pytest), a row failed or nothing measured;
# 2 set-up.
set -uo pipefail
export ANNEAL_BENCH_T0=${ANNEAL_BENCH_T0:-$(date +%s.%N)}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

make_scratch() {  # a private directory, removed when the script exits (sets scratch, work)
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/anneal-gpu-bench.XXXXXX") || exit 2
  trap 'rm -rf -- "$scratch"' EXIT
  trap 'exit 129' HUP
  trap 'exit 130' INT
  trap 'exit 143' TERM
  work=${ANNEAL_BENCH_WORK:-$scratch/work}
  export ANNEAL_BENCH_WORK=$work
}

fetch_wheels() {
  local dir=${1:-$repo/.whl}
  local py=${ANNEAL_PYTHON:-$repo/.venv/bin/python}
  local pyver=${ANNEAL_WHEELS_PYTHON:-3.12}  # the GPU machine's python (docs/benchmarks.md)
  local ds_version
  ds_version=$(sed -n 's/^deepspeed==//p' "$repo/requirements.txt")
  mkdir -p "$dir" || return 2
  # DeepSpeed is an sdist on PyPI: build its pure-Python wheel here, with no ops (they JIT-build).
  DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" \
    "deepspeed==$ds_version" || return 2
  # Its requirements that the GPU image lacks, at the versions tested here (pydantic wants a
  # newer typing-extensions than an image may have; the newer one serves torch as well).
  local pins
  pins=$("$py" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in
               ("hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
                "typing-extensions",
                # pytest and its needs, for the tests marked gpu that gpu.sh runs first
                "pytest", "pluggy", "iniconfig", "pygments", "packaging", "pytest-timeout")))
EOF
  ) || return 2
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" $pins || return 2
  ls -l "$dir"
  echo "carry $dir to the GPU machine (the run tool's carry: [\"${dir#"$repo"/}\"])"
}

pick_python() {  # $1: cpu|gpu
  local want=$1 py
  if [[ -n ${ANNEAL_PYTHON:-} ]]; then
    echo "$ANNEAL_PYTHON"
    return
  fi
  for py in "$repo/.venv/bin/python" /opt/torch/.venv/bin/python3 python3 python; do
    command -v "$py" >/dev/null 2>&1 || continue
    if [[ $want == cpu ]]; then
      "$py" -c "import torch" >/dev/null 2>&1 && { echo "$py"; return; }
    else
      "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" \
        >/dev/null 2>&1 && { echo "$py"; return; }
    fi
  done
}

gpu_tests() {  # $1: cpu|gpu. The tests marked gpu, in a pytest session of their own (on the
  # CPU smoke with no GPU visible: they skip, and the step is exercised all the same)
  if ! "$py" -c "import pytest" >/dev/null 2>&1; then
    echo "gpu tests: not run: $py cannot import pytest (bash bench/gpu.sh --fetch-wheels puts it among the wheels)"
    return 1
  fi
  local hide=()
  [[ $1 == cpu ]] && hide=(CUDA_VISIBLE_DEVICES=)
  echo "gpu tests: pytest -m gpu tests/bench/test_bench_gpu.py"
  (cd "$repo" && env -u ANNEAL_TEST_SHARD ${hide[@]+"${hide[@]}"} timeout -k 10 300 "$py" -m pytest -q -m gpu \
    -p no:cacheprovider --basetemp "$scratch/pytest" tests/bench/test_bench_gpu.py)
}

stack_ok() {  # what a recipe imports, without starting anything
  PYTHONPATH=$1 "$py" -c "import deepspeed, transformers, sentencepiece, anneal.train, anneal.data.prepare" 2>&1
}

main() {
  local mode=gpu
  if [[ ${1:-} == --cpu-smoke ]]; then
    mode=cpu
    shift
  fi
  local logdir=$1
  shift
  echo "== bench/gpu.sh ($mode) $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), repo $repo"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  py=$(pick_python $mode)
  if [[ -z $py ]]; then
    echo "set-up: no python with torch$([[ $mode == gpu ]] && echo ' that sees a CUDA GPU') found (set ANNEAL_PYTHON)"
    return 2
  fi
  echo "set-up: python $py ($("$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"
  local path=$repo${PYTHONPATH:+:$PYTHONPATH} err
  if ! err=$(stack_ok "$path"); then
    echo "set-up: $py cannot import the training stack: ${err##*$'\n'}"
    local wheels=${ANNEAL_WHEELS:-$repo/.whl}
    if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
      echo "set-up: no wheels in $wheels to install (make them where PyPI is reachable: bash bench/gpu.sh --fetch-wheels, then carry .whl)"
      return 2
    fi
    echo "set-up: installing $(cd "$wheels" && echo *.whl) into $scratch/site (pip --no-index)"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$scratch/site" "$wheels"/*.whl || return 2
    path=$repo:$scratch/site${PYTHONPATH:+:$PYTHONPATH}
    if ! err=$(stack_ok "$path"); then
      echo "set-up: still cannot import the training stack after installing the wheels:"
      echo "$err"
      return 2
    fi
  fi
  echo "set-up: training stack imports (PYTHONPATH=$path)"
  export PYTHONPATH=$path
  local tests=0
  gpu_tests $mode || tests=$?
  [[ $tests != 0 ]] && echo "gpu tests: failed or not run (exit $tests, above); the benchmark runs all the same, and gpu.sh exits 1"
  local args=("$logdir")
  [[ $mode == cpu ]] && args+=(--cpu-smoke)
  "$py" "$repo/bench/bench_gpu.py" "${args[@]}" "$@"
  local code=$?
  [[ $code == 0 && $tests != 0 ]] && code=1
  return $code
}

if [[ ${1:-} == --fetch-wheels ]]; then
  shift
  fetch_wheels "$@"
  exit $?
fi
if [[ $# -lt 1 || ${1:-} == -h || ${1:-} == --help || (${1:-} == --cpu-smoke && $# -lt 2) ]]; then
  sed -n '2,25p' "$0"
  exit 2
fi
logdir=$1
[[ $1 == --cpu-smoke ]] && logdir=$2
mkdir -p "$logdir" || exit 2
make_scratch
main "$@" 2>&1 | tee "$logdir/gpu_bench.log"
exit "${PIPESTATUS[0]}"
