"""Downstream scoring over Anneal's engine (``anneal.eval.lm``, ``anneal.eval.score``) gives what
lm-eval's own ``HFLM`` gives on the same weights as a Hugging Face model.

One real engine (the tiny recipe's model at SMALL shapes, ZeRO-3, a world of one, trained a few
steps in-process so that its choices are not ties) is scored on local tasks written here (JSONL
and YAML, offline, loaded by ``anneal.eval.tasks.load_tasks``): two multiple-choice tasks, a
loglikelihood cloze task and a rolling-perplexity task with documents longer than the context.
The same weights, saved as a checkpoint of the run and exported by ``anneal.hf.export``, are
scored by ``HFLM``: every request's log-likelihood agrees within 1e-4 and acc / acc_norm
exactly (rolling windows against HFLM without its logits cache, whose slice is wrong where a
group's continuations differ in length). Around it: the generators' states and the train mode
come back as they were, a failing task is recorded and the others score, generation and
sequence parallelism are refused with their reason, and on 2 ranks (ZeRO-3,
``tests/scripts/eval_lockstep.py``) both ranks call forward the same number of times and score
what one replica scores. About 11 s for the quick tests (the engine, 30 steps and the export
once for the file), 15 s for the 2-rank one (slow).

The tests that need the module's trained engine and its export are marked ``slow`` (make
test-all, CI): about 16 s once, which the quick suite's 3 minutes have no room for.
"""

from __future__ import annotations

import json
import random
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from anneal.errors import UserError
from anneal.eval.lm import EngineLM, unsupported_layout
from anneal.eval.score import rng_restored, score
from tests.conftest import ROOT, SMALL, env, launch, resolve_tiny, run_process

MAX_LENGTH = 64  # SMALL's seq_len: the model's context
TRAIN_STEPS = 30


@pytest.fixture(scope="module")
def trained(world_of_one, tiny_data, tmp_path_factory):
    """(engine, its export): the tiny recipe's model at SMALL shapes, ZeRO-3 on one rank, after
    ``TRAIN_STEPS`` optimizer steps on ``tiny_data``, saved as a checkpoint of its run
    directory and exported by Anneal's exporter (``anneal.hf.export``, fp32, verified)."""
    import dataclasses

    from anneal import rundir
    from anneal.data.stream import PackedSplit, TokenStream
    from anneal.hf.export import export
    from anneal.resilience import checkpoint
    from anneal.train import StepShape, TrainState, build_engine, train_step

    tmp = tmp_path_factory.mktemp("eval_lm")
    args = ["--out", str(tmp / "run"), "--data", str(tiny_data), "--max-steps", "100", *SMALL]
    launch = resolve_tiny(args, world_size=1)
    engine = build_engine(launch)
    rundir.RunDir.for_launch(launch)  # config.json, as a launch writes it
    split = PackedSplit(tiny_data, "train", seq_len=launch.seq_len)
    stream = TokenStream(
        split, seed=1, rank=0, world_size=1, micro_batch=launch.micro_batch, prefetch=0
    )
    state, shape = TrainState(), StepShape.of(launch)
    for _ in range(TRAIN_STEPS):
        train_step(engine, stream, state, shape)
    checkpoint.save(
        engine,
        rundir.checkpoints_dir(launch.out),
        step=state.step,
        client_state={**state.state_dict(), "data": stream.state_dict()},
        keep_last=1,
        model=dataclasses.asdict(launch.preset),
    )
    export(launch.out, out=tmp / "hf", dtype="fp32")
    return engine, tmp / "hf"


def write_tasks(root: Path) -> list[str]:
    """Local tasks over local JSONL, as a user writes them: two multiple-choice tasks (one-word
    choices; choices of different lengths, so that acc and acc_norm can differ), a cloze
    task (the last word of a line) and a rolling-perplexity task (documents of 2 to 4 windows
    of the context). Returns their names."""
    words = ["fox", "cat", "jumps", "quick", "brown", "the", "dog", "doc"]
    rng = random.Random(5)
    mc_a, mc_b, cloze, rolling = [], [], [], []
    for i in range(14):
        choices = [" fox", *rng.sample([f" {w}" for w in words if w != "fox"], 3)]
        rng.shuffle(choices)
        mc_a.append(
            {"q": f"doc {i}: the quick brown", "choices": choices, "gold": choices.index(" fox")}
        )
        long = [" jumps the quick brown", " jumps", " cat", " the lazy dog barks"]
        mc_b.append({"q": f"doc {i + 20}: the quick brown fox", "choices": long, "gold": i % 4})
        cloze.append({"text": f"doc {i}: the quick brown fox jumps the quick {rng.choice(words)}"})
        rolling.append({"text": f"doc {i}: " + "the quick brown fox jumps " * (8 + 6 * (i % 3))})
    tasks = {
        "tiny_mc_a": (mc_a, "multiple_choice", "{{q}}", "{{gold}}", "choices", ["acc", "acc_norm"]),
        "tiny_mc_b": (mc_b, "multiple_choice", "{{q}}", "{{gold}}", "choices", ["acc", "acc_norm"]),
        "tiny_cloze": (
            cloze,
            "loglikelihood",
            "{{text.split(' ')[:-1]|join(' ')}}",
            "{{' ' + text.split(' ')[-1]}}",
            None,
            ["perplexity", "acc"],
        ),
        "tiny_rolling": (rolling, "loglikelihood_rolling", "", "{{text}}", None, []),
    }
    root.mkdir(parents=True, exist_ok=True)
    for name, (rows, kind, text, target, choices, metrics) in tasks.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        yaml = [
            f"task: {name}",
            "dataset_path: json",
            "dataset_kwargs:",
            f"  data_files: {{test: {json.dumps(str(data))}}}",
            f"  cache_dir: {json.dumps(str(root / 'hf_cache'))}",
            "test_split: test",
            f"output_type: {kind}",
            f"doc_to_text: {json.dumps(text)}",
            f"doc_to_target: {json.dumps(target)}",
        ]
        if choices:
            yaml.append(f'doc_to_choice: "{{{{{choices}}}}}"')
        if kind == "loglikelihood_rolling":
            yaml.append("doc_to_decontamination_query: '{{text}}'")
        if metrics:
            yaml.append("metric_list:")
            for m in metrics:
                agg, better = ("perplexity", "false") if m == "perplexity" else ("mean", "true")
                yaml.append(f"  - {{metric: {m}, aggregation: {agg}, higher_is_better: {better}}}")
        (root / f"{name}.yaml").write_text("\n".join(yaml) + "\n")
    return list(tasks)


def load(root: Path, names: list[str], *extra: str):
    """The tasks ``names`` (YAML files under ``root``) and the ``extra`` specs through
    ``anneal.eval.tasks.load_tasks``, as ``anneal eval`` and the loop load them."""
    from anneal.eval.tasks import load_tasks

    specs = [*(str(root / f"{n}.yaml") for n in names), *extra]
    return load_tasks(specs, data_dir=None, work_dir=root, num_fewshot=None, limit=None)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> tuple[Path, list[str]]:
    """(directory, names) of ``write_tasks``'s tasks, with ``HF_DATASETS_OFFLINE=1`` set."""
    monkey = pytest.MonkeyPatch()
    monkey.setenv("HF_DATASETS_OFFLINE", "1")
    root = tmp_path_factory.mktemp("tasks")
    names = write_tasks(root)
    yield root, names
    monkey.undo()


def per_request(doc: dict) -> dict[str, dict[int, list[float]]]:
    """{task: {doc_id: [log-likelihood of each request]}} from a document's samples."""
    out = {}
    for task, samples in doc["samples"].items():
        out[task] = {}
        for s in samples:
            values = []
            for resp in s["resps"]:
                r = resp[0]
                values.append(float(r[0] if isinstance(r, tuple | list) else r))
            out[task][s["doc_id"]] = values
    return out


HFLM_ARGS = dict(device="cpu", dtype="float32", batch_size=3, max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def scored(trained, task_dir) -> dict:
    """Anneal's document ("ours"), HFLM's ("hflm") and HFLM's without its logits cache
    ("hflm_nocache") over the same tasks and weights, and the EngineLM ("lm")."""
    from lm_eval.models.huggingface import HFLM

    engine, hf_dir = trained
    root, names = task_dir
    lm = EngineLM(engine, hf_dir, replica=(0, 1), batch_size=4, max_length=MAX_LENGTH)
    kw = dict(step=TRAIN_STEPS, tokens=None, limit=None, num_fewshot=None, source="loop")
    out = {"lm": lm, "ours": score(lm, load(root, names), samples=True, **kw)}
    for key, extra in (("hflm", {}), ("hflm_nocache", {"logits_cache": False})):
        reference = HFLM(pretrained=str(hf_dir), **HFLM_ARGS, **extra)
        out[key] = score(reference, load(root, names), samples=True, **kw)
    return out


def assert_same_scores(ours: dict, theirs: dict, tasks: list[str]) -> None:
    """Per-request log-likelihoods within 1e-4, acc and acc_norm exactly equal."""
    mine, ref = per_request(ours), per_request(theirs)
    for task in tasks:
        assert mine[task].keys() == ref[task].keys(), task
        for doc_id, values in mine[task].items():
            assert np.allclose(values, ref[task][doc_id], atol=1e-4, rtol=0), (task, doc_id)
        for metric in ("acc", "acc_norm"):
            if metric in theirs["tasks"][task]["metrics"]:
                assert (
                    ours["tasks"][task]["metrics"][metric]
                    == (theirs["tasks"][task]["metrics"][metric])
                ), (task, metric)


@pytest.mark.slow  # the module's trained run and export: about 16 s once
def test_scores_equal_hflms_on_the_exported_weights(scored):
    """Two multiple-choice tasks and a cloze task: every request's log-likelihood within 1e-4
    of HFLM's and acc / acc_norm exactly equal. The model learned something (acc well above
    chance on the first task, and acc != acc_norm there), so equal accuracies are not ties."""
    ours, theirs = scored["ours"], scored["hflm"]
    assert ours["failed"] == {} and theirs["failed"] == {}, (ours["failed"], theirs["failed"])
    assert set(ours["tasks"]) == {"tiny_mc_a", "tiny_mc_b", "tiny_cloze", "tiny_rolling"}
    assert_same_scores(ours, theirs, ["tiny_mc_a", "tiny_mc_b", "tiny_cloze"])
    mc_a = ours["tasks"]["tiny_mc_a"]["metrics"]
    assert mc_a["acc"] > 0.5 and mc_a["acc"] != mc_a["acc_norm"]


@pytest.mark.slow  # the module's trained run and export: about 16 s once
def test_rolling_windows_equal_hflms_own_computation(scored):
    """Rolling perplexity over documents of 2 to 4 context windows: every document's
    log-likelihood within 1e-4 of HFLM's with ``logits_cache=False``, and word perplexity with
    it. HFLM's default differs on these documents: its logits cache groups a document's last
    window with another's middle window when their tokens agree, and then reads the shorter
    continuation's log-probabilities from the first positions of the longer one's (lm-eval
    0.4.13, ``_loglikelihood_tokens``); EngineLM reads the last positions, which predict it."""
    ours, plain, cached = scored["ours"], scored["hflm_nocache"], scored["hflm"]
    assert_same_scores(ours, plain, ["tiny_rolling"])
    rolling = ours["tasks"]["tiny_rolling"]["metrics"]
    assert rolling["word_perplexity"] == pytest.approx(
        plain["tasks"]["tiny_rolling"]["metrics"]["word_perplexity"], rel=1e-5
    )
    assert per_request(cached)["tiny_rolling"] != per_request(plain)["tiny_rolling"]
    # the other tasks do not meet the case: HFLM gives the same with and without its cache
    assert_same_scores(cached, plain, ["tiny_mc_a", "tiny_mc_b", "tiny_cloze"])


@pytest.mark.slow  # the module's trained run and export: about 16 s once
def test_the_document_holds_what_the_contract_names(scored, task_dir):
    """The document's fields (results.py): every task's metrics with their stderr, chance and
    config hash from the loaded tasks' info, the sample count, the lm-eval version; tokens
    scored and the rate; the samples only when asked, and JSON all through without them; the
    same loaded tasks scored again give the same entries."""
    from anneal.eval.results import metrics_row

    ours, lm = scored["ours"], scored["lm"]
    entry = ours["tasks"]["tiny_mc_a"]
    assert entry["chance"] == 0.25 and len(entry["config_sha256"]) == 64
    assert ours["tasks"]["tiny_cloze"]["chance"] is None
    assert entry["n_samples"] == 14 and entry["limit"] is None and entry["num_fewshot"] == 0
    assert {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} <= set(entry["metrics"])
    assert ours["lm_eval_version"] == "0.4.13" and ours["source"] == "loop"
    assert ours["tokens_scored"] > 0 and ours["tokens_per_s"] > 0
    row = metrics_row(ours)
    assert row["eval/tiny_mc_b/acc_norm"] == ours["tasks"]["tiny_mc_b"]["metrics"]["acc_norm"]
    before, loaded = lm.tokens_scored, load(*task_dir)
    again = score(lm, loaded, step=1, tokens=5, limit=3, num_fewshot=None, source="hf")
    assert "samples" not in again and again["tasks"]["tiny_cloze"]["n_samples"] == 3
    assert again["tokens_scored"] == lm.tokens_scored - before > 0
    assert (again["step"], again["tokens"], again["tasks"]["tiny_cloze"]["limit"]) == (1, 5, 3)
    json.dumps(again)
    # the loop scores the tasks it loaded once at every scoring: the same tasks, the same scores
    third = score(lm, loaded, step=2, tokens=9, limit=3, num_fewshot=None, source="hf")
    assert third["tasks"] == again["tasks"] and third["tokens_scored"] == again["tokens_scored"]


class RandomDrawingLM(EngineLM):
    """An EngineLM that draws from python's, numpy's and torch's global generators on every
    request list, as a task's code or a library might."""

    def _loglikelihood_tokens(self, requests, **kwargs):
        random.random(), np.random.rand(), torch.rand(1)
        return super()._loglikelihood_tokens(requests, **kwargs)


@pytest.mark.slow  # the module's trained run and export: about 16 s once
def test_score_puts_back_the_generators_and_the_train_mode(trained, task_dir):
    """After a scoring whose model draws from every global generator, python's, numpy's and
    torch's states are the ones before; the engine ran its forward calls in eval mode and is
    back in the mode it was in (train, or eval)."""
    engine, hf_dir = trained
    lm = RandomDrawingLM(engine, hf_dir, replica=(0, 1), batch_size=8, max_length=MAX_LENGTH)
    modes = []
    hook = engine.module.register_forward_pre_hook(lambda m, _: modes.append(m.training))
    engine.train()
    loaded = load(*task_dir)
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        doc = score(lm, loaded, step=0, tokens=None, limit=2, num_fewshot=None, source="loop")
    finally:
        hook.remove()
    assert len(doc["tasks"]) == 4 and modes and not any(modes)
    assert engine.module.training
    after = random.getstate(), np.random.get_state(), torch.get_rng_state()
    assert after[0] == states[0]
    assert all(np.array_equal(a, b) for a, b in zip(after[1], states[1], strict=True))
    assert torch.equal(after[2], states[2])
    engine.eval()  # and an engine found in eval mode stays in it
    score(lm, load(*task_dir), step=0, tokens=None, limit=1, num_fewshot=None, source="loop")
    assert not engine.module.training
    engine.train()


def test_loading_tasks_moves_pythons_generator_unless_inside_rng_restored(task_dir):
    """lm-eval 0.4.13's ``TaskManager.load`` draws from python's global generator (what a
    caller that loads tasks mid-run must know); inside ``rng_restored`` the state is kept."""
    state = random.getstate()
    load(*task_dir)
    assert random.getstate() != state
    state = random.getstate()
    with rng_restored():
        load(*task_dir)
    assert random.getstate() == state


@pytest.mark.slow  # the module's trained run and export: about 16 s once
def test_a_failing_task_is_recorded_and_the_others_score(trained, task_dir, tmp_path):
    """A task whose requests cannot be scored (a cloze target of no text), and one that never
    loaded (in ``loaded.failed``), are recorded in ``failed`` with a one-line reason; the other
    tasks score as they would alone."""
    engine, hf_dir = trained
    root, _ = task_dir
    broken = tmp_path / "tiny_broken.yaml"
    text = (root / "tiny_cloze.yaml").read_text().replace("task: tiny_cloze", "task: tiny_broken")
    # a continuation of no text: nothing to score (lm-eval's HFLM asserts on it too)
    broken.write_text(text.replace("{{' ' + text.split(' ')[-1]}}", ""))
    loaded = load(root, ["tiny_mc_b"], str(broken), str(tmp_path / "gone.yaml"))
    assert list(loaded.tasks) == ["tiny_mc_b", "tiny_broken"] and len(loaded.failed) == 1
    lm = EngineLM(engine, hf_dir, replica=(0, 1), batch_size=8, max_length=MAX_LENGTH)
    kw = dict(step=0, tokens=None, limit=4, num_fewshot=None, source="loop")
    doc = score(lm, loaded, **kw)
    assert list(doc["tasks"]) == ["tiny_mc_b"]
    assert set(doc["failed"]) == {"tiny_broken", str(tmp_path / "gone.yaml")}
    assert (
        doc["failed"]["tiny_broken"].startswith("UserError: ")
        and "continuation" in (doc["failed"]["tiny_broken"])
    )
    alone = score(lm, load(root, ["tiny_mc_b"]), **kw)
    assert doc["tasks"]["tiny_mc_b"]["metrics"] == alone["tasks"]["tiny_mc_b"]["metrics"]


@pytest.mark.slow  # the module's trained run and export: about 16 s once
def test_generation_and_sequence_parallelism_are_refused_with_their_reason(trained):
    """``generate_until`` says that generation is out of scope; ``unsupported_layout`` passes
    every tensor-parallel degree and refuses Ulysses, saying what to run instead, and so does
    ``EngineLM`` given an engine under sequence parallelism."""
    engine, hf_dir = trained
    lm = EngineLM(engine, hf_dir, replica=(0, 1), batch_size=1, max_length=MAX_LENGTH)
    with pytest.raises(NotImplementedError, match="generation tasks"):
        lm.generate_until([])
    assert unsupported_layout(1, 1) is None and unsupported_layout(4, 1) is None
    reason = unsupported_layout(1, 2)
    assert "\n" not in reason and "sequence_parallel_size=2" in reason
    assert "anneal eval" in reason and "ds.sequence_parallel_size=1" in reason
    ulysses = types.SimpleNamespace(sequence_parallel_size=2)  # what an SP engine says
    with pytest.raises(UserError, match="sequence parallelism"):
        EngineLM(ulysses, hf_dir, replica=(0, 1), batch_size=1, max_length=MAX_LENGTH)


LOCKSTEP_OVERRIDES = [
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.intermediate_size=176",
    "model.num_attention_heads=4",
    f"model.seq_len={MAX_LENGTH}",
    "optim.global_batch_tokens=512",  # the tiny split holds under a default batch (batch_share)
]


@pytest.mark.slow
def test_two_ranks_call_forward_alike_and_score_as_one_replica(tiny_data, tmp_path):
    """ZeRO-3 on 2 ranks (tests/scripts/eval_lockstep.py, on 2 ranks): the
    model's forward runs as many times on both ranks while the batches are split over the two
    replicas (5 requests of a task: one replica has no row in the last batch and runs the
    padding row), and both ranks return the document that one replica scoring every row
    returns, per request within 1e-5. Slow: two processes build a ZeRO-3 engine (about 30 s
    on 2 cores)."""
    names = write_tasks(tmp_path / "tasks")
    prefix = tmp_path / "out.json"
    cmd = launch(2, str(ROOT / "tests/scripts/eval_lockstep.py"), str(prefix))
    cmd += [str(tmp_path / "tasks"), str(tiny_data), str(tmp_path / "run"), *LOCKSTEP_OVERRIDES]
    e = {**env(), "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run_process(cmd, timeout_s=180, check=True, cwd=ROOT, env=e)
    ranks = [json.loads(Path(f"{prefix}.{r}").read_text()) for r in (0, 1)]
    split = [docs["split"] for docs in ranks]
    assert [d["replica"] for d in split] == [[0, 2], [1, 2]]
    assert split[0]["forward_calls"] == split[1]["forward_calls"] == split[0]["adapter_calls"]
    assert split[0]["forward_calls"] > 0
    assert split[0]["failed"] == {} and sorted(split[0]["tasks"]) == sorted(names)
    reference = ranks[0]["one_replica"]
    assert split[0]["forward_calls"] < reference["forward_calls"]
    for doc in split:
        mine, ref = per_request(doc), per_request(reference)
        for task in names:
            for doc_id, values in ref[task].items():
                assert np.allclose(mine[task][doc_id], values, atol=1e-5, rtol=0), (task, doc_id)
            assert (
                doc["tasks"][task]["metrics"].keys() == reference["tasks"][task]["metrics"].keys()
            )
    assert split[0]["tasks"] == split[1]["tasks"] and split[0]["samples"] == split[1]["samples"]
