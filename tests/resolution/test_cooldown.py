"""Cooldown branches (``--cooldown-from``, ``anneal.resolution.cooldown``; docs/training.md).

- The branch's schedule is the closed form: after step S, where the parent's ratio was r, the LR
  decays as ``m + (r - m) * f((t - S) / D)`` to the floor m at S + D, for each shape.
- A branch resolves from a checkpoint of a WSD run (the shared ``tiny_run``, a real 1-rank
  checkpoint, its copy's config.json saying wsd): S + ceil(N / tokens per step) steps, the parent's
  tag as what it loads, its config.json naming the parent run, step and the manifest's sha256;
  on another data directory with the same tokenizer it starts that data at position 0 and says
  so. Each bad input is one paragraph naming the fix (a manifest whose step disagrees with its
  tag, or whose tokens is not a count, included), and the parent is byte-identical after.
- A tag reached through a link (a fake run directory linking to a real tag) is the real
  parent's: an --out inside the real parent is refused, and the lineage names the real run.
- The drill (slow): a real WSD parent and two cooldowns of different lengths from one of its
  checkpoints, run at once; each ends with a validation loss below the parent's at the branch
  step, applies the closed-form LR at every step, names its lineage in its report and draws its
  parent in its charts, and the parent's files hash the same before and after.
"""

import json
import math
import shutil
from pathlib import Path

import pytest

from anneal import rundir
from anneal.config.schedule import Schedule
from anneal.errors import UserError
from anneal.files import is_matplotlib_png, sha256_file
from anneal.observe.formula_plots import plot_schedule_file
from tests.conftest import ROOT, SMALL, read_metrics, run_recipe, run_recipes, tree

SHAPES = {
    "linear": lambda p: 1 - p,
    "1-sqrt": lambda p: 1 - math.sqrt(p),
    "cosine": lambda p: (1 + math.cos(math.pi * p)) / 2,
}


def branch_lr(t, *, peak, start, steps, ratio, floor=0.0, shape="1-sqrt"):
    """docs/training.md's cooldown: from ratio x peak after step ``start`` to floor x peak."""
    p = min(1.0, (t - start) / steps)
    return peak * (floor + (ratio - floor) * SHAPES[shape](p))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("floor,ratio", [(0.0, 1.0), (0.1, 0.6)])
def test_the_branch_schedule_is_the_closed_form(shape, floor, ratio):
    sched = Schedule(
        kind="wsd",
        total_num_steps=150,
        warmup_num_steps=10,
        min_ratio=floor,
        decay_shape=shape,
        cooldown_step=100,
        cooldown_ratio=ratio,
    )
    assert sched.ratio(100) == ratio and sched.decay_start == 100
    for t in (101, 110, 125, 149, 150, 151, 400):
        want = branch_lr(t, peak=1, start=100, steps=50, ratio=ratio, floor=floor, shape=shape)
        assert sched.ratio(t) == pytest.approx(want, rel=1e-12, abs=1e-15), t
    assert "cooldown branch" in sched.describe() and sched.ratio(150) == floor


def plan_for(args: list[str], *, world_size: int = 1):
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.resolution.resolve import resolve_launch

    spec = load_recipe(ROOT / "recipes" / "pretrain_tiny.py")
    cfg, overrides = config_from_args(args, prog="recipes/pretrain_tiny.py", on_cpu=True, **spec)
    return resolve_launch(cfg, overrides, world_size=world_size, device_type="cpu")


@pytest.fixture
def wsd_parent(tiny_run, tmp_path) -> Path:
    """A copy of the shared run (checkpoints at steps 1 and 2 of 4, warmup 2), its config.json
    saying WSD as the run would have written it with --set optim.schedule=wsd."""
    run = Path(shutil.copytree(tiny_run, tmp_path / "parent", symlinks=True))
    doc = json.loads((run / "config.json").read_text())
    doc["run"]["optim"]["schedule"] = "wsd"
    doc["ds_config"]["scheduler"]["params"]["cos_min_ratio"] = 0.0
    (run / "config.json").write_text(json.dumps(doc))
    return run


def branch_args(parent, data, out, *more):
    return ["--out", str(out), "--data", str(data), *SMALL, "--cooldown-from", str(parent), *more]


def test_a_branch_resolves_from_a_wsd_checkpoint(wsd_parent, tiny_data, tmp_path):
    from anneal.data.prepare import prepare

    before = tree(wsd_parent)
    tag = wsd_parent / "checkpoints" / "step00000002"
    n = ["--set", "optim.cooldown_tokens=1000"]  # 512 tokens a step: 2 steps
    launch = plan_for(branch_args(wsd_parent, tiny_data, tmp_path / "b", *n))
    assert launch.tokens_per_step == 512 and launch.cfg.train.max_steps == 4
    assert launch.resume_from == tag and launch.cooldown.same_data
    doc = launch.config_document()["cooldown"]
    assert (doc["parent_run"], doc["checkpoint"], doc["step"]) == (str(wsd_parent), str(tag), 2)
    assert doc["manifest_sha256"] == sha256_file(tag / "manifest.json")
    assert [launch.schedule.ratio(t) for t in (3, 4)] == pytest.approx([1 - math.sqrt(0.5), 0])
    assert "cooldown branch of" in launch.notes[0] and "steps 3 to 4" in launch.notes[0]
    # the same command again (a requeued job) on the branch's config.json: the same launch;
    # a branch from another checkpoint into that --out: refused
    (tmp_path / "b").mkdir()
    rundir.write_config(tmp_path / "b", launch.config_document())
    again = plan_for(branch_args(wsd_parent, tiny_data, tmp_path / "b", *n))
    old_flag = [
        a.replace("--cooldown-from", "--branch-from")
        for a in branch_args(wsd_parent, tiny_data, tmp_path / "b", *n)
    ]
    assert plan_for(old_flag).config_document() == again.config_document()  # its old name
    chart = plot_schedule_file(tmp_path / "b", steps=None, out=tmp_path / "s.png")  # --schedule
    assert is_matplotlib_png(chart)
    assert again.resume_from == tag and again.config_document() == launch.config_document()
    with pytest.raises(UserError, match="holds a run already"):
        plan_for(branch_args(wsd_parent / "checkpoints" / "step00000001", tiny_data, again.out, *n))
    shutil.rmtree(tmp_path / "b")
    # another prepared directory with the parent's tokenizer: read from its start, said so
    other = tmp_path / "other_data"
    (tmp_path / "other.txt").write_text(
        "\n\n".join(f"{i}: a lazy dog sleeps " * 40 for i in range(150))
    )
    prepare(
        inputs=[str(tmp_path / "other.txt")], out=other, tokenizer=tiny_data / "tokenizer.model"
    )
    launch = plan_for(branch_args(tag, other, tmp_path / "b2", *n))
    assert not launch.cooldown.same_data
    client = {"step": 2, "data": {"position": 37}, "guard": {"history": [[2, 5.0]], "x": 1}}
    start = launch.cooldown.client_for(client)
    assert start["data"]["position"] == 0 and start["guard"]["history"] == []
    assert start["guard"]["x"] == 1 and client["data"]["position"] == 37
    own = {**client, "step": 3}  # the branch's own checkpoints: as saved
    assert launch.cooldown.client_for(own) is own
    assert any("position 0" in note for note in launch.notes)
    assert tree(wsd_parent) == before and not (tmp_path / "b").exists()


WORDS = {
    "cosine parent": ["not WSD", "optim.schedule=wsd"],
    "no length": ["optim.cooldown_tokens=N"],
    "out holds a run": ["holds a run already", "new --out"],
    "out inside the parent": ["never writes into its parent"],
    "two ranks": ["ranks 1 there, 2 here", "ZeRO shards are per rank"],
    "another tokenizer": ["another tokenizer", "--tokenizer"],
    "no checkpoint": ["no such directory", "RUN/checkpoints/stepNNNNNNNN"],
    "with --resume": ["--resume and --restart do not apply"],
    "at the floor": ["already at its floor", "stable phase"],
    "a length, no branch": ["not a cooldown branch", "--cooldown-from"],
    "manifest step edited": ["says step 1", "its directory is step00000002", "restore"],
    "tokens not a count": ['tokens is "abc"', "not a count of tokens", "Restore"],
}


def bad_launch(case, *, parent, cosine, data, tmp) -> tuple[list[str], int]:
    """(recipe args, world size) of each bad case; ``parent`` is WSD, ``cosine`` is not."""
    length = ["--set", "optim.cooldown_tokens=1000"]
    out, start, world, more = tmp / "b", parent, 1, length
    if case == "cosine parent":
        start = cosine
    elif case == "no length":
        more = []
    elif case == "out holds a run":
        out = cosine
    elif case == "out inside the parent":
        out = parent / "b"
    elif case == "two ranks":
        world = 2
    elif case == "another tokenizer":  # a tokenizer trained on other text, same vocabulary size
        from anneal.data.prepare import prepare

        (tmp / "t.txt").write_text(
            "\n\n".join(f"{i}: zebras vex jumpy wizards " * 40 for i in range(150))
        )
        data = tmp / "other"
        prepare(inputs=[str(tmp / "t.txt")], out=data, vocab_size=300, progress=False)
    elif case == "no checkpoint":
        start = tmp / "nothing"
    elif case == "with --resume":
        more = [*length, "--resume", "none"]
    elif case == "at the floor":  # the parent's decay ends at step 2, the checkpoint's
        doc = json.loads((parent / "config.json").read_text())
        doc["ds_config"]["scheduler"]["params"].update(total_num_steps=2, warmup_num_steps=1)
        (parent / "config.json").write_text(json.dumps(doc))
    elif case == "a length, no branch":
        start = None
    elif case in ("manifest step edited", "tokens not a count"):  # sizes still match
        start = parent / "checkpoints" / "step00000002"
        path = start / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest.update({"step": 1} if case == "manifest step edited" else {"tokens": "abc"})
        path.write_text(json.dumps(manifest))
        more = [] if case == "tokens not a count" else more  # the message that reads tokens
    args = ["--out", str(out), "--data", str(data), *SMALL, *more]
    return args + (["--cooldown-from", str(start)] if start else []), world


@pytest.mark.parametrize("case", WORDS)
def test_each_bad_branch_is_one_clear_error(case, wsd_parent, tiny_run, tiny_data, tmp_path):
    """Resolution only (no engine): one paragraph with the fix; neither run changes."""
    args, world = bad_launch(case, parent=wsd_parent, cosine=tiny_run, data=tiny_data, tmp=tmp_path)
    before = tree(wsd_parent, tiny_run)
    with pytest.raises(UserError) as e:
        plan_for(args, world_size=world)
    msg = str(e.value)
    assert all(w in msg for w in WORDS[case]) and "\n" not in msg, msg
    assert tree(wsd_parent, tiny_run) == before and not (tmp_path / "b").exists()


def test_a_branch_through_a_linked_tag_is_the_real_parents(wsd_parent, tiny_data, tmp_path):
    """A fake run directory whose checkpoints/step00000002 is a link to the real parent's tag,
    with a config.json of its own: the branch's parent is the run the checkpoint really lies
    in. An --out inside the real parent (its checkpoints/ directory, where the fake parent
    would have let the branch write) is refused naming it, even with --force (which lets a run
    train beside files that are not a run's, as checkpoints/ is); an --out elsewhere records the
    real parent and tag. The real parent's tree is the same before and after."""
    real_tag = wsd_parent / "checkpoints" / "step00000002"
    fake = tmp_path / "fake"
    (fake / "checkpoints").mkdir(parents=True)
    shutil.copy(wsd_parent / "config.json", fake / "config.json")
    (fake / "checkpoints" / "step00000002").symlink_to(real_tag)
    before = tree(wsd_parent)
    n = ["--set", "optim.cooldown_tokens=1000"]
    for given in (fake / "checkpoints" / "step00000002", fake):
        for out in (wsd_parent / "checkpoints", real_tag / "b"):
            with pytest.raises(UserError) as e:
                plan_for(branch_args(given, tiny_data, out, *n, "--force"))
            msg = str(e.value)
            assert f"the parent run {wsd_parent}, and a branch never writes" in msg, msg
        launch = plan_for(branch_args(given, tiny_data, tmp_path / "b", *n))
        doc = launch.config_document()["cooldown"]
        assert (doc["parent_run"], doc["checkpoint"]) == (str(wsd_parent), str(real_tag))
        assert launch.resume_from == real_tag
    assert tree(wsd_parent) == before and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_two_cooldowns_from_one_wsd_run(tiny_data, tmp_path):
    """Slow (three training processes, the branches two at a time, each branch then drawing
    its charts and report in a child process: 54 s of CPU in all; 114 s wall here with five
    workers sharing 2 cores at a load of about 10). The issue's acceptance test for branching."""
    peak, start = 3e-3, 8  # the tiny recipe's optim.lr; the branch step
    parent = tmp_path / "parent"
    common = [*SMALL, "--data", str(tiny_data), "--save-every", "8", "--val-every", "8"]
    run_recipe(
        [*common, "--out", str(parent), "--max-steps", "40", "--set", "optim.schedule=wsd"]
        + ["--set", f"train.stop_at_step={start}"]
    )
    parent_val = {r["step"]: r["val_loss"] for r in read_metrics(parent, "val")}[start]
    before = tree(parent)
    tag = parent / "checkpoints" / f"step{start:08d}"
    lengths = {"short": 2, "long": 5}  # steps of 512 tokens
    runs = {name: tmp_path / name for name in lengths}
    run_recipes(
        [
            {
                "args": [*common, "--out", str(runs[name]), "--cooldown-from", str(tag)]
                + ["--set", f"optim.cooldown_tokens={512 * steps}"]
            }
            for name, steps in lengths.items()
        ],
        parallel=2,
    )
    assert tree(parent) == before  # nothing written into the parent
    for name, steps in lengths.items():
        run = runs[name]
        train = read_metrics(run, "train")
        assert [r["step"] for r in train] == list(range(start + 1, start + steps + 1))
        want = [branch_lr(r["step"], peak=peak, start=start, steps=steps, ratio=1) for r in train]
        assert [r["lr"] for r in train] == pytest.approx(want, rel=1e-9, abs=1e-15)
        final = read_metrics(run, "val")[-1]
        assert final["step"] == start + steps and final["val_loss"] < parent_val, (name, final)
        doc = json.loads((run / "config.json").read_text())["cooldown"]
        assert (doc["parent_run"], doc["step"]) == (str(parent), start)
        assert doc["manifest_sha256"] == sha256_file(tag / "manifest.json")
        report = (run / "report.txt").read_text()
        assert f"branch of {parent} at step {start}" in report
        assert (run / "plots" / "lr.png").is_file() and (run / "plots" / "loss.png").is_file()
