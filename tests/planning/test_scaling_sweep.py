"""recipes/scaling_sweep.py end to end on CPU, and the MFU that runs write to metrics.jsonl.

Proves that the sweep trains every (size, token budget) of its test grid through the real
training path, that each run consumed exactly its token budget and got better with more tokens
and with more parameters, that the fit file holds exactly those runs, that a second launch
skips finished runs, and that each train row's `mfu` is (6N + 12*L*H*Q*T) x tokens/s over the
CPU peak measured once and cached (docs/planning.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from anneal import planning
from anneal.model import count_params, flops_per_token, get_preset
from tests.conftest import read_metrics, run_process

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))
import scaling_sweep  # noqa: E402

BATCH_TOKENS = 4 * 2 * 256  # ds_configs/cpu.json: micro-batch 4 x accumulation 2 x 256 tokens


def preset_of(run_dir: Path):
    """The resolved model shape a run recorded in its config.json."""
    model = json.loads((run_dir / "config.json").read_text())["model"]
    cls = type(get_preset("tiny"))
    return cls(**{f.name: model[f.name] for f in dataclasses.fields(cls)})


def _env(cache: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(cache)}


def sweep(out: Path, data: Path, cache: Path, *extra: str) -> str:
    cmd = [sys.executable, "recipes/scaling_sweep.py", "--grid", "test", "--out", str(out)]
    cmd += ["--data", str(data), *extra]
    proc = run_process(cmd, timeout_s=900, cwd=REPO, env=_env(cache))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def swept(tmp_path_factory, stdlib_data):
    root = tmp_path_factory.mktemp("sweep")
    out, cache = root / "sweep", root / "cache"
    stdout = sweep(out, stdlib_data, cache, "--starts", "64", "--bootstrap", "10")
    return out, cache, stdout


@pytest.mark.slow
def test_every_run_of_the_grid_trained_its_budget(swept, stdlib_data):
    out, _, _ = swept
    grid = scaling_sweep.GRIDS["test"]
    vocab = json.loads((stdlib_data / "meta.json").read_text())["vocab_size"]
    losses = {}
    for shape in grid.shapes:
        for tokens in grid.tokens:
            run_dir = out / f"{shape.name}_d{tokens}"  # test budgets are whole steps
            cfg = json.loads((run_dir / "config.json").read_text())
            preset = preset_of(run_dir)
            assert (preset.vocab_size, preset.seq_len) == (vocab, 256)
            assert cfg["model"]["hidden_size"] == shape.hidden_size
            assert cfg["model"]["num_hidden_layers"] == shape.num_hidden_layers
            assert cfg["model"]["params"] == count_params(preset)
            assert cfg["run"]["train"]["max_steps"] == tokens // BATCH_TOKENS
            train = read_metrics(run_dir, "train")
            assert [r["tokens"] for r in train] == [
                BATCH_TOKENS * i for i in range(1, tokens // BATCH_TOKENS + 1)
            ]
            point = planning.read_run(run_dir)
            assert (point.params, point.tokens) == (count_params(preset), tokens)
            losses[shape.hidden_size, tokens] = point.loss
            assert not (run_dir / "checkpoints").exists()  # removed unless --keep-checkpoints
    sizes = [s.hidden_size for s in grid.shapes]
    for h in sizes:  # more tokens, lower loss
        assert losses[h, grid.tokens[0]] > losses[h, grid.tokens[1]]
    for d in grid.tokens:  # more parameters, lower loss
        assert [losses[h, d] for h in sizes] == sorted((losses[h, d] for h in sizes), reverse=True)


@pytest.mark.slow
def test_fit_file_and_plot_hold_exactly_the_runs(swept):
    out, _, stdout = swept
    doc = json.loads((out / "fit.json").read_text())
    assert doc["format"] == planning.FIT_FORMAT
    runs = sorted(p.parent for p in out.glob("*/metrics.jsonl"))
    assert len(runs) == 6
    expected = sorted((p.params, p.tokens, p.loss) for p in map(planning.read_run, runs))
    assert sorted((p["params"], p["tokens"], p["loss"]) for p in doc["points"]) == expected
    assert set(doc["ci95"]) == set(planning.PARAM_NAMES)
    assert (out / "fit.png").read_bytes()[:4] == b"\x89PNG"
    assert "fit of 6 runs" in stdout


@pytest.mark.slow
def test_mfu_in_metrics_is_6n_plus_attention_over_the_cached_cpu_peak(swept, stdlib_data):
    out, cache, _ = swept
    peaks = json.loads((cache / "anneal" / "cpu_peak_flops.json").read_text())
    assert len(peaks) == 1  # measured once, by the first run; every later run read the cache
    (peak,) = (entry["flops"] for entry in peaks.values())
    vocab = json.loads((stdlib_data / "meta.json").read_text())["vocab_size"]
    for run_dir in sorted(p.parent for p in out.glob("*/metrics.jsonl")):
        preset = preset_of(run_dir)
        assert preset.vocab_size == vocab
        per_token = 6 * count_params(preset, embeddings=False) + 12 * preset.num_hidden_layers * (
            preset.num_attention_heads * preset.head_dim * 256
        )
        assert per_token == flops_per_token(preset)
        train = read_metrics(run_dir, "train")
        assert train
        for row in train:
            assert row["mfu"] == pytest.approx(per_token * row["tokens_per_s"] / peak)


@pytest.mark.slow
def test_a_second_launch_skips_finished_runs(swept, stdlib_data):
    out, cache, _ = swept
    before = {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.jsonl")}
    stdout = sweep(out, stdlib_data, cache, "--starts", "8", "--bootstrap", "0")
    assert stdout.count("is finished; skipping") == 6
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.jsonl")} == before
