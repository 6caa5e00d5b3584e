"""The Chinchilla planner and fitter (anneal/planning/, `anneal plan`, `anneal fit`).

Proves that the planner reproduces published numbers (the Epoch fit's ~72B and ~18 tokens per
parameter at Chinchilla's 5.76e23 FLOPs; the 20-tokens rule's 70B / 1.4T; Hoffmann's closed
form N* = G (C/6)^a, checked against a numerical minimisation), that C = 6ND holds for every
kind of budget, that `anneal fit` recovers a known law from noisy losses within its bootstrap
intervals, and that bad input fails with a clear message.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from anneal import cli, hardware, planning
from anneal.errors import UserError
from anneal.planning import FITS, RunPoint, plan

CHINCHILLA_FLOPS = 5.76e23  # Hoffmann et al. 2022, table 3: Chinchilla's training compute


def test_epoch_fit_at_chinchilla_compute_gives_72b_and_18_tokens_per_param():
    p = plan(flops=CHINCHILLA_FLOPS, fit=FITS["epoch"])
    assert p.params == pytest.approx(72e9, rel=0.02)
    assert p.tokens_per_param == pytest.approx(18, rel=0.03)
    assert p.fit.name == "epoch"
    assert plan(flops=CHINCHILLA_FLOPS).fit is FITS["epoch"]  # the default


def test_rule_of_20_gives_chinchillas_70b_and_1_4t_at_its_compute():
    p = plan(flops=CHINCHILLA_FLOPS, tokens_per_param=planning.parse_rule("tokens-per-param=20"))
    assert p.params == pytest.approx(70e9, rel=0.02)
    assert p.tokens == pytest.approx(1.4e12, rel=0.02)
    assert p.tokens_per_param == pytest.approx(20, rel=1e-12)


@pytest.mark.parametrize("fit", ["hoffmann", "epoch"])
def test_closed_form_frontier_is_exact_and_is_the_numerical_optimum(fit):
    from scipy.optimize import minimize_scalar

    f = FITS[fit]
    g = (f.alpha * f.A / (f.beta * f.B)) ** (1 / (f.alpha + f.beta))
    a = f.beta / (f.alpha + f.beta)
    for c in (1e19, 1e21, CHINCHILLA_FLOPS, 1e26):
        p = plan(flops=c, fit=f)
        assert p.params == pytest.approx(g * (c / 6) ** a, rel=1e-12)
        best = minimize_scalar(
            lambda u, c=c: f.loss(math.exp(u), c / (6 * math.exp(u))),
            bounds=(math.log(1e3), math.log(1e15)),
            method="bounded",
            options={"xatol": 1e-10},
        )
        assert math.exp(best.x) == pytest.approx(p.params, rel=1e-4)


def test_hoffmann_approach_3_constants_and_g():
    f = FITS["hoffmann"]
    assert (f.E, f.A, f.B, f.alpha, f.beta) == (1.69, 406.4, 410.7, 0.34, 0.28)
    assert f.G == pytest.approx((0.34 * 406.4 / (0.28 * 410.7)) ** (1 / 0.62), rel=1e-12)
    e = FITS["epoch"]
    assert (e.E, e.A, e.B, e.alpha, e.beta) == (1.8169, 482.01, 2085.43, 0.3478, 0.3659)


BUDGETS = [
    {"flops": 3e21},
    {"gpus": 256, "hours": 336},
    {"params": 7e9},
    {"tokens": 2e12},
    {"target_loss": 2.1},
]


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: next(iter(b)))
@pytest.mark.parametrize("fit", ["hoffmann", "epoch"])
@pytest.mark.parametrize("rule", [None, 20.0])
def test_six_nd_holds_and_the_budget_is_met(budget, fit, rule):
    p = plan(**budget, fit=FITS[fit], tokens_per_param=rule)
    assert p.flops == pytest.approx(6 * p.params * p.tokens, rel=1e-12)
    assert p.loss == pytest.approx(FITS[fit].loss(p.params, p.tokens), rel=1e-12)
    if "flops" in budget:
        assert p.flops == pytest.approx(budget["flops"], rel=1e-9)
    if "hours" in budget:
        mfu = hardware.DEFAULT_MFU["cuda"]
        assert p.flops == pytest.approx(256 * 336 * 3600 * 989e12 * mfu, rel=1e-9)
        assert p.wall_clock_hours == pytest.approx(336, rel=1e-9)
    if "params" in budget:
        assert p.params == pytest.approx(7e9, rel=1e-12)
    if "tokens" in budget:
        assert p.tokens == pytest.approx(2e12, rel=1e-12)
    if "target_loss" in budget:
        assert p.loss == pytest.approx(2.1, rel=1e-9)
    if rule:
        assert p.tokens_per_param == pytest.approx(rule, rel=1e-12)
    else:  # on the frontier: the same N as planning for this compute directly
        assert p.params == pytest.approx(FITS[fit].optimal_params(p.flops), rel=1e-9)


def test_steps_hours_and_preset():
    p = plan(params=7e9, gpus=64, gpu="a100", mfu=0.5, global_batch=1024, seq_len=4096)
    assert p.steps == math.ceil(p.tokens / (1024 * 4096))
    assert p.gpu_hours == pytest.approx(p.flops / (312e12 * 0.5) / 3600, rel=1e-12)
    assert p.wall_clock_hours == pytest.approx(p.gpu_hours / 64, rel=1e-12)
    assert (p.preset, plan(params=1.1e9).preset, plan(params=3e8).preset) == ("7b", "1b", "350m")
    assert plan(params=7e9).seq_len == 4096  # the nearest preset's context by default
    assert plan(params=7e9, gpu="H200").gpu_peak_flops == 989e12


def test_mfu_defaults_to_the_measured_median_of_a_run(tmp_path):
    rows = [{"kind": "train", "step": i, "mfu": m} for i, m in enumerate([0.9] + [0.3] * 9, 1)]
    rows.append({"kind": "val", "step": 10, "val_loss": 3.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mfu, source = planning.mfu_from_run(tmp_path)
    assert mfu == 0.3  # the first 10% of steps (warm-up) are skipped
    assert str(tmp_path) in source


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plan_json_has_the_contract_keys(capsys):
    code, out, _ = run_cli(capsys, "plan", "--flops", "5.76e23", "--json")
    assert code == 0
    doc = json.loads(out)
    for key in ("params", "tokens", "flops", "loss", "tokens_per_param"):
        assert isinstance(doc[key], float)
    assert doc["params"] == pytest.approx(plan(flops=5.76e23).params, rel=1e-12)
    code, out, _ = run_cli(capsys, "plan", "--gpus", "256", "--hours", "336", "--gpu", "h100")
    assert code == 0 and "wall-clock" in out and "14.0 days on 256 GPUs" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--flops", "0"], "--flops 0.0: must be a positive"),
        (["--flops=-1e20"], "--flops -1e+20: must be a positive"),
        (["--params", "0"], "--params 0.0: must be a positive"),
        (["--tokens=-5"], "--tokens -5.0: must be a positive"),
        (["--gpus", "0", "--hours", "10"], "--gpus 0: must be a whole number"),
        (["--gpus", "8", "--hours=-1"], "--hours -1.0: must be a positive"),
        (["--flops", "1e21", "--mfu", "40"], "MFU is a fraction of peak"),
        (["--flops", "1e21", "--gpu", "v100"], "--gpu v100: unknown GPU; choose one of h100"),
        (["--target-loss", "1.5"], "impossible under the epoch fit, whose irreducible loss is"),
        (["--target-loss", "1.69", "--fit", "hoffmann"], "E = 1.6900"),
        (["--flops", "1e21", "--params", "1e9"], "exactly one budget"),
        ([], "exactly one budget, got none"),
        (["--hours", "5"], "give --gpus too"),
        (["--flops", "1e21", "--rule", "tokens=20"], "rules look like tokens-per-param=R"),
        (["--flops", "1e21", "--fit", "nonesuch"], "neither a shipped fit"),
    ],
)
def test_bad_plan_input_is_a_clear_error(capsys, argv, message):
    code, out, err = run_cli(capsys, "plan", *argv)
    assert code == 2 and out == ""
    assert message in err


def test_target_loss_below_e_names_e():
    with pytest.raises(UserError, match=r"irreducible loss is E = 1\.8169"):
        plan(target_loss=1.8)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json at all", "not a fit file (cannot read it as JSON"),
        ('{"E": 1.7}', "not a fit file (it has no"),
        (json.dumps({"format": "anneal-chinchilla-fit", "version": 9}), "version 9"),
        (
            json.dumps({"format": "anneal-chinchilla-fit", "version": 1, "fit": {"E": 1.7}}),
            "lacks a number for fit.A",
        ),
        (
            json.dumps(
                {
                    "format": "anneal-chinchilla-fit",
                    "version": 1,
                    "fit": {"E": 1.7, "A": 400, "B": 400, "alpha": -0.1, "beta": 0.3},
                }
            ),
            "alpha must be positive",
        ),
    ],
)
def test_a_fit_file_that_is_not_one_is_a_clear_error(tmp_path, capsys, content, message):
    path = tmp_path / "fit.json"
    path.write_text(content)
    code, _, err = run_cli(capsys, "plan", "--flops", "1e21", "--fit", str(path))
    assert code == 2 and message in err


def synthetic_points(truth, *, sigma: float, seed: int) -> list[RunPoint]:
    """A 6 x 6 grid of runs (N 1e7..1e10, D 1e9..1e12) with multiplicative lognormal noise."""
    rng = np.random.default_rng(seed)
    return [
        RunPoint(params=n, tokens=d, loss=truth.loss(n, d) * math.exp(rng.normal(0, sigma)))
        for n in np.logspace(7, 10, 6)
        for d in np.logspace(9, 12, 6)
    ]


TRUTH = planning.ChinchillaFit(
    E=1.8, A=400.0, B=1500.0, alpha=0.34, beta=0.37, name="t", source="t"
)


def test_fit_recovers_a_noise_free_law_exactly():
    points = synthetic_points(TRUTH, sigma=0.0, seed=0)
    result = planning.fit_points(points, n_bootstrap=0, grid_starts=200)
    for k in planning.PARAM_NAMES:
        assert result.values[k] == pytest.approx(getattr(TRUTH, k), rel=1e-3), k


@pytest.mark.slow
def test_fit_recovers_a_noisy_law_within_its_confidence_intervals():
    """The default fit (all 4500 grid starts, 100 bootstrap resamples) on 0.5% noise."""
    result = planning.fit_points(synthetic_points(TRUTH, sigma=0.005, seed=0), n_bootstrap=100)
    for k in planning.PARAM_NAMES:
        lo, hi = result.ci95[k]
        assert lo <= getattr(TRUTH, k) <= hi, (k, lo, hi)
        assert lo <= result.values[k] <= hi
    assert result.n_starts == 4500


def test_anneal_fit_csv_writes_a_fit_file_and_plot_that_plan_reads(tmp_path, capsys):
    points = synthetic_points(TRUTH, sigma=0.002, seed=1)
    csv_path = tmp_path / "runs.csv"
    csv_path.write_text(
        "params,tokens,loss\n" + "".join(f"{p.params},{p.tokens},{p.loss}\n" for p in points)
    )
    out = tmp_path / "fit.json"
    argv = ["fit", "--csv", str(csv_path), "--out", str(out), "--starts", "64"]
    code, text, _ = run_cli(capsys, *argv, "--bootstrap", "10")
    assert code == 0 and "95% CI" in text
    doc = json.loads(out.read_text())
    assert doc["format"] == planning.FIT_FORMAT and len(doc["points"]) == 36
    assert doc["fit"]["alpha"] == pytest.approx(TRUTH.alpha, rel=0.05)
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    fitted = planning.load_fit(out)
    assert set(k for k, _, _ in fitted.ci95) == set(planning.PARAM_NAMES)
    code, text, _ = run_cli(capsys, "plan", "--flops", "1e22", "--fit", str(out), "--json")
    assert code == 0
    assert json.loads(text)["params"] == pytest.approx(fitted.optimal_params(1e22), rel=1e-12)


def test_fit_input_errors(tmp_path, capsys):
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("N,D,L\n1,2,3\n")
    code, _, err = run_cli(capsys, "fit", "--csv", str(bad_csv))
    assert code == 2 and "needs numbers in columns params, tokens and loss" in err
    code, _, err = run_cli(capsys, "fit", str(tmp_path))
    assert code == 2 and "not a run directory" in err
    few = [RunPoint(params=1e6 * i, tokens=1e8, loss=5.0) for i in range(1, 5)]
    with pytest.raises(UserError, match="at least 5 runs with at least 2 model sizes"):
        planning.fit_points(few)


def test_read_run_takes_params_tokens_and_final_val_loss(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model": {"params": 7358720}}))
    rows = [
        {"kind": "train", "step": 1, "tokens": 2048, "loss": 9.0},
        {"kind": "val", "step": 1, "val_loss": 8.5},
        {"kind": "train", "step": 2, "tokens": 4096, "loss": 8.0},
        {"kind": "val", "step": 2, "val_loss": 7.5},
        {"kind": "event", "step": 2, "event": "checkpoint"},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert planning.read_run(tmp_path) == RunPoint(
        params=7358720, tokens=4096, loss=7.5, source=str(tmp_path)
    )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    with pytest.raises(UserError, match="last validation is at step 1 but training went"):
        planning.read_run(tmp_path)


def test_mfu_from_a_run_without_metrics_is_a_clear_error(tmp_path, capsys):
    code, out, err = run_cli(capsys, "plan", "--flops", "1e21", "--mfu-from", str(tmp_path))
    assert code == 2 and out == ""
    assert f"--mfu-from {tmp_path}: {tmp_path / 'metrics.jsonl'}: cannot read it" in err
    assert "--mfu M" in err


def _run_with_mfu(run_dir, mfu: float) -> None:
    rows = [{"kind": "train", "step": i, "mfu": mfu} for i in range(1, 11)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plan_takes_the_mfu_of_a_run(tmp_path, capsys):
    """docs/planning.md's `anneal plan --gpus G --hours H --mfu-from RUN` plans at the run's
    median MFU; a run logged before MFU was capped at 1 (issue 33: a CPU run at 146%) is
    refused with the run and --mfu-from named, not a --mfu the user never gave."""
    _run_with_mfu(tmp_path, 0.3)
    code, out, err = run_cli(
        capsys, "plan", "--gpus", "8", "--hours", "24", "--mfu-from", str(tmp_path), "--json"
    )
    assert code == 0, err
    assert json.loads(out)["mfu"] == 0.3
    assert json.loads(out)["flops"] == pytest.approx(8 * 24 * 3600 * 989e12 * 0.3)
    _run_with_mfu(tmp_path, 1.46)
    code, out, err = run_cli(
        capsys, "plan", "--gpus", "8", "--hours", "24", "--mfu-from", str(tmp_path)
    )
    assert code == 2 and out == ""
    assert f"--mfu-from {tmp_path}: the median MFU of its train rows is 146.0%" in err
    assert "--mfu 1.46" not in err and "Give --mfu M instead" in err


def _finished_run(run_dir, *, params: int, tokens: int, loss: float) -> None:
    """A run directory as `anneal fit` reads it: config.json's params, a train and a val row
    at the last step."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"model": {"params": params}}))
    rows = [
        {"kind": "train", "step": 4, "tokens": tokens, "loss": loss + 0.1},
        {"kind": "val", "step": 4, "val_loss": loss},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_fit_of_a_sweep_folder_skips_its_files_and_a_lone_non_run_is_an_error(tmp_path, capsys):
    """`anneal fit runs/scaling_sweep/*` (the README's command) also matches the sweep's own
    fit.json, fit.png and sweep.json: those are skipped, named on one stderr line, and the fit
    is of the 6 runs; a single path that is not a run directory is still an error, and so is a
    path that does not exist (a glob that matched nothing)."""
    sweep = tmp_path / "scaling_sweep"
    for i, (n, d) in enumerate((n, d) for n in (1e6, 2e6, 4e6) for d in (8192, 16384)):
        loss = TRUTH.loss(n, d)
        _finished_run(sweep / f"run{i}", params=int(n), tokens=d, loss=loss)
    for name in ("fit.json", "fit.png", "sweep.json"):
        (sweep / name).write_text("{}")
    (sweep / "notes").mkdir()  # a folder that holds no run either
    paths = sorted(str(p) for p in sweep.iterdir())
    out = tmp_path / "fit.json"
    argv = ["fit", *paths, "--out", str(out), "--starts", "8", "--bootstrap", "2"]
    code, text, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert "fit of 6 runs" in text
    skipped = [line for line in err.splitlines() if "skipped" in line]
    assert len(skipped) == 1
    assert all(n in skipped[0] for n in ("fit.json", "fit.png", "sweep.json", "notes"))
    assert len(json.loads(out.read_text())["points"]) == 6
    code, _, err = run_cli(capsys, "fit", str(sweep / "fit.json"))
    assert code == 2 and "not a run directory" in err
    code, _, err = run_cli(capsys, "fit", *paths, str(tmp_path / "sweep-*"))
    assert code == 2 and "sweep-*" in err and "not a run directory" in err


def test_anneal_fit_shows_its_progress_on_stderr(tmp_path, capsys):
    """`anneal fit` said nothing for minutes: it now prints a line on stderr for each stage
    (runs read, each tenth of the point estimate's starts, each tenth of the bootstrap), plain
    lines that a log or a pipe shows as well as a terminal; stdout keeps only the result."""
    points = synthetic_points(TRUTH, sigma=0.002, seed=1)
    csv_path = tmp_path / "runs.csv"
    csv_path.write_text(
        "params,tokens,loss\n" + "".join(f"{p.params},{p.tokens},{p.loss}\n" for p in points)
    )
    argv = ["fit", "--csv", str(csv_path), "--out", str(tmp_path / "f.json"), "--starts", "10"]
    code, text, err = run_cli(capsys, *argv, "--bootstrap", "10")
    assert code == 0
    lines = [line for line in err.splitlines() if line.startswith("anneal fit: ")]
    assert "36 runs" in lines[0]
    starts = [line.split()[4] for line in lines if line.startswith("anneal fit: point estimate:")]
    assert starts == [f"{i}/10" for i in range(1, 11)]
    boot = [line.split()[3] for line in lines if line.startswith("anneal fit: bootstrap ")]
    assert boot == [f"{i}/10" for i in range(1, 11)]
    assert "anneal fit: " not in text
