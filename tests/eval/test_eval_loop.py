"""Downstream tasks scored inside the training loop (``train.eval_tasks``): the settings and
their checks, the refusal before launch of a layout the evaluator cannot run in lockstep, the
forecast's share for the scorings, and where a scoring's document goes (metrics.jsonl,
``RUN/evals/step-N.json``, TensorBoard, W&B, the console).

The loop's order around a scoring is proved in tests/train/test_loop.py."""

import dataclasses
import json
import math

import pytest

from anneal.config.run import RunConfig
from anneal.config.run_checks import apply_overrides, check_ranges
from anneal.config.run_compare import config_differences
from anneal.errors import UserError
from anneal.eval import in_loop, results
from tests.conftest import ROOT, parallel_args, resolve_tiny

TINY = str(ROOT / "recipes" / "pretrain_tiny.py")


def doc(step: int = 4, tokens: int = 512, **extra) -> dict:
    """A scoring's document as ``anneal.eval.score.score`` returns it (two tasks)."""
    tasks = {
        "mc": {"metrics": {"acc": 0.5, "acc_stderr": 0.1, "acc_norm": 0.75}, "chance": 0.25},
        "cloze": {"metrics": {"word_perplexity": 31.5}, "chance": None},
    }
    found = {"step": step, "tokens": tokens, "source": "loop", "tasks": tasks, "failed": {}}
    return {**found, "seconds": 1.25, **extra}


# -- the settings ------------------------------------------------------------------------------


def test_the_settings_parse_through_set_and_bad_values_are_refused():
    """``--set train.eval_tasks=a, b,`` is the tuple ("a", "b") (empty: none); a recipe's list
    or comma string becomes the same tuple; a task named twice, an empty name and a negative
    cadence or limit are one paragraph naming the key and its fix."""
    from anneal.config.run import TrainConfig

    cfg = RunConfig(out="x", ds_config="cpu.json")
    sets = ["train.eval_tasks=a, b,", "train.eval_tasks_every=5", "train.eval_tasks_limit=20"]
    train = apply_overrides(cfg, sets).train
    assert (train.eval_tasks, train.eval_tasks_every, train.eval_tasks_limit) == (("a", "b"), 5, 20)
    assert apply_overrides(cfg, ["train.eval_tasks="]).train.eval_tasks == ()
    assert TrainConfig(eval_tasks=["a", "b"]).eval_tasks == TrainConfig(eval_tasks="a,b").eval_tasks
    check_ranges(apply_overrides(cfg, sets))
    for bad, words in [
        (("a", "a"), ["train.eval_tasks", "'a' is given twice", "--set train.eval_tasks="]),
        (("a", " "), ["train.eval_tasks", "is not a name"]),
    ]:
        wrong = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_tasks=bad))
        with pytest.raises(UserError) as caught:
            check_ranges(wrong)
        assert all(w in str(caught.value) for w in words), caught.value
    for key in ("train.eval_tasks_every", "train.eval_tasks_limit"):
        with pytest.raises(UserError, match=f"{key} is -1: it must be 0"):
            check_ranges(apply_overrides(cfg, [f"{key}=-1"]))


def test_the_tasks_may_change_between_launches_of_one_run():
    """A resume may add, drop or re-time the tasks (scoring changes nothing of the training),
    and the tasks as config.json reads them back (a list) equal the launch's tuple."""
    cfg = apply_overrides(RunConfig(out="x", ds_config="cpu.json"), ["train.eval_tasks=a"])
    old = json.loads(json.dumps({"run": cfg.to_dict()}))
    assert config_differences(old, {"run": cfg.to_dict()}) == []
    other = apply_overrides(cfg, ["train.eval_tasks=a,b", "train.eval_tasks_every=7"])
    assert config_differences(old, {"run": other.to_dict()}) == []
    del old["run"]["train"]["eval_tasks"]  # a run from before the setting
    assert config_differences(old, {"run": cfg.to_dict()}) == []


# -- before launch -------------------------------------------------------------------------------


def test_sequence_parallelism_is_refused_before_launch(tiny_data, tmp_path):
    """Tasks under Ulysses (SP=2) are refused by the launcher's pre-flight, before anything is
    written, in one paragraph naming the key, the reason and the fixes; the same launch
    without tasks resolves."""
    from launcher import preflight

    out = tmp_path / "run"
    args = parallel_args(tiny_data, out, layout="ds.sequence_parallel_size=2", accum=2, stage=2)
    with_tasks = [*args, "--set", "train.eval_tasks=anneal_next_line"]
    with pytest.raises(UserError) as caught:
        preflight.preflight(
            recipe=TINY, recipe_args=with_tasks, world_size=2, device_type="cpu", mfu=0.5
        )
    msg = str(caught.value)
    for words in (
        "train.eval_tasks (anneal_next_line) on 2 ranks = sequence-parallel 2",
        "does not run under sequence parallelism (ds.sequence_parallel_size=2)",
        "no train.eval_tasks, then evaluate its checkpoints with `anneal eval RUN --tasks",
    ):
        assert words in msg, msg
    assert caught.value.every_rank and not out.exists()
    in_loop.check_launch(resolve_tiny(args, world_size=2))  # no tasks: nothing to refuse


def test_every_rank_refuses_a_bad_spec_before_anything_is_written(tiny_data, tmp_path):
    """A rank started without the launcher resolves its launch with the same check
    (``anneal.train.engine.resolve_run``): a task YAML that is not there is one paragraph,
    raised alike on every rank, before the run directory exists."""
    from anneal.cli.recipe import config_from_args
    from anneal.train.engine import resolve_run

    out, missing = tmp_path / "run", tmp_path / "task.yaml"
    argv = ["--data", str(tiny_data), "--out", str(out), "--set", f"train.eval_tasks={missing}"]
    cfg, overrides = config_from_args(
        argv, prog=TINY, preset="tiny", ds_config="cpu.json", on_cpu=True
    )
    with pytest.raises(UserError) as caught:
        resolve_run(cfg, overrides)
    assert f"train.eval_tasks: task spec {missing}: no such file" in str(caught.value)
    assert caught.value.every_rank and not out.exists()


def test_a_task_loaded_on_some_ranks_only_is_scored_on_none(monkeypatch):
    """Lockstep needs the same request lists on every rank: a task that did not load on every
    rank (as ``all_gather`` reports each rank's tasks) is dropped into ``failed``, naming the
    ranks without it; the others stay."""
    from anneal.eval.tasks import LoadedTasks

    loaded = LoadedTasks(tasks={"a": object(), "b": object()}, info={}, failed={})
    monkeypatch.setattr(in_loop, "all_gather", lambda mine: [mine, ["a"], ["a", "b"]])
    in_loop._agree(loaded)
    assert set(loaded.tasks) == {"a"}
    assert loaded.failed == {"b": "did not load on rank(s) [1], so no rank scores it"}


# -- the forecast --------------------------------------------------------------------------------


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def test_the_number_of_scorings_is_the_loops():
    """``passes`` counts the scorings the loop makes from the start (the baseline at step 0 of
    a fresh run, then each multiple of ``every`` and the last step), by brute force over
    starts, ends and cadences."""
    for start in range(0, 12):
        for last in range(1, 25):
            for every in range(0, 9):
                want = sum(_due(s, every, last) for s in range(start + 1, last + 1))
                want += start == 0 and last > start  # the baseline
                assert in_loop.passes(start_step=start, max_steps=last, every=every) == want


def test_the_forecast_counts_the_scorings(tiny_data, tmp_path):
    """The launcher's forecast adds the scorings' forward passes (a third of the training FLOPs
    per token) to the time left and says so; without tasks it is the time of the steps alone."""
    from anneal.model import flops_per_token
    from anneal.planning import forecast

    args = ["--data", str(tiny_data), "--out", str(tmp_path / "r"), "--max-steps", "10"]
    tasks = ["--set", "train.eval_tasks=a,b", "--set", "train.eval_tasks_every=4"]
    tasks += ["--set", "train.eval_tasks_limit=50"]
    plain = resolve_tiny(args, world_size=1)
    scored = resolve_tiny([*args, *tasks], world_size=1)
    eval_tokens = in_loop.forecast_tokens(scored.cfg.train, start_step=0)
    assert eval_tokens == 4 * 2 * 50 * in_loop.TOKENS_PER_ITEM  # steps 0, 4, 8 and 10
    assert in_loop.forecast_tokens(plain.cfg.train, start_step=0) == 0
    common = dict(
        preset=scored.preset,
        ds_config=scored.ds_config,
        tokens_per_step=scored.tokens_per_step,
        world_size=1,
        max_steps=10,
        start_step=0,
        mfu=0.5,
        peak_flops=1e12,
    )
    without, with_ = forecast.make(**common), forecast.make(**common, eval_tokens=eval_tokens)
    flops = flops_per_token(scored.preset, seq_len=scored.seq_len)
    assert with_.eval_s == pytest.approx(flops / 3 * eval_tokens / (0.5 * 1e12))
    assert with_.remaining_s == pytest.approx(without.remaining_s + with_.eval_s)
    assert "scoring train.eval_tasks" in forecast.describe(with_)
    assert "scoring" not in forecast.describe(without)


# -- where a scoring goes ------------------------------------------------------------------------


def test_a_scoring_goes_to_metrics_evals_and_the_console(tmp_path, capsys):
    """``Metrics.on_eval``: the row of ``results.metrics_row`` in metrics.jsonl, the document
    in ``RUN/evals/step-N.json`` (read back whole) and one console line with each task's
    headline metric, its chance, the failed tasks and the time."""
    from anneal.observe.metrics import MetricsLogger
    from anneal.rundir import read_evals, read_metrics
    from anneal.train.observers import Metrics

    scored = doc(failed={"broken": "KeyError: 'choices'"})
    metrics = Metrics(MetricsLogger(tmp_path, tensorboard=False), run_dir=tmp_path)
    metrics.on_eval(scored)
    metrics.close()
    assert read_metrics(tmp_path, "eval") == [results.metrics_row(scored)]
    assert read_evals(tmp_path) == [scored]
    line = capsys.readouterr().out.strip()
    assert line == (
        "step      4 | eval cloze word_perplexity 31.5000, mc acc_norm 0.7500 (chance 0.25), "
        "broken failed | 1.2 s"
    )


def test_a_scoring_reaches_tensorboard_against_tokens(tmp_path):
    """TensorBoard gets every ``eval/<task>/<metric>`` of the row, and the time as
    ``eval/eval_s``, at the tokens trained on; train rows keep their step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from anneal.observe.metrics import MetricsLogger
    from anneal.rundir import tb_dir

    logger = MetricsLogger(tmp_path)
    logger.write({"kind": "train", "step": 4, "loss": 2.0})
    logger.write(results.metrics_row(doc(step=4, tokens=512)))
    logger.close()
    events = EventAccumulator(str(tb_dir(tmp_path)))
    events.Reload()
    got = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}
    assert got == {
        "train/loss": [(4, 2.0)],
        "eval/mc/acc": [(512, 0.5)],
        "eval/mc/acc_stderr": [(512, pytest.approx(0.1))],
        "eval/mc/acc_norm": [(512, 0.75)],
        "eval/cloze/word_perplexity": [(512, 31.5)],
        "eval/eval_s": [(512, 1.25)],
    }


class WandbRun:
    """What WandbSink asks of a wandb run, recorded (wandb is not installed here)."""

    def __init__(self):
        self.defined, self.logged = [], []

    def define_metric(self, name, step_metric=None):
        self.defined.append((name, step_metric))

    def log(self, data, step):
        self.logged.append((step, data))


def test_a_scoring_reaches_wandb_against_tokens(tmp_path):
    """W&B gets the row's metrics under ``eval/`` at the run's step, with ``eval/tokens``
    declared once as their x axis."""
    from anneal.observe.progress import WandbSink

    sink = WandbSink(tmp_path, config={}, enabled=False)
    sink._run = run = WandbRun()
    row = results.metrics_row(doc(step=4, tokens=512))
    sink.log(row)
    sink.log({**row, "step": 8, "tokens": 1024})
    assert run.defined == [("eval/tokens", None), ("eval/*", "eval/tokens")]
    assert run.logged[0] == (
        4,
        {
            "eval/cloze/word_perplexity": 31.5,
            "eval/mc/acc": 0.5,
            "eval/mc/acc_norm": 0.75,
            "eval/mc/acc_stderr": 0.1,
            "eval/eval_s": 1.25,
            "eval/tokens": 512,
        },
    )
    assert run.logged[1][0] == 8 and run.logged[1][1]["eval/tokens"] == 1024


def test_the_headline_metric():
    """acc_norm before acc, then the perplexities; else the first metric that is not a
    stderr; none: no name."""
    from anneal.train.observers import headline

    assert headline({"acc": 0.5, "acc_norm": 0.6}) == ("acc_norm", 0.6)
    assert headline({"acc": 0.5, "acc_stderr": 0.1}) == ("acc", 0.5)
    assert headline({"zeta_stderr": 1.0, "f1": 0.3}) == ("f1", 0.3)
    name, value = headline({"acc_stderr": 0.1})
    assert name is None and math.isnan(value)


# -- a scoring on the real engine ----------------------------------------------------------------


def write_tasks(directory) -> list[str]:
    """Two local multiple-choice task YAMLs over one JSONL file; their paths. ``mc_local``
    scores; ``mc_broken`` loads (lm-eval renders the first document's prompt at load, and
    ``load_tasks`` every document's choices) and raises at scoring time, when its third
    document's prompt is rendered."""
    directory.mkdir(parents=True, exist_ok=True)
    data_file = directory / "mc.jsonl"
    rows = [
        {"question": "doc 1: the quick", "choices": ["brown", "red", "blue", "green"]},
        {"question": "the quick brown", "choices": ["fox", "dog", "cat", "cow"]},
        {"question": "fox jumps the", "choices": ["quick", "slow", "fast", "late"]},
        {"question": "doc 2: the", "choices": ["quick", "lazy", "old", "big"]},
    ]
    data_file.write_text("".join(json.dumps({**r, "answer": 0}) + "\n" for r in rows))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data_file}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_choice: choices\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    broken = "{{ question if question != 'fox jumps the' else question.missing.field }}"
    texts = {"mc_local": "{{question}}", "mc_broken": broken}
    for name, text in texts.items():
        (directory / f"{name}.yaml").write_text(f'task: {name}\ndoc_to_text: "{text}"\n{common}')
    return [str(directory / f"{name}.yaml") for name in texts]


def _tensors(obj) -> list:
    """Every tensor in a nest of dicts, lists and tuples, in a fixed order."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj.detach().clone()]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


class Events:
    def __init__(self):
        self.told = []

    def on_event(self, step, event, **fields):
        self.told.append((step, event, fields))


def test_a_scoring_changes_nothing_of_the_training(tiny_data, world_of_one, tmp_path):
    """On the real engine (1 rank, ZeRO-1, after one step): scoring a task that scores and one
    that raises at scoring time leaves every weight, the optimizer's whole state, python's,
    numpy's and torch's generators, the engine's train mode and the data position as they
    were; the failing task is in the document's ``failed`` and told as one ``eval_failed``
    event (4 to 6 s here: building the engine, importing lm-eval)."""
    import random

    import numpy as np
    import torch

    from anneal.cli.recipe import config_from_args
    from anneal.data.stream import PackedSplit, TokenStream
    from anneal.eval.lm import EngineLM
    from anneal.eval.tasks import load_tasks
    from anneal.train import StepShape, TrainState, build_engine, resolve_run, train_step
    from anneal.train.engine import data_replica
    from tests.conftest import SMALL

    argv = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), *SMALL]
    argv += ["--set", "ds.zero_optimization.stage=1", "--set", "ds.gradient_accumulation_steps=1"]
    cfg, overrides = config_from_args(
        argv, prog=TINY, preset="tiny", ds_config="cpu.json", on_cpu=True
    )
    launch = resolve_run(cfg, overrides)
    engine = build_engine(launch)
    stream = TokenStream(
        PackedSplit(tiny_data, "train", seq_len=launch.seq_len),
        **dict(seed=0, rank=0, world_size=1, micro_batch=launch.micro_batch, prefetch=0),
    )
    train_step(engine, stream, TrainState(), StepShape.of(launch))
    specs = write_tasks(tmp_path / "tasks")
    loaded = load_tasks(specs, data_dir=tiny_data, work_dir=tmp_path, num_fewshot=None, limit=None)
    lm = EngineLM(
        engine,
        tiny_data,
        replica=data_replica(engine),
        batch_size=launch.micro_batch,
        max_length=launch.seq_len,
    )
    weights = _tensors(dict(engine.module.named_parameters()))
    optimizer = _tensors(engine.optimizer.state_dict())
    generators = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    position = stream.position

    events = Events()
    doc = in_loop.InLoop(lm, loaded, limit=None, events=events).score(step=1, tokens=64)

    assert set(doc["tasks"]) == {"mc_local"} and set(doc["failed"]) == {"mc_broken"}
    assert doc["tasks"]["mc_local"]["n_samples"] == 4 and lm.tokens_scored > 0
    assert events.told == [
        (1, "eval_failed", {"task": "mc_broken", "error": doc["failed"]["mc_broken"]})
    ]
    assert "UndefinedError" in doc["failed"]["mc_broken"]
    after = _tensors(dict(engine.module.named_parameters()))
    assert len(after) == len(weights) and all(map(torch.equal, after, weights))
    after = _tensors(engine.optimizer.state_dict())
    assert len(after) == len(optimizer) > 0 and all(map(torch.equal, after, optimizer))
    assert random.getstate() == generators[0]
    assert (np.random.get_state()[1] == generators[1]).all()
    assert torch.equal(torch.get_rng_state(), generators[2])
    assert engine.module.training and stream.position == position


# -- in the loop, on 2 ranks ---------------------------------------------------------------------

STEPS = 4
LAYOUTS = {
    "zero3": ["--set", "ds.zero_optimization.stage=3"],
    "tp2": ["--set", "ds.tensor_parallel.autotp_size=2", "--set", "ds.zero_optimization.stage=1"],
}


@pytest.fixture(scope="module")
def loop_runs(tiny_data, tmp_path_factory) -> dict:
    """Four 2-rank runs of STEPS steps on ``tiny_data`` with SMALL shapes (validated at the
    last step, saved only there), one after another: ZeRO-3 and TP=2 (ZeRO-1), each with
    ``train.eval_tasks`` (``mc_local`` and ``mc_broken`` of ``write_tasks``, scored every 3
    steps: at steps 3 and 4, the last; and ``anneal_next_line``, which ``tiny_data``'s val
    split, with no Python function in it, cannot build) and without. {name: (run directory,
    finished process)}."""
    from tests.conftest import SMALL, run_recipe

    tmp = tmp_path_factory.mktemp("eval_loop")
    specs = write_tasks(tmp / "tasks")
    specs = ",".join(["anneal_next_line", *specs])
    tasks = ["--set", f"train.eval_tasks={specs}", "--set", "train.eval_tasks_every=3"]
    common = ["--data", str(tiny_data), "--max-steps", str(STEPS), "--val-every", str(STEPS)]
    common += ["--save-every", "0", *SMALL]
    runs = {}
    for layout, sets in LAYOUTS.items():
        for name, extra in ((f"{layout}_evals", tasks), (layout, [])):
            args = ["--out", str(tmp / name), *common, *sets, *extra]
            runs[name] = (tmp / name, run_recipe(args, ranks=2, timeout_s=300))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scoring_in_the_loop_changes_nothing_and_a_failing_task_is_recorded(loop_runs, layout):
    """Slow: four 2-rank launches shared by the module (about a minute each on 2 busy cores).
    Under ZeRO-3 and under TP=2, the run that scores its tasks before its first step (the
    baseline) and at steps 3 and 4 finishes (no
    rank waits on another: lockstep) with every train row's loss, grad norm, LR and tokens and
    the validation's loss bitwise those of the same run without tasks; ``mc_local`` is scored
    at each (metrics rows, ``evals/step-N.json``, console lines); ``anneal_next_line``,
    which fails to load, is an ``eval_failed`` event at the start, and ``mc_broken``, which
    raises at scoring time, one at each scoring, while training went on to its last step."""
    from anneal.rundir import read_evals, read_metrics

    run, done = loop_runs[f"{layout}_evals"]
    plain, _ = loop_runs[layout]
    train, ref = read_metrics(run, "train"), read_metrics(plain, "train")
    assert [r["step"] for r in train] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for row, want in zip(train, ref, strict=True):
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert row[key] == want[key], (row["step"], key)
    (val,), (val_ref,) = read_metrics(run, "val"), read_metrics(plain, "val")
    assert val["val_loss"] == val_ref["val_loss"]

    docs = read_evals(run)
    assert [d["step"] for d in docs] == [0, 3, STEPS] and read_evals(plain) == []
    for d in docs:
        assert set(d["tasks"]) == {"mc_local"}
        assert set(d["failed"]) == {"mc_broken", "anneal_next_line"}
        tokens = train[d["step"] - 1]["tokens"] if d["step"] else 0
        assert d["source"] == "loop" and d["tokens"] == tokens
        assert d["tasks"]["mc_local"]["n_samples"] == 4
    rows = read_metrics(run, "eval")
    assert rows == [results.metrics_row(d) for d in docs]
    failed = [r for r in read_metrics(run, "event") if r["event"] == "eval_failed"]
    assert [(r["step"], r["task"]) for r in failed] == [
        (0, "anneal_next_line"),
        (0, "mc_broken"),
        (3, "mc_broken"),
        (STEPS, "mc_broken"),
    ]
    assert "UndefinedError" in failed[1]["error"] and failed[0]["error"], failed
    assert done.stdout.count("| eval mc_local acc_norm") == 3, done.stdout[-3000:]


def test_pre_flight_refuses_a_bad_spec_and_forecasts_the_scorings(tiny_data, tmp_path):
    """The launcher's pre-flight: a task YAML that is not there is refused in one paragraph
    naming the key and the path, before anything is written; good specs put their scorings
    into the forecast it prints (``forecast_tokens`` of the launch)."""
    from anneal.planning import forecast
    from launcher import preflight

    out = tmp_path / "run"
    args = ["--data", str(tiny_data), "--out", str(out), "--max-steps", "10"]
    missing = tmp_path / "nowhere" / "task.yaml"
    with pytest.raises(UserError) as caught:
        preflight.preflight(
            recipe=TINY,
            recipe_args=[*args, "--set", f"train.eval_tasks={missing}"],
            world_size=1,
            device_type="cpu",
            mfu=0.5,
        )
    assert f"train.eval_tasks: task spec {missing}: no such file" in str(caught.value)
    assert caught.value.every_rank and not out.exists()
    specs = write_tasks(tmp_path / "tasks")
    tasks = ["--set", f"train.eval_tasks={','.join(specs)}", "--set", "train.eval_tasks_every=5"]
    done = preflight.preflight(
        recipe=TINY, recipe_args=[*args, *tasks], world_size=1, device_type="cpu", mfu=0.5
    )
    want = in_loop.forecast_tokens(done.launch.cfg.train, start_step=0)
    assert done.forecast.eval_tokens == want == 3 * 2 * in_loop.ITEMS_PER_TASK * 213  # 0, 5, 10
    assert f"about {want:,} forward tokens" in forecast.describe(done.forecast)
    assert not out.exists()
