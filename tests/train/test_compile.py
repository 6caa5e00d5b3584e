"""A compiled model (``train.compile``; docs/throughput.md).

Fast: DeepCompile is refused on a CPU, at a ZeRO stage without passes, with float8 and with
AutoTP, each in one paragraph before launch; on the GPU path (resolved here without a GPU) it
resolves to the passes of its stage, a section DeepSpeed's own config model takes; a sparse
model is refused either way; ``CompileClock`` takes a step's compile time out of its rate.

Slow: compiled equals eager on the real engine, in this process (see its docstring)."""

from __future__ import annotations

import logging

import pytest

from anneal.errors import UserError
from tests.conftest import SMALL, refused_tiny, resolve_tiny, sets


def _cuda(tiny_data, out, *extra: str, world_size: int = 1):
    """The tiny recipe's launch on ``world_size`` CUDA ranks (resolved here, without a GPU)."""
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.resolution.resolve import resolve_launch
    from tests.conftest import ROOT

    tiny = ROOT / "recipes" / "pretrain_tiny.py"
    args = ["--out", str(out), "--data", str(tiny_data), *SMALL, *extra]
    cfg, overrides = config_from_args(args, prog=str(tiny), on_cpu=False, **load_recipe(tiny))
    return resolve_launch(cfg, overrides, world_size=world_size, device_type="cuda")


def test_deepcompile_resolves_on_the_gpu_path_and_is_refused_where_it_cannot_run(
    tiny_data, tmp_path
):
    from deepspeed.compile.config import CompileConfig

    from anneal.resolution.throughput import deepcompile_section

    out = tmp_path / "run"
    for stage, passes in [(1, ["z1"]), (3, ["z3"])]:
        stage_set = sets("train.compile=deepcompile", f"ds.zero_optimization.stage={stage}")
        launch = _cuda(tiny_data, out, *stage_set)
        section = deepcompile_section(launch.zero_stage)
        assert section == {"deepcompile": True, "passes": passes}
        assert CompileConfig(**section).passes == passes  # DeepSpeed's own model takes it
        assert f"train.compile=deepcompile: DeepSpeed's DeepCompile, passes {passes[0]}" in (
            launch.describe()
        )
    refusals = {
        "cannot run on a CPU": lambda: refused_tiny(
            [
                "--out",
                str(out),
                "--data",
                str(tiny_data),
                *SMALL,
                *sets("train.compile=deepcompile"),
            ],
            world_size=1,
        ),
        "ZeRO-1 (z1) and ZeRO-3 (z3) only": lambda: _refused(
            tiny_data, out, "train.compile=deepcompile", "ds.zero_optimization.stage=2"
        ),
        "float8 layers are untested": lambda: _refused(
            tiny_data, out, "train.compile=deepcompile", "train.float8=rowwise"
        ),
        "autotp and autosp": lambda: _refused(
            tiny_data,
            out,
            "train.compile=deepcompile",
            "ds.tensor_parallel.autotp_size=2",
            world_size=2,
        ),
    }
    for words, refusal in refusals.items():
        text = refusal()
        assert words in text and "--set train.compile=" in text and "\n" not in text, text


def _refused(tiny_data, out, *items: str, world_size: int = 1) -> str:
    with pytest.raises(UserError) as caught:
        _cuda(tiny_data, out, *sets(*items), world_size=world_size)
    return str(caught.value)


def test_compile_on_a_sparse_model_is_refused(tiny_data, tmp_path):
    from tests.train.test_moe import _resolve

    with pytest.raises(UserError, match="sparse model .* --set train.compile=off"):
        _resolve(tiny_data, tmp_path / "run", *sets("train.compile=torch"))


def test_the_compile_clock_takes_compile_time_out_of_the_rate(monkeypatch, caplog):
    """A step that compiled 3 of its 4 s: ``compile_s`` 3, the rate of the other second;
    compilation between steps (a validation's) is no step's; a later step that compiles again
    is warned about with the steps so far."""
    from anneal.train import compiled

    # torch's count: at the clock's making, around step 1, around step 2, then a validation
    # compiled 5 s between steps 2 and 3 (no step's), and step 3 compiled 1 s
    spent = iter([0.0, 10.0, 13.0, 13.0, 13.0, 18.0, 19.0])
    monkeypatch.setattr(compiled, "compile_seconds", lambda: next(spent))
    clock = compiled.CompileClock()
    clock.start()
    first = {"step": 1, "tokens_per_s": 100 / 4.0}
    clock.account(first, tokens_per_step=100)
    assert first == {"step": 1, "tokens_per_s": pytest.approx(100.0), "compile_s": 3.0}
    clock.start()
    second = {"step": 2, "tokens_per_s": 50.0}
    clock.account(second, tokens_per_step=100)
    assert second == {"step": 2, "tokens_per_s": 50.0}
    clock.start()
    with caplog.at_level(logging.WARNING, logger="anneal.train.compiled"):
        clock.account({"step": 3, "tokens_per_s": 50.0}, tokens_per_step=100)
    assert "step 3 compiled the model again (1.0 s; compilations at steps 1, 3)" in caplog.text


@pytest.mark.slow
def test_compiled_equals_eager(tiny_data, tmp_path, world_of_one):
    """``train.compile=torch`` against off on the real engine (ZeRO-2, fp32, one rank in this
    process): the losses of 4 steps within 1e-5 relative (4.5e-8 at most here); the model
    compiles in the first step and never again. Inductor compiles slowly on a CPU, hence one
    stage and slow-marked: 30.4 s here with a cold inductor cache (2026-12-07)."""
    from anneal.train.compiled import CompileClock
    from tests.train.test_float8 import _losses

    args = ["--out", str(tmp_path / "run"), "--data", str(tiny_data), *SMALL]
    args += ["--max-steps", "4", *sets("ds.zero_optimization.stage=2")]
    eager, _ = _losses(resolve_tiny(args, world_size=1), tiny_data, 4)
    clock = CompileClock()
    launch = resolve_tiny([*args, *sets("train.compile=torch")], world_size=1)
    compiled, engine = _losses(launch, tiny_data, 4, clock=clock)
    assert engine.is_compiled
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert clock.compiled_steps == [1]
