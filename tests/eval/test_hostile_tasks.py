"""Task files as a hostile user writes them (issue 41, task files): the shipped task's files in a
run directory are rebuilt and compared byte for byte, never loaded as they stand; lm-eval's
templates render in a sandbox and a template that reaches into Python is refused before
launch; an alias bomb is refused in milliseconds; a task YAML that names Python still runs when
the user names it, and the launch says so; an ``auto_map`` tokenizer is refused before the
engine; a broken JSONL line and an answer out of range name their file and line;
``--limit`` is bounded as argparse reads it; ``submit --watch-tasks`` refuses a generation task
before writing anything. Each: no marker file, one paragraph, nothing hangs.

The Hugging Face directory scored here is ``tests/hf/test_init_from.py``'s tiny Llama (about
3 s to make, once for the module); ``anneal eval`` runs in this process on a world of one.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from anneal.cli import main
from anneal.errors import UserError
from anneal.eval.tasks import check_specs, load_tasks
from tests.conftest import ROOT
from tests.hf.test_init_from import make_model

DOCS = [
    {"q": f"Question {i}?", "choices": ["yes", "no", "maybe"], "label": i % 3} for i in range(6)
]


def write_task(where: Path, name: str, *, text: str = "{{q}}", extra: str = "", docs=DOCS) -> Path:
    """A multiple-choice task YAML over a JSONL file, both under ``where``: its path."""
    where.mkdir(parents=True, exist_ok=True)
    data = where / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    path = where / f"{name}.yaml"
    path.write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\noutput_type: multiple_choice\ndoc_to_text: {json.dumps(text)}\n"
        f'doc_to_choice: "{{{{choices}}}}"\ndoc_to_target: label\n{extra}'
    )
    return path


def popen(marker: Path, field: str = "q") -> str:
    """A template that, rendered by a plain jinja2 Environment, runs ``touch marker`` (then
    shows the document's ``field``)."""
    return f"{{{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}}}{{{{{field}}}}}"


def load(specs, work_dir: Path, *, data_dir=None):
    return load_tasks(
        [str(s) for s in specs], data_dir=data_dir, work_dir=work_dir, num_fewshot=None, limit=None
    )


def rendered(task) -> list[str]:
    return [task.doc_to_text(doc) for doc in list(task.eval_docs)[:3]]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory, tiny_data) -> Path:
    """A tiny Llama with the prepared data's tokenizer (Hugging Face layout)."""
    return make_model("llama", tmp_path_factory.mktemp("hostile_tasks") / "llama", tiny_data)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def one_paragraph(err: str) -> str:
    [line] = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err, err
    return line


# --- the shipped task's files under a run --------------------------------------------------


def test_a_template_planted_in_the_shipped_task_is_replaced_not_run(stdlib_data, tmp_path):
    """The reproduction of point 1: ``RUN/evals/tasks/anneal_next_line.yaml`` given a
    ``doc_to_text`` that runs ``touch`` (its metadata kept, so it matched before), then the
    task loaded again as a resumed run loads it (``InLoop.open`` calls ``load_tasks`` with
    ``work_dir`` RUN/evals/tasks: the same code path as ``--resume auto`` with
    ``train.eval_tasks=anneal_next_line``, without training): the YAML is rebuilt to its
    bytes, its documents render as the context, nothing runs. A JSONL edited with its sha256
    recorded in the YAML is replaced too."""
    import hashlib

    work = tmp_path / "run" / "evals" / "tasks"
    load(["anneal_next_line"], work, data_dir=stdlib_data)
    yaml_path, data_path = work / "anneal_next_line.yaml", work / "anneal_next_line.jsonl"
    built = {p: p.read_bytes() for p in (yaml_path, data_path)}
    marker = tmp_path / "PWNED"
    planted = (
        built[yaml_path]
        .decode()
        .replace("doc_to_text: context", f"doc_to_text: {json.dumps(popen(marker, 'context'))}")
    )
    assert planted != built[yaml_path].decode()
    yaml_path.write_text(planted)
    task = load(["anneal_next_line"], work, data_dir=stdlib_data).tasks["anneal_next_line"]
    texts = rendered(task)
    assert not marker.exists()
    assert {p: p.read_bytes() for p in built} == built
    assert texts == [doc["context"] for doc in list(task.eval_docs)[:3]]

    rows = data_path.read_text().splitlines()
    first = json.loads(rows[0])
    first["label"] = (first["label"] + 1) % 4  # another answer, its hash recorded
    data = "\n".join([json.dumps(first, sort_keys=True), *rows[1:]]) + "\n"
    data_path.write_text(data)
    old_sha = hashlib.sha256(built[data_path]).hexdigest()
    new_sha = hashlib.sha256(data.encode()).hexdigest()
    yaml_path.write_text(built[yaml_path].decode().replace(old_sha, new_sha))
    load(["anneal_next_line"], work, data_dir=stdlib_data)
    assert {p: p.read_bytes() for p in built} == built


# --- templates -------------------------------------------------------------------------------


def test_a_jinja_only_yaml_is_refused_by_anneal_eval(hf_model, tmp_path, capsys, offline):
    """The Jinja-only YAML (no Python file at all) given to ``anneal eval --tasks``: exit 2,
    one paragraph naming the file and the key, no marker, nothing written at ``--out``."""
    marker = tmp_path / "PWNED"
    spec = write_task(tmp_path / "tasks", "jinja", text=popen(marker))
    out = tmp_path / "scores"
    argv = ["eval", str(hf_model), "--tasks", str(spec), "--out", str(out), "--limit", "2"]
    code = main(argv)
    assert not marker.exists() and not out.exists()
    assert code == 2
    line = one_paragraph(capsys.readouterr().err)
    assert str(spec) in line and "key doc_to_text" in line and "sandbox" in line


def test_templates_render_in_a_sandbox(tmp_path, offline):
    """A template that the check before launch does not see through (``attr`` with a name
    built from parts) passes it, but lm-eval renders it in a SandboxedEnvironment: the task
    does not load (one line in ``failed``), rendering it raises, and nothing runs. Plain
    templates (fields, methods, filters, lm-eval's ``regex_replace``) render as before."""
    from jinja2 import TemplateError
    from lm_eval import utils

    marker = tmp_path / "PWNED"
    sneaky = (
        "{{ (cycler|attr('_' ~ '_init__')|attr('_' ~ '_globals__'))['os']"
        f".popen('touch {marker}').read() }}}}{{{{q}}}}"
    )
    spec = write_task(tmp_path, "sneaky", text=sneaky)
    loaded = load([spec], tmp_path / "w")
    assert not marker.exists()
    assert "sneaky" not in loaded.tasks and "\n" not in loaded.failed[str(spec)]
    with pytest.raises(TemplateError):
        utils.apply_template(sneaky, DOCS[0])
    assert not marker.exists()
    assert check_specs([str(spec)]) == []  # not seen before launch: the sandbox held
    plain = write_task(tmp_path, "plain", text="{{ q.upper() | regex_replace('\\\\?', '!') }}")
    task = load([plain], tmp_path / "w").tasks["plain"]
    assert rendered(task) == ["QUESTION 0!", "QUESTION 1!", "QUESTION 2!"]
    assert utils.apply_template("{{ a | join('-') }}", {"a": ["x", "y"]}) == "x-y"


def test_an_alias_bomb_is_refused_fast(tmp_path, capsys):
    """The "billion laughs" under ``metadata`` (9 levels of 10 aliases: 10^9 leaves) is refused
    by the check before launch in well under a second, one paragraph, by ``load_tasks`` (never
    fatal: one line in ``failed``) and by ``anneal eval`` (exit 2)."""
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    bomb = write_task(tmp_path, "bomb", extra="metadata:\n" + "".join(f"  {x}\n" for x in levels))
    start = time.monotonic()
    with pytest.raises(UserError, match="alias bomb") as refused:
        check_specs([str(bomb)])
    assert "\n" not in str(refused.value) and str(bomb) in str(refused.value)
    assert "bomb" in load([bomb], tmp_path / "w").failed[str(bomb)]
    assert main(["eval", str(tmp_path), "--tasks", str(bomb)]) == 2
    assert "alias bomb" in one_paragraph(capsys.readouterr().err)
    assert time.monotonic() - start < 5


# --- Python that a YAML names ----------------------------------------------------------------


def test_a_yaml_naming_python_runs_when_named_and_the_launch_says_so(
    hf_model, tiny_data, tmp_path, capsys, offline
):
    """``process_docs: !function utils.shout`` beside a ``utils.py``: ``anneal eval`` scores
    it (exit 0, its documents processed by the function) and prints that the YAML runs Python
    from that file, as does a run's start with it in ``train.eval_tasks``; a YAML that brings
    it in by ``include:`` is named too, as is a function of an installed module."""
    from anneal.eval import in_loop
    from tests.conftest import resolve_tiny

    tasks = tmp_path / "tasks"
    spec = write_task(tasks, "coded", extra="process_docs: !function utils.shout\n")
    (tasks / "utils.py").write_text(
        "def shout(dataset):\n    return dataset.map(lambda d: {**d, 'q': d['q'].upper()})\n"
    )
    out = tmp_path / "scores"
    argv = ["eval", str(hf_model), "--tasks", str(spec), "--out", str(out), "--limit", "2"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert f"{spec} runs Python from {tasks / 'utils.py'}: trust it as you trust a recipe" in said
    [scores] = (out / "evals").glob("step-*.json")
    assert "coded" in json.loads(scores.read_text())["tasks"]
    assert rendered(load([spec], tmp_path / "w").tasks["coded"])[0] == "QUESTION 0?"
    args = ["--out", str(tmp_path / "run"), "--data", str(tiny_data)]
    in_loop.check_launch(resolve_tiny([*args, "--set", f"train.eval_tasks={spec}"], world_size=1))
    assert (
        f"train.eval_tasks: {spec} runs Python from {tasks / 'utils.py'}" in capsys.readouterr().out
    )

    wrapper = tmp_path / "other" / "wrapper.yaml"
    wrapper.parent.mkdir()
    wrapper.write_text(f"include: {spec}\ntask: wrapped\nmetric_list:\n  - metric: acc\n")
    installed = write_task(tmp_path / "more", "named", extra="process_docs: !function os.fspath\n")
    notes = check_specs([str(wrapper), str(installed)])
    assert notes[0].startswith(f"{spec} runs Python from {tasks / 'utils.py'}")
    assert notes[1].startswith(f"{installed} runs Python (os.fspath, imported from the installed")


# --- smaller ---------------------------------------------------------------------------------


def test_an_auto_map_tokenizer_is_refused_before_the_engine(hf_model, tmp_path, capsys):
    """A model directory whose tokenizer class exists only as its own Python (``auto_map``):
    ``anneal eval`` exits 2 with one paragraph before any engine is built; the code never
    runs and nothing is written at ``--out``."""
    model = Path(shutil.copytree(hf_model, tmp_path / "model"))
    marker = tmp_path / "PWNED"
    (model / "tokenization_trap.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class TrapTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "TrapTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_trap.TrapTokenizer"]}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    spec = write_task(tmp_path / "tasks", "good")
    out = tmp_path / "scores"
    assert main(["eval", str(model), "--tasks", str(spec), "--out", str(out)]) == 2
    line = one_paragraph(capsys.readouterr().err)
    assert "auto_map" in line and str(model) in line and "Nothing was scored" in line
    assert not marker.exists() and not out.exists()


def test_a_broken_jsonl_line_and_an_answer_out_of_range_name_file_and_line(tmp_path, offline):
    """A JSONL line cut in half, and an answer index past the choices: each task is one line
    in ``failed`` naming the data file, the line and the fix (no bare ValueError or
    IndexError); a good task beside them loads."""
    lines = [json.dumps(d) + "\n" for d in DOCS]
    broken = write_task(tmp_path, "broken")
    data = tmp_path / "broken.jsonl"
    data.write_text("".join(lines[:3]) + '{"q": "cut", "choices": [\n' + "".join(lines[3:]))
    wrong = write_task(tmp_path, "wrong", docs=[*DOCS[:4], {**DOCS[4], "label": 7}, DOCS[5]])
    good = write_task(tmp_path, "good")
    loaded = load([broken, wrong, good], tmp_path / "w")
    assert list(loaded.tasks) == ["good"]
    said = loaded.failed[str(broken)]
    assert said.startswith(f"{data}, line 4: not a JSON object") and "fix or remove" in said
    said = loaded.failed["wrong"]
    assert f"{tmp_path / 'wrong.jsonl'}, line 5: its answer 7 is not one of its 3 choices" in said
    assert "Fix that document's answer" in said


def test_a_limit_past_any_count_is_refused_as_argparse_reads_it(tmp_path, capsys):
    """``--limit 99999999999999999999`` (and a zero one): one paragraph naming the flag, before
    any task or target is looked at."""
    spec = write_task(tmp_path, "good")
    for value in ("99999999999999999999", "0"):
        assert main(["eval", str(tmp_path), "--tasks", str(spec), "--limit", value]) == 2
        line = one_paragraph(capsys.readouterr().err)
        assert f"--limit {value}: give a whole number from 1 to" in line


def test_submit_watch_tasks_refuses_a_generation_task_before_writing(tmp_path, capsys, tiny_data):
    """``python -m launcher submit --watch-tasks GEN.yaml``: the generation task the watch job
    would refuse when it starts is refused at submit (exit 2, one paragraph), and nothing is
    written; a task YAML that runs Python is said at submit."""
    from launcher.__main__ import main as launcher_main

    gen = tmp_path / "tasks" / "gen.yaml"
    write_task(gen.parent, "gen")
    gen.write_text(gen.read_text().replace("multiple_choice", "generate_until"))
    coded = write_task(tmp_path / "tasks", "coded", extra="process_docs: !function utils.f\n")
    (tmp_path / "tasks" / "utils.py").write_text("def f(dataset):\n    return dataset\n")
    argv = ["submit", str(ROOT / "recipes" / "pretrain_tiny.py"), "--device", "cpu"]
    argv += [*"--nodes 1 --gpus-per-node 1 --partition p --time 01:00:00".split()]
    tail = ["--", "--out", str(tmp_path / "run"), "--data", str(tiny_data)]
    assert launcher_main([*argv, "--watch-tasks", str(gen), *tail]) == 2
    line = one_paragraph(capsys.readouterr().err)
    assert line.startswith("launcher: error: --watch-tasks: task spec") and "generate_until" in line
    assert not (tmp_path / "run").exists()
    assert launcher_main([*argv, "--dry-run", "--watch-tasks", str(coded), *tail]) == 0
    assert f"--watch-tasks: {coded} runs Python from" in capsys.readouterr().out
