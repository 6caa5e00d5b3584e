"""Schedules beyond warmup-cosine, extending a run, and a global batch that fits any world.

- WSD (``optim.schedule=wsd``) equals its closed form, written out here independently, at every
  phase boundary (first step, end of warmup, last stable step, first decay step, mid-decay, last
  step, after the end) for each decay shape, and the cosine path of the generalised ``Schedule``
  equals ``lr_ratio`` bit for bit.
- The scheduler applies ratio x peak to the optimizer, records its schedule in its state, and
  says on a resume what a changed schedule does to the next step's LR (nothing for a WSD run
  extended in its stable phase; the jump for cosine).
- The floor has one source: ``optim.min_lr_ratio``, else the file's ``cos_min_ratio`` under
  cosine, else the schedule's default; two different floors under cosine are an error naming
  both keys, and bad values of the new keys are one-paragraph errors naming key and choices.
- The tiny recipe's global batch rounds up to a multiple of micro-batch x data-parallel size,
  saying so, at any data-parallel size up to 512, and the launcher's pre-flight takes it for 32
  ranks (slow: a launcher process).
- Real runs (slow): a WSD run stopped and resumed with a larger ``--max-steps`` logs the LR of the
  extended schedule's closed form at every step, with no jump and no warning; the same under
  cosine prints the jump once.
"""

import dataclasses
import json
import math
import sys
from types import SimpleNamespace

import pytest

from anneal.config.run import OptimConfig, RunConfig
from anneal.config.run_checks import apply_overrides, check_ranges
from anneal.config.schedule import Schedule, WarmupDecay, lr_ratio
from anneal.errors import UserError
from anneal.resolution import ds as dslib
from tests.conftest import ROOT, SMALL, read_metrics, run_process, run_recipes

SHAPES = {
    "linear": lambda p: 1 - p,
    "1-sqrt": lambda p: 1 - math.sqrt(p),  # Haegele et al. 2024, eq. for the (1 - sqrt) cooldown
    "cosine": lambda p: (1 + math.cos(math.pi * p)) / 2,
}


def wsd_closed_form(t, *, peak, warm, total, share, floor, shape):
    """WSD as docs/training.md writes it: linear warmup, the peak, then the decay over the last
    round(share * total) steps to floor x peak."""
    decay = min(max(1, round(share * total)), total - warm)
    start = total - decay
    if t <= warm:
        return peak * t / warm
    if t <= start:
        return peak
    p = min(1.0, (t - start) / decay)
    return peak * (floor + (1 - floor) * SHAPES[shape](p))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_wsd_at_every_phase_boundary(shape, floor):
    sched = Schedule(
        kind="wsd",
        total_num_steps=1000,
        warmup_num_steps=50,
        min_ratio=floor,
        decay_share=0.2,
        decay_shape=shape,
    )
    assert sched.decay_start == 800
    # first step, end of warmup, first stable, last stable, first decay, mid-decay, last, after
    for t in (1, 50, 51, 800, 801, 900, 999, 1000, 1001, 5000):
        want = wsd_closed_form(
            t, peak=1.0, warm=50, total=1000, share=0.2, floor=floor, shape=shape
        )
        assert sched.ratio(t) == pytest.approx(want, rel=1e-12, abs=1e-15), t
    assert sched.ratio(50) == sched.ratio(800) == 1.0
    assert sched.ratio(1000) == sched.ratio(1001) == floor
    assert sched.ratio(900) == pytest.approx(floor + (1 - floor) * SHAPES[shape](0.5))


def test_a_short_wsd_run_still_decays():
    """decay_share x T rounds to 0 at T = 2: the last step still reaches the floor."""
    sched = Schedule(kind="wsd", total_num_steps=2, warmup_num_steps=0, min_ratio=0.0)
    assert (sched.decay_start, sched.ratio(1), sched.ratio(2)) == (1, 1.0, 0.0)
    no_room = dataclasses.replace(sched, warmup_num_steps=2)  # all warmup: nothing to decay
    assert (no_room.ratio(1), no_room.ratio(2), no_room.ratio(3)) == (0.5, 1.0, 0.0)


def test_cosine_is_unchanged_bit_for_bit():
    sched = Schedule(kind="cosine", total_num_steps=300, warmup_num_steps=20, min_ratio=0.1)
    kw = dict(total_num_steps=300, warmup_num_steps=20, cos_min_ratio=0.1)
    assert all(sched.ratio(t) == lr_ratio(t, **kw) for t in range(1, 320))


def test_scheduler_applies_the_schedule_and_records_it():
    opt = SimpleNamespace(param_groups=[{"lr": 2e-3}])  # what the scheduler reads and sets
    sched = Schedule(kind="wsd", total_num_steps=10, warmup_num_steps=2, min_ratio=0.0)
    s = WarmupDecay(opt, sched)
    seen = []
    for _ in range(11):
        seen.append(opt.param_groups[0]["lr"])
        s.step()
    assert seen == pytest.approx(
        [2e-3 * sched.ratio(t) for t in range(1, 12)], rel=1e-12, abs=1e-18
    )
    state = s.state_dict()
    assert state["schedule"] == dataclasses.asdict(sched) and state["steps_done"] == 11


def _resumed(saved: Schedule, now: Schedule, step: int) -> WarmupDecay:
    opt = SimpleNamespace(param_groups=[{"lr": 1.0}])
    before = WarmupDecay(opt, saved)
    before.steps_done = step
    after = WarmupDecay(opt, now)
    after.load_state_dict(before.state_dict())
    return after


def test_a_wsd_run_extended_in_its_stable_phase_has_no_jump():
    short = Schedule(kind="wsd", total_num_steps=100, warmup_num_steps=10, min_ratio=0.0)
    longer = dataclasses.replace(short, total_num_steps=300)
    s = _resumed(short, longer, step=50)
    assert s.change_on_resume() is None
    assert s.get_lr() == [1.0]  # step 51: still the peak; the decay now starts after step 240
    late = _resumed(short, longer, step=90)  # resumed in the decay: back to the peak, said
    assert f"jumps from {short.ratio(91):.4g} to 1 x peak" in late.change_on_resume()


def test_a_cosine_run_with_a_new_length_says_its_jump():
    short = Schedule(kind="cosine", total_num_steps=100, warmup_num_steps=10, min_ratio=0.1)
    s = _resumed(short, dataclasses.replace(short, total_num_steps=200), step=50)
    msg = s.change_on_resume()
    before, after = short.ratio(51), lr_ratio(51, total_num_steps=200, warmup_num_steps=10)
    assert f"from {before:.4g} to {after:.4g} x peak" in msg
    assert "cosine to 0.1 x peak at step 200" in msg
    assert _resumed(short, short, step=50).change_on_resume() is None


def resolve(optim, *, ds="cpu.json", world=1, seq_len=64, sets=(), **kw):
    cfg = dslib.load_ds_config(dslib.find_ds_config(ds))
    cfg = dslib.override_ds_config(cfg, dslib.ds_overrides(list(sets)), source=ds)
    return dslib.resolve_ds_config(
        cfg,
        source=ds,
        data_parallel_size=world,
        max_steps=100,
        seq_len=seq_len,
        optim=optim,
        **kw,
    )


def test_the_floor_has_one_source():
    key = "scheduler.params.cos_min_ratio"
    cosine, notes = resolve(OptimConfig())  # the shipped file's 0.1, as before
    assert cosine["scheduler"]["params"]["cos_min_ratio"] == 0.1 and notes[key] == "0.1 (ds_config)"
    wsd, notes = resolve(OptimConfig(schedule="wsd"))
    assert wsd["scheduler"]["params"]["cos_min_ratio"] == 0.0
    assert "wsd schedule's default" in notes[key] and "cosine schedule's floor" in notes[key]
    given, _ = resolve(OptimConfig(schedule="wsd", min_lr_ratio=0.05))
    assert given["scheduler"]["params"]["cos_min_ratio"] == 0.05
    auto, _ = resolve(OptimConfig(), sets=["ds.scheduler.params.cos_min_ratio=auto"])
    assert auto["scheduler"]["params"]["cos_min_ratio"] == 0.1
    same, _ = resolve(OptimConfig(min_lr_ratio=0.1))
    assert same["scheduler"]["params"]["cos_min_ratio"] == 0.1
    with pytest.raises(UserError) as e:
        resolve(OptimConfig(min_lr_ratio=0.0), optim_set=frozenset({"min_lr_ratio"}))
    msg = str(e.value)
    assert key in msg and "optim.min_lr_ratio is 0 (--set optim.min_lr_ratio)" in msg
    assert '"auto"' in msg and "optim.min_lr_ratio=auto" in msg


@pytest.mark.parametrize(
    "override,words",
    [
        ("optim.schedule=linear", ["optim.schedule", "cosine, wsd"]),
        ("optim.decay_shape=sqrt", ["optim.decay_shape", "linear, 1-sqrt, cosine"]),
        ("optim.decay_share=0", ["optim.decay_share", "above 0 and at most 1"]),
        ("optim.min_lr_ratio=1.5", ["optim.min_lr_ratio", "between 0 and 1", '"auto"']),
        ("optim.min_lr_ratio=low", ["optim.min_lr_ratio", "expected float"]),
    ],
)
def test_bad_values_are_one_paragraph_errors(override, words):
    cfg = RunConfig(out="o", ds_config="cpu.json")
    with pytest.raises(UserError) as e:
        check_ranges(apply_overrides(cfg, [override]))
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "\n" not in str(e.value)


def test_a_recipe_value_is_checked_too():
    cfg = RunConfig(out="o", ds_config="cpu.json", optim=OptimConfig(schedule="WSD"))
    with pytest.raises(UserError, match=r"optim.schedule is 'WSD': it must be one of cosine, wsd"):
        check_ranges(cfg)
    assert apply_overrides(cfg, ["optim.min_lr_ratio=auto"]).optim.min_lr_ratio is None


@pytest.mark.parametrize("world", [1, 2, 3, 8, 32, 512])
def test_the_tiny_recipe_resolves_at_any_data_parallel_size(world):
    from anneal.cli.recipe import load_recipe
    from anneal.model import get_preset

    recipe = load_recipe(ROOT / "recipes" / "pretrain_tiny.py")
    seq_len = get_preset(recipe["preset"]).seq_len
    ds, notes = resolve(recipe["optim"], ds=recipe["ds_config"], world=world, seq_len=seq_len)
    micro = ds["train_micro_batch_size_per_gpu"]
    wanted = recipe["optim"].global_batch_tokens // seq_len  # 64 samples
    per_step = micro * world
    samples = ds["train_batch_size"]
    assert samples == math.ceil(wanted / per_step) * per_step
    assert samples == micro * world * ds["gradient_accumulation_steps"]
    if samples == wanted:
        assert notes.messages == []
    else:
        assert notes.messages == [
            f"global batch rounded up from {wanted} to {samples} samples "
            f"({samples * seq_len:,} tokens per step): a multiple of micro-batch {micro} x "
            f"{world} data-parallel ranks (optim.global_batch_tokens sets it)"
        ]
        assert "rounded up" in notes["train_batch_size"]


def test_an_explicit_train_batch_size_that_does_not_divide_stays_an_error():
    with pytest.raises(UserError, match="does not divide"):
        resolve(OptimConfig(), world=3, sets=["ds.train_batch_size=64"])


@pytest.mark.slow
def test_the_launcher_takes_the_tiny_recipe_on_32_ranks(tiny_data, tmp_path):
    """Slow (a launcher process importing DeepSpeed, about 10 s): issue 20's command,
    ``submit recipes/pretrain_tiny.py --nodes 4 --gpus-per-node 8 --dry-run``, refused before."""
    out = tmp_path / "run"
    done = run_process(
        [sys.executable, "-m", "launcher", "submit", "recipes/pretrain_tiny.py", "--nodes", "4"]
        + ["--gpus-per-node", "8", "--partition", "debug", "--time", "00:10:00", "--dry-run"]
        + ["--", "--out", str(out), "--data", str(tiny_data)],
        timeout_s=400,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--nodes=4" in done.stdout and not out.exists()


def _lrs(run):
    rows = read_metrics(run, "train")
    return [r["step"] for r in rows], [r["lr"] for r in rows]


@pytest.mark.slow
def test_extending_a_run(tiny_data, tmp_path):
    """Slow (four short training processes, two at a time: 35 s on 2 shared cores). A WSD
    run of 8 steps stopped after step 4 and resumed with --max-steps 16 logs, at steps 1 to 15,
    the LR of the 16-step schedule's closed form (its "auto" warmup of 4 steps kept, not
    re-derived as 8 from the new length), with no warning; the same under cosine prints the
    jump once. The resumed runs stop after step 15 (the drill's stop), which leaves out the
    end-of-run charts and report, a process each."""
    peak = 3e-3  # the tiny recipe's optim.lr
    base = [*SMALL, "--data", str(tiny_data), "--save-every", "100", "--val-every", "0"]
    base += ["--set", "ds.scheduler.params.warmup_num_steps=auto"]
    base += ["--set", "optim.warmup_max_share=0.5", "--set", "train.val_samples=0"]
    runs = {name: tmp_path / name for name in ("wsd", "cosine")}

    def launches(max_steps, stop, *resume):
        return [
            {
                "args": [*base, "--out", str(runs[name]), "--max-steps", str(max_steps), *resume]
                + ["--set", f"optim.schedule={name}", "--set", f"train.stop_at_step={stop}"]
            }
            for name in runs
        ]

    run_recipes(launches(8, 4), parallel=2)
    wsd_done, cosine_done = run_recipes(launches(16, 15, "--resume", "auto"), parallel=2)

    steps, lrs = _lrs(runs["wsd"])
    assert steps == list(range(1, 16))
    want = [
        wsd_closed_form(t, peak=peak, warm=4, total=16, share=0.2, floor=0.0, shape="1-sqrt")
        for t in steps
    ]
    assert lrs == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert lrs[3:13] == [peak] * 10  # steps 4 to 13: the peak across the resume; then the decay
    assert lrs[13] < lrs[12] and "jumps" not in wsd_done.stderr + wsd_done.stdout
    config = json.loads((runs["wsd"] / "config.json").read_text())
    assert config["ds_config"]["scheduler"]["params"]["warmup_num_steps"] == 4

    steps, lrs = _lrs(runs["cosine"])
    old = [peak * lr_ratio(t, total_num_steps=8, warmup_num_steps=4) for t in range(1, 5)]
    new = [peak * lr_ratio(t, total_num_steps=16, warmup_num_steps=4) for t in range(5, 16)]
    assert lrs == pytest.approx(old + new, rel=1e-9)  # step 5 too: the new schedule's LR
    log = cosine_done.stderr + cosine_done.stdout
    jump = f"jumps from {lr_ratio(5, total_num_steps=8, warmup_num_steps=4):.4g} to "
    assert log.count(jump) == 1 and "cosine to 0.1 x peak at step 16" in log


def test_the_schedule_chart_draws_a_wsd_run_and_its_extension(tmp_path):
    """``anneal plot --schedule RUN`` reads the run's config.json: WSD phases, the closed form
    at every drawn step, and --steps beyond the run's end draws the run extended."""
    from anneal.files import is_matplotlib_png
    from anneal.observe.formula_plots import planned_lr, plot_schedule_file

    run = tmp_path / "run"
    run.mkdir()
    optim = dataclasses.asdict(OptimConfig(schedule="wsd", decay_shape="linear"))
    sched = {"total_num_steps": 100, "warmup_num_steps": 10, "cos_min_ratio": 0.0}
    doc = {"run": {"optim": optim}, "ds_config": {"optimizer": {"params": {"lr": 1e-3}}}}
    doc["ds_config"]["scheduler"] = {"type": "WarmupCosineLR", "params": sched}
    (run / "config.json").write_text(json.dumps(doc))
    for steps, out in ((None, tmp_path / "a.png"), (300, tmp_path / "b.png")):
        assert plot_schedule_file(run, steps=steps, out=out) == out and is_matplotlib_png(out)
    extended = Schedule.resolved({**sched, "total_num_steps": 300}, optim)
    steps, lrs = planned_lr(extended, 1e-3)
    want = [
        wsd_closed_form(int(t), peak=1e-3, warm=10, total=300, share=0.2, floor=0, shape="linear")
        for t in steps
    ]
    assert lrs == pytest.approx(want, rel=1e-12) and {240, 241} <= set(steps.tolist())


def test_a_resume_keeps_the_auto_warmup_and_a_plain_relaunch_sees_no_difference():
    """An "auto" warmup (here 0.1 x 100 steps = 10) is kept on a resume whose --max-steps would
    give another (20 at 200 steps); with the same value the note is the fresh one, so the
    relaunch of an unchanged run finds its config.json equal (anneal.config.run)."""
    from anneal.config.run_compare import config_differences

    optim = OptimConfig(warmup_tokens=10**12)  # the cap decides: warmup_max_share x max_steps
    fresh, notes = resolve(optim)
    again, again_notes = resolve(optim, resumed_warmup=10)
    assert fresh == again and notes == again_notes
    assert config_differences({"resolved_from": notes}, {"resolved_from": again_notes}) == []
    longer = dslib.resolve_ds_config(
        dslib.load_ds_config(dslib.find_ds_config("cpu.json")),
        source="cpu.json",
        data_parallel_size=1,
        max_steps=200,
        seq_len=64,
        optim=optim,
        resumed_warmup=10,
    )
    assert longer[0]["scheduler"]["params"]["warmup_num_steps"] == 10
    assert "kept from the run being resumed" in longer[1]["scheduler.params.warmup_num_steps"]


@pytest.mark.slow
def test_wsd_learns_as_well_as_cosine(stdlib_data, tmp_path):
    """Slow (two training processes side by side, 63 s of CPU: the pair must run long enough
    that the schedules, not the first steps, decide the final loss). A WSD run with a 20%
    (1 - sqrt) cooldown to 0 ends with a validation loss no more than 1% above a cosine run (to
    0.1 x peak) of the same length, batch, peak LR, data order and seed, on the stdlib corpus
    (Haegele et al. 2024: such a cooldown matches cosine). Both are scored on the same 512
    held-out windows. Measured: 5.2889 against 5.4424 nats/token (WSD 2.8% lower); the
    demo-sized pair: docs/benchmarks.md."""
    sets = [v for v in SMALL[1::2] if not v.startswith(("train.eval", "ds.gradient_acc"))]
    sets += ["train.val_samples=512", "optim.lr=3e-3", "optim.global_batch_tokens=512"]
    sets += ["ds.train_micro_batch_size_per_gpu=8"]  # 8 x 64 tokens a step, no accumulation
    base = ["--data", str(stdlib_data), "--max-steps", "150", "--val-every", "0"]
    base += ["--save-every", "0", *(a for v in sets for a in ("--set", v))]
    runs = {name: tmp_path / name for name in ("wsd", "cosine")}
    run_recipes(
        [
            {"args": [*base, "--out", str(out), "--set", f"optim.schedule={name}"]}
            for name, out in runs.items()
        ]
    )
    final = {name: read_metrics(out, "val")[-1]["val_loss"] for name, out in runs.items()}
    lrs = {name: _lrs(out)[1] for name, out in runs.items()}
    assert lrs["wsd"][-1] < lrs["cosine"][-1] and lrs["wsd"][75] > lrs["cosine"][75]
    assert final["wsd"] <= 1.01 * final["cosine"], final
