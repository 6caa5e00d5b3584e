# Anneal: `make demo` and `make test` set up .venv on first use, then run.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := $(shell sed -n 's/^torch==//p' requirements.txt)
# DeepSpeed JIT-builds its ops on first use; keep the build per torch/DeepSpeed pair so that
# venvs with other builds (and CI's fresh clones) reuse it instead of thrashing one cache.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions/anneal-torch$(TORCH_VERSION)-ds$(shell sed -n 's/^deepspeed==//p' requirements.txt)

.PHONY: setup demo test test-all lint bench clean-venv

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml scripts/install_torch.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	bash scripts/install_torch.sh $(BIN)/python $(TORCH_VERSION)
	$(BIN)/python -m pip install -q --no-build-isolation -r requirements.txt -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

data/stdlib/meta.json: | $(STAMP)
	$(BIN)/anneal data prepare --input stdlib --out data/stdlib

demo: $(STAMP) data/stdlib/meta.json
	$(BIN)/python scripts/demo.py

# `make test` leaves out the tests marked slow (end-to-end drills: real Slurm, ssh, crash,
# world size, long runs), as two pytest sessions side by side; `make test-all` (CI) runs
# everything, as three (tests/shards.py; `make test SLOW=1` runs it all in two). How long each
# takes: docs/benchmarks.md, "The test suite". Each session prints its 10 slowest tests, so a
# slow one is seen. One test alone: `.venv/bin/python -m pytest tests/PATH::NAME`.
test: $(STAMP)
	$(BIN)/python tests/shards.py 2 -q --durations=10 $(if $(SLOW),,-m "not slow") tests

test-all: $(STAMP)
	$(BIN)/python tests/shards.py 3 -q --durations=10 tests

lint: $(STAMP)
	$(BIN)/ruff check anneal launcher recipes tests bench scripts
	$(BIN)/ruff format --check anneal launcher recipes tests bench scripts

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean-venv:
	rm -rf $(VENV)
