"""Hostile but honest input to a training run (issue 18): the recipe flags and ``--set``, the
ds_config, ``--out``, ``--resume`` and the checkpoints it reads. Each refusal is exit 2 (or the
UserError the entry point turns into exit 2) with one paragraph that names the key, flag or
file and the fix, no traceback, and the tree around it unchanged hash for hash; a refused run
leaves no config.json behind.

- Item 3: ``--resume none`` on a directory that holds a run is refused; ``--restart`` moves that
  run to ``previous-<time>/`` (nothing deleted) and starts over; a save never deletes a
  finished checkpoint that is in its way, it moves it aside.
- Item 5: values that used to pass Anneal's checks and fail at engine start (ZeRO stage 7, a
  NaN or negative LR, a negative size, a resume into another model shape) are refused before
  anything is written, by the same checks in the launcher's pre-flight; a launch that fails
  after writing but before its first step puts the directory back.
- Item 10 (and issue 27): a payload planted in a real checkpoint, with its manifest rewritten to
  match, stops ``--resume auto`` with exit 2 naming the file; the payload never runs (the other
  paths that load a checkpoint: tests/resilience/test_checkpoint_trust.py).
- Item 14: manifest entries and a ``latest`` that lead out of their directory are refused by
  one function, ``anneal.files.confined``.
- Issue 27: an ``--out`` that holds files but no run is refused without ``--force``, and
  ``--force`` leaves those files byte for byte; empty values, paths that are not UTF-8 or too
  long for the file system, and an ``--out`` where no directory can be made (``/proc``) are one
  paragraph naming the flag, not a default taken silently or a traceback.

Most cases resolve the launch in-process (``resolve_launch``, which every rank and the pre-flight
run); one real run is trained once for the session (shared with the export's hostile
cases) and copied.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from anneal.errors import UserError
from anneal.files import confined
from anneal.resilience import checkpoint
from anneal.resilience.resume import read_latest
from tests import planted
from tests.conftest import ROOT, SMALL, env, run_process, run_recipe, tree

RECIPE = "recipes/pretrain_tiny.py"
TAG = "step00000002"


@pytest.fixture
def data(tiny_data) -> Path:
    """The session's tiny prepared corpus (conftest)."""
    return tiny_data


@pytest.fixture
def trained(tiny_run) -> Path:
    """The session's one real run, stopped after step 2 with checkpoints at steps 1 and 2
    (conftest's ``tiny_run``); tests copy it before they change it."""
    return tiny_run


def copy_run(trained: Path, dest: Path) -> Path:
    shutil.copytree(trained, dest, symlinks=True)
    return dest


def plan_for(args: list[str], *, world_size: int = 1):
    """The launch as every rank (and the pre-flight) resolves it, from recipe flags."""
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.resolution.resolve import resolve_launch

    spec = load_recipe(ROOT / RECIPE)
    cfg, overrides = config_from_args(args, prog=RECIPE, on_cpu=True, **spec)
    return resolve_launch(cfg, overrides, world_size=world_size, device_type="cpu")


def refused(args: list[str], *roots: Path, expect: list[str]) -> str:
    """Resolve ``args``; it must raise a UserError holding every string in ``expect`` and
    change nothing under ``roots``."""
    before = tree(*roots)
    with pytest.raises(UserError) as info:
        plan_for(args)
    msg = str(info.value)
    for part in expect:
        assert part in msg, (part, msg)
    assert "Traceback" not in msg and "\n" not in msg
    assert tree(*roots) == before
    return msg


def small(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--out", str(out), "--data", str(data), "--max-steps", "2", *SMALL, *extra]


# --- Item 3: another run in --out ------------------------------------------------------------


def test_resume_none_on_a_directory_that_holds_a_run_is_refused(trained, data, tmp_path):
    out = copy_run(trained, tmp_path / "other")
    msg = refused(
        small(data, out, "--resume", "none", "--set", "optim.lr=1e-3"),
        tmp_path,
        data,
        expect=[f"--out {out} holds a run", "--resume none", "--restart", "--resume auto"],
    )
    assert "config.json" in msg and "checkpoints/" in msg
    # a checkpoint of another run, continued into this directory, would mix the two as well
    elsewhere = copy_run(trained, tmp_path / "elsewhere")
    refused(
        small(data, out, "--resume", str(elsewhere / "checkpoints" / TAG)),
        tmp_path,
        expect=[f"--out {out} holds a run", "--restart"],
    )


def test_restart_moves_the_old_run_aside_and_a_failed_start_puts_it_back(trained, data, tmp_path):
    """``--restart``: the old run's files go to previous-<time>/ unchanged, the new config.json
    is written; if the launch then fails before its first step, what it wrote is removed and
    the relaunch finds the directory free (the old run still aside)."""
    from anneal.rundir import RunDir

    out = copy_run(trained, tmp_path / "run")
    (out / "forecast.json").write_text("{}")  # the launcher's, stays
    old = {k.replace(str(out), ""): v for k, v in tree(out).items()}
    plan = plan_for(small(data, out, "--restart", "--set", "optim.lr=1e-3"))
    assert plan.resume_from is None
    run_dir = RunDir.for_launch(plan)
    [previous] = out.glob("previous-*")
    moved = {k.replace(str(previous), ""): v for k, v in tree(previous).items()}
    for name in ("config.json", "metrics.jsonl", f"checkpoints/{TAG}/manifest.json"):
        assert moved[f"/{name}"] == old[f"/{name}"], name
    assert json.loads((out / "config.json").read_text())["run"]["optim"]["lr"] == 1e-3
    assert list((out / "checkpoints").iterdir()) == []
    run_dir.undo()  # the launch failed before step 1
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["forecast.json", "preempt", previous.name]
    )
    plan_for(small(data, out, "--resume", "none"))  # the corrected relaunch is accepted


def test_restart_cannot_continue_the_run_it_moves_aside(trained, data, tmp_path):
    out = copy_run(trained, tmp_path / "run")
    for resume in ("auto", str(out / "checkpoints" / TAG)):
        refused(
            small(data, out, "--restart", "--resume", resume),
            tmp_path,
            expect=["--restart", "Drop --restart", "drop --resume"],
        )


class _Engine:
    """Writes two small shard files per save, as a ZeRO save does (content varies by call)."""

    calls = 0

    def save_checkpoint(self, save_dir, *, tag, client_state, save_latest):
        _Engine.calls += 1
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        for r in (0, 1):
            (d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(
                bytes([_Engine.calls, r]) * 500
            )


def _save(ckpt: Path, step: int) -> Path:
    client = {"step": step, "tokens": step, "data": {"position": step}}
    return checkpoint.save(_Engine(), ckpt, step=step, client_state=client, keep_last=3)


def test_a_save_moves_a_finished_checkpoint_aside_and_removes_only_a_torn_one(tmp_path, caplog):
    ckpt = tmp_path / "checkpoints"
    first = _save(ckpt, 2)
    before = {k.replace(str(first), ""): v for k, v in tree(first).items()}
    again = _save(ckpt, 2)  # e.g. resumed from an older tag: step 2 is saved a second time
    [aside] = (ckpt / checkpoint.SUPERSEDED).iterdir()
    assert {k.replace(str(aside), ""): v for k, v in tree(aside).items()} == before
    assert "moved to" in caplog.text
    assert checkpoint.verify(again) == []
    assert checkpoint.intact_checkpoints(ckpt) == [again]  # the one aside is never listed
    assert checkpoint.find_resume("auto", ckpt) == again
    torn = ckpt / checkpoint.tag_for(4)
    torn.mkdir()
    (torn / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"half")
    _save(ckpt, 4)  # a save that never finished (no manifest) is simply replaced
    assert len(list((ckpt / checkpoint.SUPERSEDED).iterdir())) == 1
    assert checkpoint.verify(torn) == []


# --- Item 5: everything checked before anything is written -----------------------------------

BAD_VALUES = [
    ("ds.zero_optimization.stage=7", ["zero_optimization.stage is 7", "0, 1, 2 or 3", "--set"]),
    ("optim.lr=nan", ["optim.lr is nan", "finite", "--set optim.lr="]),
    ("optim.lr=-1e-3", ["optim.lr is -0.001", "above 0", "--set optim.lr="]),
    ("optim.lr=inf", ["optim.lr is inf", "finite"]),
    ("model.hidden_size=-256", ["model.hidden_size is -256", "--set model.hidden_size="]),
    ("model.seq_len=-1", ["model.seq_len is -1", "number of tokens", "--set model.seq_len="]),
    ("model.num_hidden_layers=0x10", ["model.num_hidden_layers", "expected int"]),
    ("model.num_attention_heads=3", ["model.hidden_size (64)", "heads (3)", "num_attention_heads"]),
    ("model.num_attention_heads=64", ["even head size", "multiple of 128"]),
    ("model.hidden_size=4611686018427387904", ["model.hidden_size is", "up to 1,048,576"]),
    ("guard.lr_scale=0", ["guard.lr_scale is 0.0", "(0, 1]"]),
    ("guard.lr_scale=1.5", ["guard.lr_scale is 1.5", "(0, 1]"]),
    ("optim.warmup_tokens=-5", ["optim.warmup_tokens is -5", "0 or a positive"]),
    ("optim.warmup_max_share=2", ["optim.warmup_max_share is 2.0", "between 0 and 1"]),
    ("train.seed=-1", ["train.seed is -1 (--seed)", "Pass --seed"]),
    ("train.log_every=0", ["train.log_every is 0", "at least 1"]),
    ("train.collective_timeout_s=nan", ["train.collective_timeout_s is nan", "finite"]),
    ("train.heartbeat_timeout_s=-1", ["train.heartbeat_timeout_s is -1.0", "0 (no heartbeat)"]),
    ("data.prefetch_batches=-3", ["data.prefetch_batches is -3", "1024"]),
    ("ds.optimizer.params.betas=[0.9,1.5]", ["optimizer.params.betas", "[0, 1)", "--set ds."]),
    ("ds.gradient_clipping=NaN", ["'gradient_clipping' is NaN", "finite"]),
    ("ds.optimizer.params.weight_decay=-0.1", ["optimizer.params.weight_decay is -0.1"]),
    ("ds.scheduler.params.warmup_type=log", ['warmup_type is "log"', '"linear"']),
    ("ds.train_micro_batch_size_per_gpu=0", ["train_micro_batch_size_per_gpu is 0"]),
    ("ds.fp16.enabled=true", ["DeepSpeed's own check", "bfloat16 and fp16", "Fix that key"]),
    ("ds.optimizer.params.lr=-1", ["optimizer.params.lr is -1", "above 0"]),
]


@pytest.mark.parametrize("item,expect", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_a_value_that_would_fail_at_engine_start_is_refused_before_writing(
    data, tmp_path, item, expect
):
    extra = ["--set", item]
    if item.startswith("ds.fp16"):
        extra += ["--set", "train.precision=bf16"]  # both on: DeepSpeed's config refuses
    out = tmp_path / "run"
    refused(small(data, out, *extra), tmp_path, data, expect=expect)
    assert not out.exists()


def test_max_steps_past_the_integer_range(data, tmp_path):
    args = small(data, tmp_path / "run")
    args[args.index("--max-steps") + 1] = str(10**30)
    refused(args, tmp_path, expect=["train.max_steps is 1000", "(--max-steps)", "finite"])


def test_resume_into_another_model_shape_is_refused(trained, data, tmp_path):
    source = copy_run(trained, tmp_path / "source")
    tag = source / "checkpoints" / TAG
    for shape in (["--set", "model.hidden_size=128"], ["--set", "model.num_hidden_layers=3"]):
        args = small(data, tmp_path / "new", "--resume", str(tag), *shape)
        msg = refused(args, tmp_path, data, expect=[f"--resume {tag}", "another shape"])
        assert "64 there, 128 here" in msg or "2 there, 3 here" in msg
    # the same shape is accepted, and the manifest is where the shape was read
    assert plan_for(small(data, tmp_path / "new", "--resume", str(tag))).resume_from == tag
    assert not (tmp_path / "new").exists()


def test_the_launchers_preflight_runs_the_same_checks(data, tmp_path):
    from launcher.preflight import preflight

    cases = [
        ("model.hidden_size=-256", "model.hidden_size is -256"),
        ("ds.zero_optimization.stage=7", "zero_optimization.stage is 7"),
    ]
    for item, expect in cases:
        before = tree(tmp_path)
        with pytest.raises(UserError, match=expect):
            preflight(
                recipe=RECIPE,
                recipe_args=small(data, tmp_path / "run", "--set", item),
                world_size=1,
                device_type="cpu",
                mfu=None,
            )
        assert tree(tmp_path) == before


def test_a_launch_that_fails_before_its_first_step_leaves_no_trace(data, tmp_path):
    """Over a new directory and over one the launcher has already written into."""
    from anneal.rundir import RunDir

    fresh = tmp_path / "fresh"
    run_dir = RunDir.for_launch(plan_for(small(data, fresh)))
    assert (fresh / "config.json").is_file()
    (fresh / "metrics.jsonl").write_text("")  # what the loop opens before step 1
    run_dir.undo()
    assert not fresh.exists()

    launched = tmp_path / "launched"
    launched.mkdir()
    (launched / "forecast.json").write_text("{}")
    before = tree(launched)
    run_dir = RunDir.for_launch(plan_for(small(data, launched)))
    (launched / "heartbeat").mkdir()
    run_dir.undo()
    assert tree(launched) == before


# --- Item 10: a planted payload is refused before DeepSpeed unpickles -----------------------


def test_a_planted_payload_stops_resume_auto_and_never_runs(trained, data, tmp_path):
    """The walk round issue 18's scan (a dotted name through an allowed module,
    ``tests/planted.py``) planted in a real checkpoint: the run refuses it before anything
    loads, exit 2; on issue 18's main it ran and the resume went on to exit 0."""
    out = copy_run(trained, tmp_path / "run")
    tag = out / "checkpoints" / TAG
    target = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    marker = tmp_path / "payload-ran"
    planted.plant(target, "dotted", marker)
    assert checkpoint.verify(tag) == []  # only the loader can tell
    before = tree(tmp_path)
    done = run_recipe(small(data, out, "--resume", "auto"), check=False, timeout_s=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert not marker.exists()
    assert str(target) in done.stderr and "weights-only loader refuses" in done.stderr
    assert "does not fall back" in done.stderr and "tampered" in done.stderr
    assert "Traceback" not in done.stderr
    assert tree(tmp_path) == before


# --- Item 14: names read from a checkpoint stay inside it ------------------------------------


@pytest.mark.parametrize("entry", ["../../secret", "/etc/passwd", "link/secret", ".", "a/../.."])
def test_a_manifest_entry_outside_its_directory_is_refused(trained, tmp_path, entry):
    out = copy_run(trained, tmp_path / "run")
    secret = tmp_path / "secret"
    secret.write_text("not a checkpoint")
    tag = out / "checkpoints" / TAG
    (tag / "link").symlink_to(tmp_path)
    manifest = json.loads((tag / checkpoint.MANIFEST).read_text())
    manifest["files"][entry] = {"size": 16, checkpoint.HASH: "0" * 32}
    (tag / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    before = tree(tmp_path)
    with pytest.raises(UserError) as info:
        checkpoint.find_resume("auto", out / "checkpoints")
    msg = str(info.value)
    assert str(tag / checkpoint.MANIFEST) in msg and repr(entry) in msg
    assert "Metadata may only name files inside its own directory" in msg
    assert "use another one" in msg
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name", ["../../other/checkpoints/step00000002", "/tmp", TAG + "/x", ".."])
def test_latest_must_name_a_plain_tag(trained, tmp_path, name):
    out = copy_run(trained, tmp_path / "run")
    (out / "checkpoints" / "latest").write_text(name)
    with pytest.raises(UserError, match="latest") as info:
        checkpoint.find_resume("auto", out / "checkpoints")
    assert "tag" in str(info.value)
    assert read_latest(trained / "checkpoints") == trained / "checkpoints" / TAG


def test_confined(tmp_path):
    (tmp_path / "up").symlink_to(tmp_path.parent)
    assert confined(tmp_path, "zero/a.pt", where="m") == tmp_path / "zero" / "a.pt"
    for bad in ["", ".", "..", "a/../../b", "/etc/passwd", "up/x", "x\0y", 7, None]:
        with pytest.raises(UserError, match="m: the entry"):
            confined(tmp_path, bad, where="m")


# --- More of the recipe surface: garbage in, a clear refusal out ----------------------------

GARBAGE_SETS = [
    ("train.max_step=3", ["train has no key 'max_step'", "did you mean 'max_steps'"]),
    ("optim.learning_rate=1", ["optim has no key", "keys are"]),
    ("trian.max_steps=3", ["unknown section 'trian'", "did you mean 'train'"]),
    ("train.max_steps=many", ["expected int", "such as 100"]),
    ("train.max_steps=" + "9" * 5000, ["expected int", "..."]),
    ("train.wandb=maybe", ["expected true or false"]),
    ("model.preset=huge", ["model.preset 'huge'", "Choose one of tiny"]),
    ("ds.gradient_clipp1ng=1", ["unknown key 'gradient_clipp1ng'", "did you mean"]),
    ("ds.train_micro_batch_size_per_gpu=four", ["must be an integer", '"four"']),
    ("ds.zero_optimization.stage=1e400", ["'zero_optimization.stage' must be an integer"]),
    ("ds.gradient_clipping=1e400", ["'gradient_clipping' is Infinity", "not a finite number"]),
    # issue 27: a path key too long for the file system was an OSError traceback, and an empty
    # model.init_from passed for no model at all
    ("data.path=/tmp/" + "d" * 10_000, ["--set data.path /tmp/ddd", "Give a shorter path"]),
    ("model.init_from=" + "i" * 300, ["--set model.init_from iii", "Give a shorter path"]),
    ("train.branch_from=/" + "b" * 256, ["--set train.branch_from /bbb", "a shorter path"]),
    ("model.init_from=", ["--set model.init_from=: the path is empty", "unset shell variable"]),
]


@pytest.mark.parametrize("item,expect", GARBAGE_SETS, ids=[g[0][:40] for g in GARBAGE_SETS])
def test_set_garbage(data, tmp_path, item, expect):
    refused(small(data, tmp_path / "run", "--set", item), tmp_path, data, expect=expect)
    assert not (tmp_path / "run").exists()


def test_a_ds_config_with_wrong_types_or_bytes(data, tmp_path):
    from anneal.resolution.ds import DS_CONFIG_DIR

    cfg = json.loads((DS_CONFIG_DIR / "cpu.json").read_text())
    cfg["zero_optimization"]["stage"] = "3"
    typed = tmp_path / "typed.json"
    typed.write_text(json.dumps(cfg))
    refused(
        small(data, tmp_path / "run", "--ds-config", str(typed)),
        tmp_path,
        expect=[str(typed), "'zero_optimization.stage' must be an integer"],
    )
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{\x00}")
    refused(
        small(data, tmp_path / "run", "--ds-config", str(binary)),
        tmp_path,
        expect=[str(binary), "not UTF-8"],
    )
    assert not (tmp_path / "run").exists()


def test_resume_from_something_that_is_not_a_checkpoint(trained, data, tmp_path):
    for target in (data, data / "meta.json", trained):
        refused(
            small(data, tmp_path / "run", "--resume", str(target)),
            tmp_path,
            data,
            expect=[f"--resume {target}", "not an intact checkpoint", "'auto'"],
        )
    refused(
        small(data, tmp_path / "run", "--resume", " "),
        tmp_path,
        expect=["--resume is empty", "auto", "none"],
    )


def test_data_that_is_not_prepared(trained, data, tmp_path):
    for bad in (trained, data / "train", tmp_path / "missing"):
        args = small(data, tmp_path / "run")
        args[args.index("--data") + 1] = str(bad)
        refused(args, tmp_path, expect=[f"--data {bad}", "anneal data prepare"])
    assert not (tmp_path / "run").exists()


def test_out_that_must_not_be_written(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("mine")
    cases = [
        (".", "working directory"),
        (str(tmp_path / "a-file"), "a file"),
        (str(data), "which this command reads"),
        (str(data / "run"), "which this command reads"),
    ]
    for out, expect in cases:
        args = small(data, Path(out))
        refused(args, tmp_path, data, expect=[f"--out {out}", expect])
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text('{"model_type": "llama"}')  # not a run's
    refused(
        small(data, tmp_path / "cfg"),
        tmp_path,
        expect=["config.json is not the config of an Anneal run", "new --out"],
    )
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    refused(small(data, tmp_path / "dangling"), tmp_path, expect=["a link to no directory"])
    (tmp_path / "scratch").mkdir()  # a run directory linked to a larger file system is fine
    (tmp_path / "linked").symlink_to(tmp_path / "scratch")
    assert plan_for(small(data, tmp_path / "linked")).out == tmp_path / "linked"


def test_the_recipe_exits_2_with_one_paragraph(data, tmp_path):
    """The entry point end to end, for a refusal before any engine (a few seconds)."""
    proc = run_process(
        [sys.executable, RECIPE, *small(data, tmp_path / "run", "--set", "optim.lr=nan")],
        timeout_s=120,
        cwd=ROOT,
        env=env(),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "optim.lr is nan" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_every_numeric_key_has_a_range():
    import dataclasses

    from anneal.config import run_checks as cfglib

    numeric = {
        f"{name}.{f.name}"
        for name, cls in cfglib._SECTIONS.items()
        for f in dataclasses.fields(cls)
        if f.type in ("int", "float", "float | None")
    }
    assert numeric == set(cfglib._RANGES)


# --- Issue 27: a run writes only its own files; values that are empty, not UTF-8, too long ----


def test_out_with_files_but_no_run_needs_force_and_force_replaces_none(data, tmp_path):
    """A non-empty ``--out`` that holds no run: refused without ``--force`` (the run's
    report.txt used to overwrite the user's file of that name), whatever the files are; the
    launcher's own files alone are no reason. With ``--force`` the launch goes ahead and its
    writes (config.json, checkpoints/) leave the user's files byte for byte, and a failed
    start removes only what it made; a file where the run makes a directory stays refused."""
    from anneal.rundir import RunDir

    out = tmp_path / "mine"
    (out / "plots").mkdir(parents=True)
    (out / "report.txt").write_text("my own report, not a run's\n")
    (out / "plots" / "loss.png").write_bytes(b"\xff\xd8\xff\xe0 a JPEG of mine")
    (out / "forecast.json").write_text("{}")  # the launcher's: not the reason
    msg = refused(
        small(data, out),
        tmp_path,
        data,
        expect=[f"--out {out}", "holds files but no run", "plots, report.txt", "--force"],
    )
    assert "forecast.json" not in msg
    mine = tree(out)
    run_dir = RunDir.for_launch(plan_for(small(data, out, "--force")))
    assert (out / "config.json").is_file() and (out / "checkpoints").is_dir()
    assert {k: v for k, v in tree(out).items() if k in mine} == mine
    run_dir.undo()  # a start that failed before its first step
    assert tree(out) == mine

    launched = tmp_path / "launched"  # what `python -m launcher run|submit` wrote first
    for name in (".deepspeed_env", ".deepspeed_env.runner", "forecast.json", "submit.sbatch"):
        (launched / "logs").mkdir(parents=True, exist_ok=True)
        (launched / name).write_text("")
    assert plan_for(small(data, launched)).out == launched

    (out / "checkpoints").write_text("a file where the run makes a directory")
    refused(
        small(data, out, "--force"),
        tmp_path,
        expect=[f"--out {out}: checkpoints is a file", "Move it away"],
    )


def test_the_launchers_files_are_the_ones_rundir_allows():
    """``anneal.rundir.LAUNCHER_FILES`` names what the launcher writes before the recipe starts
    (the recipe's check above relies on it; the launcher's own constants are the truth)."""
    from anneal.planning import forecast
    from anneal.rundir import LAUNCHER_FILES, PREEMPT
    from launcher import dsenv, watch_job

    written = {dsenv.FILE, dsenv.RUNNER_FILE, forecast.FILE, "submit.sbatch", "hostfile", "logs"}
    written.add(watch_job.WATCH_SCRIPT)  # submit --watch-tasks
    assert set(LAUNCHER_FILES) == written | {PREEMPT}
    template = (ROOT / "launcher" / "templates" / "multinode.sbatch").read_text()
    assert '--out "$RUN_DIR/hostfile"' in template and '"$RUN_DIR/logs"' in template


@pytest.mark.parametrize("flag", ["--out", "--data", "--ds-config", "--max-steps", "--set"])
def test_an_empty_value_is_refused_not_taken_for_the_default(data, tmp_path, flag):
    """``--out ''`` trained into runs/<recipe>, ``--ds-config ''`` used cpu.json, ``--data ''``
    the default corpus: an unset shell variable in a launch script could continue another
    run. Now one paragraph naming the flag, on every rank."""
    args = small(data, tmp_path / "run") + [flag, ""]
    with pytest.raises(UserError) as info:
        plan_for(args)
    msg = str(info.value)
    assert msg.startswith(f"{flag} is empty (an unset shell variable?)") and "\n" not in msg
    assert info.value.every_rank
    assert list(tmp_path.iterdir()) == []


def test_the_recipe_refuses_an_empty_out_as_one_paragraph(data, tmp_path, capsys, monkeypatch):
    """The recipe's entry point, in-process: exit 2, one line, nothing under runs/. (The NaN
    LR stops the launch before any engine wherever the empty value is let through.)"""
    from anneal.cli.recipe import main

    monkeypatch.chdir(tmp_path)
    argv = ["--data", str(data), "--set", "optim.lr=nan"]
    for flag in ("--out", "--ds-config"):
        with pytest.raises(SystemExit) as info:
            main(preset="tiny", ds_config="cpu.json", argv=[*argv, flag, ""])
        err = capsys.readouterr().err
        assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"error: {flag} is empty") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


PATH_FLAGS = ["--out", "--data", "--ds-config", "--resume", "--init-from", "--cooldown-from"]


@pytest.mark.parametrize("flag", PATH_FLAGS)
@pytest.mark.parametrize("kind", ["10,000 characters", "a name of 300", "not UTF-8"])
def test_a_path_too_long_or_not_utf8_is_one_paragraph(data, tmp_path, flag, kind):
    """A path of 10,000 characters (ENAMETOOLONG) was an OSError traceback; one that is not
    UTF-8 (argv bytes kept as surrogates) trained into a directory whose name no message or
    config.json could hold. Now one paragraph naming the flag and the fix."""
    value = {
        "10,000 characters": str(tmp_path / ("a" * 10_000)),
        "a name of 300": str(tmp_path / ("b" * 300)),
        "not UTF-8": str(tmp_path / "caf\udce9"),
    }[kind]
    args = small(data, tmp_path / "run") + [flag, value]
    fix = "Give a shorter path." if "UTF" not in kind else "Rename it with UTF-8 characters"
    msg = refused(args, tmp_path, data, expect=[flag, fix])
    assert len(msg) < 600, msg  # the path is cut short in the message


def test_out_where_no_directory_can_be_made_is_one_paragraph(data):
    """``--out /proc/...``: the parent is a directory and, for root, "writable", but no
    directory can be made there; creating the run directory was a FileNotFoundError
    traceback. Now a paragraph naming --out, at the launch check or at the first write."""
    from anneal.rundir import RunDir

    out = Path("/proc/anneal-run")
    try:
        launch = plan_for(small(data, out))
    except UserError as e:  # not root: refused when the launch is resolved
        msg = str(e)
    else:
        with pytest.raises(UserError) as info:
            RunDir.for_launch(launch)
        msg = str(info.value)
    assert msg.startswith(f"--out {out}: cannot create") and "Choose a place you can write" in msg
    assert not out.exists()
