"""Task loading (anneal.eval.tasks), the few-shot guard (anneal.eval.fewshot) and the shipped
task (anneal.eval.next_line), on local YAML + JSONL tasks that this file writes, offline:
check_specs refuses what cannot be scored before launch; load_tasks never raises for one task
and puts it in ``failed``; num_fewshot and the sampler seed are applied as lm-eval's
simple_evaluate applies them; the config hash is the same in another process and in another
place; chance is the mean of 1/choices; lm-eval 0.4.13 shows an item among its own
demonstrations (#4145) and Anneal never does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from anneal.errors import UserError
from anneal.eval import fewshot
from anneal.eval.tasks import LOGLIKELIHOOD_TYPES, check_specs, load_tasks

DOCS = [
    {
        "q": f"Question {i}?",
        "choices": [f"yes {i}", f"no {i}", f"maybe {i}"][: 2 + i % 2],
        "label": i % 2,
    }
    for i in range(8)
]


def write_task(
    where: Path,
    name: str,
    *,
    docs: list[dict] = DOCS,
    splits: str = "test_split: test\n",
    data_split: str = "test",
    extra: str = "",
    output_type: str | None = "multiple_choice",
) -> Path:
    """A task YAML over a JSONL file, both under ``where``: its path."""
    where.mkdir(parents=True, exist_ok=True)
    data = where / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    yaml = where / f"{name}.yaml"
    kind = f"output_type: {output_type}\n" if output_type else ""
    yaml.write_text(
        f"task: {name}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    {data_split}: {data}\n"
        f"{splits}{kind}"
        'doc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n' + extra
    )
    return yaml


def load(specs, tmp_path, *, num_fewshot=None, limit=None):
    return load_tasks(
        [str(s) for s in specs],
        data_dir=None,
        work_dir=tmp_path / "work",
        num_fewshot=num_fewshot,
        limit=limit,
    )


# --- check_specs ---------------------------------------------------------------------------


def test_check_specs_refuses_what_cannot_be_scored(tmp_path):
    """Before launch: a missing path, a YAML without a task, an unreadable YAML, an empty
    directory and a generation task (named, or by lm-eval's default output type) are refused
    with a paragraph naming the spec; good YAMLs, a directory of them and the shipped task
    pass (no lm-eval index is built for them)."""
    good = write_task(tmp_path / "good", "good")
    check_specs([str(good), str(good.parent), "anneal_next_line"])
    gen = write_task(tmp_path / "gen", "gen", output_type="generate_until")
    default = write_task(tmp_path / "default", "default", output_type=None)
    (tmp_path / "notask.yaml").write_text("dataset_path: json\n")
    (tmp_path / "broken.yaml").write_text("task: [unclosed\n")
    (tmp_path / "empty").mkdir()
    cases = {
        str(tmp_path / "missing.yaml"): "no such file or directory",
        str(tmp_path / "notask.yaml"): "no `task:` key",
        str(tmp_path / "broken.yaml"): "not a readable task YAML",
        str(tmp_path / "empty"): "holds no task YAML",
        str(gen): "output_type 'generate_until' is not scored",
        str(default): "output_type 'generate_until' is not scored",
        str(gen.parent): "output_type 'generate_until' is not scored",
    }
    for spec, why in cases.items():
        with pytest.raises(UserError, match="task spec") as e:
            check_specs([str(good), spec])
        assert spec in str(e.value) and why in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
    assert set(LOGLIKELIHOOD_TYPES) == {"multiple_choice", "loglikelihood", "loglikelihood_rolling"}


@pytest.mark.slow
def test_check_specs_resolves_lm_eval_names():
    """A bare name goes through lm-eval's own index (7-26 s to build, hence slow): a
    multiple-choice task, a group of them and a tag pass; a generation task, a group holding
    one and an unknown name (with close names suggested) are refused."""
    check_specs(["hellaswag", "arc_easy", "ai2_arc"])
    with pytest.raises(UserError, match="'generate_until' is not scored"):
        check_specs(["gsm8k"])
    with pytest.raises(UserError, match="knows no task.*Did you mean hellaswag"):
        check_specs(["helaswag"])


# --- load_tasks ----------------------------------------------------------------------------


def test_load_tasks_records_failures_and_goes_on(tmp_path, monkeypatch):
    """One spec of each kind of failure (a missing file, a YAML whose data file is missing, a
    broken YAML, a generation task, a dataset on the Hub while offline, the shipped task
    without data) lands in ``failed`` with one line, and the good task is loaded beside them."""
    import datasets
    import huggingface_hub

    # HF_DATASETS_OFFLINE=1 as an offline cluster sets it (read when datasets is imported)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    good = write_task(tmp_path, "good")
    nodata = write_task(tmp_path, "nodata")
    (tmp_path / "nodata.jsonl").unlink()
    (tmp_path / "broken.yaml").write_text("task: [unclosed\n")
    gen = write_task(tmp_path / "g", "gen", output_type="generate_until")
    hub = tmp_path / "hub.yaml"
    hub.write_text(
        "task: hub\ndataset_path: no-such-owner/no-such-dataset\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{c}}"\n'
        "doc_to_target: 0\n"
    )
    specs = [good, tmp_path / "missing.yaml", nodata, tmp_path / "broken.yaml", gen, hub]
    loaded = load([*specs, "anneal_next_line"], tmp_path)
    assert list(loaded.tasks) == ["good"] and list(loaded.info) == ["good"]
    assert set(loaded.failed) == {str(s) for s in specs[1:]} | {"anneal_next_line"}
    for reason in loaded.failed.values():
        assert reason and "\n" not in reason and len(reason) <= 600
    assert "no such file" in loaded.failed[str(tmp_path / "missing.yaml")]
    assert "generate_until" in loaded.failed[str(gen)]
    assert "offline" in loaded.failed[str(hub)].lower()
    assert "prepared data" in loaded.failed["anneal_next_line"]


def test_num_fewshot_and_seed_as_simple_evaluate(tmp_path):
    """num_fewshot is set on the task config as simple_evaluate sets it (given: set, unless the
    YAML says 0; not given: the YAML's, else 0), and the sampler is seeded with its default
    seed: the prompts equal plain lm-eval's (TaskManager.load, set_config, set_fewshot_seed)
    on a task where lm-eval already drops the evaluated item (fewshot_split == test_split)."""
    from lm_eval.tasks import TaskManager

    same = write_task(tmp_path, "same", splits="test_split: test\nfewshot_split: test\n")
    zero = write_task(tmp_path, "zero", extra="num_fewshot: 0\n")
    three = write_task(tmp_path, "three", extra="num_fewshot: 3\n")
    given = load([same, zero, three], tmp_path, num_fewshot=2)
    assert [t.get_config("num_fewshot") for t in given.tasks.values()] == [2, 0, 2]
    absent = load([same, zero, three], tmp_path)
    assert [t.get_config("num_fewshot") for t in absent.tasks.values()] == [0, 0, 3]

    plain = TaskManager(include_defaults=False).load(str(same))["tasks"]["same"]
    plain.set_config(key="num_fewshot", value=2)
    plain.set_fewshot_seed(seed=1234)
    assert prompts(given.tasks["same"]) == prompts(plain)
    assert len(set(prompts(plain))) == len(DOCS)


def test_evaluate_takes_the_tasks_and_applies_limit(tmp_path):
    """The loaded tasks go straight into lm_eval.evaluator.evaluate, which applies ``limit``
    (the first documents): a model that prefers the first choice scores acc = the share of
    label 0 among them, and chance is the mean of 1/choices over the same documents."""
    from lm_eval.api.model import LM
    from lm_eval.evaluator import evaluate

    class FirstChoice(LM):
        def loglikelihood(self, requests):
            firsts = {r.doc["choices"][0] for r in requests}
            return [(0.0 if r.args[1].strip() in firsts else -1.0, False) for r in requests]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

    loaded = load([write_task(tmp_path, "mc")], tmp_path, limit=5)
    out = evaluate(lm=FirstChoice(), task_dict=loaded.tasks, limit=5, bootstrap_iters=0)
    assert out["n-samples"]["mc"]["effective"] == 5
    assert out["results"]["mc"]["acc,none"] == pytest.approx(3 / 5)  # labels 0,1,0,1,0
    assert loaded.info["mc"]["chance"] == pytest.approx((1 / 2 + 1 / 3) * 2 / 5 + 1 / 2 / 5)
    assert load([tmp_path / "mc.yaml"], tmp_path).info["mc"]["chance"] == pytest.approx(
        (1 / 2 + 1 / 3) / 2
    )


def test_config_hash_same_elsewhere_and_in_another_process(tmp_path):
    """config_sha256 is the same in another Python process (no addresses, no set order) and
    for a copy of the task in another directory (data files count by their bytes); it changes
    when the prompt template or a data file's bytes change. A loglikelihood task has no
    chance figure."""
    a = write_task(tmp_path / "a", "t")
    b = write_task(tmp_path / "b", "t")
    ha = load([a], tmp_path).info["t"]["config_sha256"]
    assert load([b], tmp_path).info["t"]["config_sha256"] == ha
    code = (
        "import sys; from lm_eval.tasks import TaskManager; from anneal.eval.tasks import "
        "config_hash; t = TaskManager(include_defaults=False).load(sys.argv[1])['tasks']['t']; "
        "print(config_hash(t))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, str(a)], capture_output=True, text=True, check=True
    )
    assert other.stdout.strip() == ha
    c = write_task(tmp_path / "c", "t", extra='description: "Answer:"\n')
    d = write_task(tmp_path / "d", "t", docs=DOCS[::-1])
    assert load([c], tmp_path).info["t"]["config_sha256"] != ha
    assert load([d], tmp_path).info["t"]["config_sha256"] != ha
    ll = write_task(tmp_path / "e", "ll", output_type="loglikelihood")
    assert load([ll], tmp_path).info["ll"]["chance"] is None


# --- the few-shot guard (lm-eval #4145) -----------------------------------------------------

LAYOUTS = {
    # no fewshot_split: lm-eval falls back to the only split there is, the evaluated one
    "fallback": dict(splits="test_split: test\n"),
    # fewshot_split is the validation split, which is evaluated (no test split)
    "validation": dict(
        splits="validation_split: validation\nfewshot_split: validation\n",
        data_split="validation",
    ),
    # fewshot_split == test_split: lm-eval drops the item by equality (no leak)
    "explicit": dict(splits="test_split: test\nfewshot_split: test\n"),
}


def prompts(task) -> list[str]:
    """The context of every document's first request, in document order."""
    task.build_all_requests(limit=None)
    firsts = {}
    for inst in task.instances:
        firsts.setdefault(inst.doc_id, inst.args[0])
    return [firsts[i] for i in sorted(firsts)]


def leaks(task) -> int:
    """How many prompts show their own question among the demonstrations (everything before
    the prompt's last line, the evaluated question)."""
    own = [d["q"] for d in DOCS]
    return sum(own[i] in p[: -len(own[i])] for i, p in enumerate(prompts(task)))


def plain_task(yaml: Path, num_fewshot: int):
    from lm_eval.tasks import TaskManager

    task = next(iter(TaskManager(include_defaults=False).load(str(yaml))["tasks"].values()))
    task.set_config(key="num_fewshot", value=num_fewshot)
    task.set_fewshot_seed(seed=1234)
    return task


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_no_item_among_its_own_demonstrations(tmp_path, layout):
    """With the demonstrations drawn from the evaluated split and num_fewshot = documents - 1
    (every other item is shown), no prompt holds its own question among its demonstrations,
    for every way lm-eval resolves that split; each prompt shows all the others."""
    yaml = write_task(tmp_path, f"leak_{layout}", **LAYOUTS[layout])
    task = load([yaml], tmp_path, num_fewshot=len(DOCS) - 1).tasks[f"leak_{layout}"]
    assert leaks(task) == 0
    assert isinstance(task.sampler, fewshot.OwnItemExcluded)
    for i, p in enumerate(prompts(task)):
        assert all((d["q"] in p) for d in DOCS), p
        assert p.count(DOCS[i]["q"]) == 1


def test_plain_lm_eval_shows_items_among_their_own_demonstrations(tmp_path):
    """The bug the guard is for (lm-eval #4145, 0.4.13): without it, the fallback and the
    validation layouts leak (an item is its own demonstration in some prompts); the explicit
    layout does not. If lm-eval fixes it, this test says so."""
    counts = {}
    for layout, kw in LAYOUTS.items():
        task = plain_task(write_task(tmp_path / layout, layout, **kw), len(DOCS) - 2)
        counts[layout] = leaks(task)
    assert counts["fallback"] > 0 and counts["validation"] > 0, counts
    assert counts["explicit"] == 0, counts


def test_guard_drops_an_item_that_equality_misses(tmp_path):
    """The same item decoded twice with a NaN field is not equal to itself as a dict (lm-eval's
    test), yet it is shown as the same demonstration: the guard drops it; plain lm-eval
    (fewshot_split == test_split) shows it."""
    docs = [{**d, "w": float("nan")} for d in DOCS]
    yaml = write_task(tmp_path, "nan", docs=docs, splits=LAYOUTS["explicit"]["splits"])
    plain = plain_task(yaml, len(DOCS) - 1)
    assert leaks(plain) > 0
    guarded = load([yaml], tmp_path, num_fewshot=len(DOCS) - 1).tasks["nan"]
    assert leaks(guarded) == 0


def test_guard_leaves_other_pools_alone(tmp_path):
    """Demonstrations from another split than the evaluated one: no guard is installed and the
    prompts are plain lm-eval's."""
    yaml = write_task(tmp_path, "two", splits="test_split: test\nfewshot_split: train\n")
    data = f"    test: {tmp_path / 'two.jsonl'}\n"
    yaml.write_text(yaml.read_text().replace(data, data + data.replace("test", "train", 1)))
    task = load([yaml], tmp_path, num_fewshot=3).tasks["two"]
    assert not isinstance(task.sampler, fewshot.OwnItemExcluded)
    assert prompts(task) == prompts(plain_task(yaml, 3))


# --- the shipped task ----------------------------------------------------------------------


def build_bytes(data_dir: Path, work_dir: Path) -> dict[str, bytes]:
    from anneal.eval import next_line

    yaml_path = next_line.build(data_dir, work_dir)
    return {p.name: p.read_bytes() for p in sorted(yaml_path.parent.iterdir())}


def test_shipped_task_is_deterministic_and_reused(stdlib_data, tmp_path):
    """anneal_next_line built twice, and from a copy of the prepared directory whose train
    split is gone (so train is never read), gives the same bytes; ITEMS items on the stdlib
    corpus. A later build with the same source reuses the files (not rewritten); one whose
    data file was edited, or another val split, builds again."""
    import shutil

    from anneal.eval import next_line

    first = build_bytes(stdlib_data, tmp_path / "w1")
    assert first == build_bytes(stdlib_data, tmp_path / "w2")
    copy = tmp_path / "copy"
    shutil.copytree(stdlib_data, copy, ignore=shutil.ignore_patterns("train"))
    assert first == build_bytes(copy, tmp_path / "w3")
    assert set(first) == {"anneal_next_line.jsonl", "anneal_next_line.yaml"}
    assert len(first["anneal_next_line.jsonl"].splitlines()) == next_line.ITEMS == 200

    data = tmp_path / "w1" / "anneal_next_line.jsonl"
    stamp = data.stat().st_mtime_ns
    assert build_bytes(stdlib_data, tmp_path / "w1") == first
    assert data.stat().st_mtime_ns == stamp
    data.write_bytes(data.read_bytes()[:-100])
    assert build_bytes(stdlib_data, tmp_path / "w1") == first
    meta = json.loads((copy / "meta.json").read_text())
    meta["splits"]["val"]["documents"] += 1  # another val split, as far as meta.json says
    (copy / "meta.json").write_text(json.dumps(meta))
    third = build_bytes(copy, tmp_path / "w3")
    assert third["anneal_next_line.yaml"] != first["anneal_next_line.yaml"]
    assert third["anneal_next_line.jsonl"] == first["anneal_next_line.jsonl"]


def test_shipped_task_comes_from_val_documents_only(stdlib_data, tmp_path):
    """Every context line and every choice of anneal_next_line is a line of a val document;
    the answer and its context come from the same document, each distractor from another one
    (and is no line of the answer's document); the context starts at a ``def``."""
    from anneal.data.prepared_dir import PreparedDir
    from anneal.eval import next_line

    prepared = PreparedDir(stdlib_data)
    docs = next_line.val_documents(prepared, prepared.meta())
    assert len(docs) == prepared.meta()["splits"]["val"]["documents"]
    lines = {(s, k): text.split("\n") for s, k, text in docs}
    stripped = {key: {line.strip() for line in doc} for key, doc in lines.items()}
    yaml_path = next_line.build(stdlib_data, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "anneal_next_line.jsonl").open()]
    for row in rows:
        own = lines[(row["source"], row["document"])]
        context = row["context"].split("\n")[:-1]
        start = row["line"] - 1 - len(context)
        assert own[start : row["line"] - 1] == context and context[0].lstrip().startswith(
            ("def ", "async def ")
        )
        answer = row["choices"][row["label"]]
        assert answer == own[row["line"] - 1]
        for i, choice in enumerate(row["choices"]):
            if i != row["label"]:
                assert choice.strip() not in stripped[(row["source"], row["document"])]
                assert any(choice.strip() in s for s in stripped.values())
    assert yaml_path.read_text().count(str(tmp_path)) == 0  # relative data file


def test_shipped_task_is_not_guessable_by_length(stdlib_data, tmp_path):
    """Four distinct non-trivial choices per item, each distractor within 3 characters of the
    answer's length (they are the nearest in length; distractors drawn at random differ by
    tens), the answer at each position about a quarter of the time, and picking the longest or
    the shortest choice scores near chance (25%). Loaded through load_tasks: 200 documents,
    chance 0.25, the same config hash wherever it was built."""
    from anneal.eval import next_line

    loaded = load_tasks(
        ["anneal_next_line"],
        data_dir=stdlib_data,
        work_dir=tmp_path / "a",
        num_fewshot=None,
        limit=None,
    )
    assert loaded.failed == {}
    task = loaded.tasks["anneal_next_line"]
    rows = list(task.eval_docs)
    assert len(rows) == 200 and loaded.info["anneal_next_line"]["chance"] == 0.25
    for row in rows:
        assert len({c.strip() for c in row["choices"]}) == 4
        assert all(len(c.strip()) >= next_line.MIN_CHARS for c in row["choices"])
        answer = len(row["choices"][row["label"]].strip())
        assert all(abs(len(c.strip()) - answer) <= 3 for c in row["choices"]), row
    n = len(rows)
    for pick in (max, min):
        hits = sum(
            pick(range(4), key=lambda i, r=row: len(r["choices"][i])) == row["label"]
            for row in rows
        )
        assert abs(hits / n - 0.25) < 0.08, (pick.__name__, hits)
    for label in range(4):
        assert abs(sum(r["label"] == label for r in rows) / n - 0.25) < 0.08
    other = load_tasks(
        ["anneal_next_line"],
        data_dir=stdlib_data,
        work_dir=tmp_path / "b",
        num_fewshot=None,
        limit=None,
    )
    assert other.info == loaded.info


def test_shipped_task_needs_code_in_val(tiny_data, tmp_path):
    """A val split without Python functions cannot make the task: load_tasks records why in
    ``failed`` and loads the rest."""
    good = write_task(tmp_path, "good")
    loaded = load_tasks(
        ["anneal_next_line", str(good)],
        data_dir=tiny_data,
        work_dir=tmp_path / "w",
        num_fewshot=None,
        limit=None,
    )
    assert list(loaded.tasks) == ["good"]
    why = loaded.failed["anneal_next_line"]
    assert "Python functions" in why
    # the data's own val fraction, and the fix for data without Python (the downstream journey's
    # prose JSONL was told to prepare with --val-fraction 0.1, which it had been)
    fraction = json.loads((tiny_data / "meta.json").read_text())["val_fraction"]
    assert f"prepared with --val-fraction {fraction:g})" in why
    assert "score a task of your own on it instead (a local YAML over a JSONL file" in why
    assert not (tmp_path / "w" / "anneal_next_line.yaml").exists()
