"""bench_muon.py --speed: the FLOP-count prediction it prints is for the model its runs train
(each speed shape's preset equals the one the tiny recipe resolves from the shape's --set
items, with the tokens a step it asks for), and the predictions recorded in
docs/benchmarks.md (1.037 at the tiny preset, 1.050 at hidden 512 x 8 layers)."""

import sys

import pytest

from tests.conftest import ROOT, resolve_tiny, sets

sys.path.insert(0, str(ROOT / "bench"))

import bench_muon  # noqa: E402


@pytest.mark.parametrize("name, ratio", [("tiny", 1.037), ("h512", 1.050)])
def test_the_prediction_is_for_the_model_the_runs_train(name, ratio, tiny_data):
    shape = bench_muon.SPEED_SHAPES[name]
    args = ["--out", "unused", "--data", str(tiny_data), "--ds-config", "cpu_zero2.json"]
    launch = resolve_tiny([*args, *sets(*shape.sets())], world_size=1)
    # tiny_data's vocabulary is 300; the bench's stdlib corpus has the tiny preset's 8192
    assert launch.preset == shape.preset().with_vocab(launch.preset.vocab_size)
    assert launch.tokens_per_step == shape.tokens
    assert bench_muon.predicted_ratio(shape)["ratio"] == pytest.approx(ratio, abs=5e-4)
