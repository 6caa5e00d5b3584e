"""The CPU forecast uses the rate this machine reached (issue 46, point 3): a run on a CPU keeps
its measured FLOP/s per process under its shape, the launcher's next forecast of the same shape
uses it and says so, and on a CPU the memory is "per process". Without one, the assumed MFU
stands, and the forecast says so. (The measured accuracy, a 20-step tiny run's forecast against
its time, is in docs/planning.md.)"""

from __future__ import annotations

from anneal.model import flops_per_token
from anneal.planning import measured_rate
from tests.conftest import resolve_tiny, sets


def _rows(tokens_per_s: list[float]) -> list[dict]:
    return [{"kind": "train", "step": i + 1, "tokens_per_s": t} for i, t in enumerate(tokens_per_s)]


def test_a_cpu_run_keeps_its_rate_and_the_next_forecast_uses_it(
    tiny_data, tmp_path, capsys, monkeypatch
):
    from anneal.train.observers import ForecastCheck
    from launcher.__main__ import main as launcher_main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ["--out", str(tmp_path / "run"), "--data", str(tiny_data), "--max-steps", "20"]
    argv = ["run", "recipes/pretrain_tiny.py", "--num-gpus", "1", "--device", "cpu", "--dry-run"]
    assert launcher_main([*argv, "--", *args]) == 0
    before = capsys.readouterr().out
    assert "per process" in before and "(assumed, docs/planning.md; a CPU run keeps" in before

    launch = resolve_tiny(args, world_size=1)
    flops = flops_per_token(launch.preset, seq_len=launch.seq_len)
    key = measured_rate.shape_key(launch)
    check = ForecastCheck(tmp_path / "run", start_step=0, tokens_per_step=1, events=None)
    check.rate = (key, flops)
    for row in _rows([100.0, 900.0, 1000.0, 3000.0]):  # the first warms up
        check.on_step(row)
    check.close()
    rate, run = measured_rate.recall(key)
    assert rate == 1000.0 * flops and run == str(tmp_path / "run")

    assert launcher_main([*argv, "--", *args]) == 0
    after = capsys.readouterr().out
    assert f"(measured here by {tmp_path / 'run'})" in after
    step_s = launch.tokens_per_step / 1000.0  # at the kept rate: tokens per step / tokens/s
    assert "forecast: " in after and f" {step_s:.3g} s per step" in after, after


def test_too_few_steps_keep_nothing_and_another_shape_is_not_used(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert measured_rate.rate_of(_rows([1.0, 2.0, 3.0]), flops_per_token=1, world_size=1) is None
    args = ["--out", str(tmp_path / "run"), "--data", str(tiny_data)]
    one = measured_rate.shape_key(resolve_tiny(args, world_size=1))
    two = measured_rate.shape_key(resolve_tiny(args, world_size=2))
    measured_rate.remember(one, 5.0, run_dir=tmp_path)
    assert measured_rate.recall(two) is None and measured_rate.recall(one)[0] == 5.0
    # float8 (about 5x slower on this CPU) and compile are other rates; off, the key is as before
    others = [
        measured_rate.shape_key(resolve_tiny([*args, *sets(item)], world_size=1))
        for item in ("train.float8=tensorwise", "train.compile=torch", "train.float8=off")
    ]
    assert others[0].endswith("|float8-tensorwise") and others[1].endswith("|compile-torch")
    assert others[2] == one and all(measured_rate.recall(k) is None for k in others[:2])
