"""``anneal eval`` on a run's native checkpoint scores what lm-eval's own ``HFLM`` scores on the
same checkpoint exported (``anneal export``), at 1 rank, at 2 ranks under ZeRO-3 and with
tensor parallelism 2; a Hugging Face directory scores the same; and it refuses, before any
engine is built and writing nothing, a run with no checkpoint, a tag whose manifest does not
verify, sequence parallelism and an ``evals/step-N.json`` already there (without ``--force``).

One real run (the tiny recipe, SMALL shapes, ZeRO-3 on one rank, a few steps on ``tiny_data``)
serves every test; the tasks are local (JSONL and YAML written here, offline): two
multiple-choice tasks and a loglikelihood cloze task (``tests/eval/test_eval_lm.py: write_tasks``).

The tests that need that run are marked ``slow`` (make test-all, CI): its training and export
take about 17 s, which the quick suite's 3 minutes have no room for; the scoring configuration's
test stays quick.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from anneal.cli import main
from anneal.eval.results import SAMPLES_MARK
from tests.conftest import ROOT, SMALL, env, launch, run_process, run_recipe
from tests.eval.test_eval_lm import assert_same_scores, per_request, write_tasks

STEPS = 6
TASKS = ["tiny_mc_a", "tiny_mc_b", "tiny_cloze"]


@pytest.fixture(scope="module")
def offline():
    monkey = pytest.MonkeyPatch()
    monkey.setenv("HF_DATASETS_OFFLINE", "1")
    yield
    monkey.undo()


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory, offline) -> dict:
    """{"run", "hf", "specs", "tmp"}: the run (saved at half its steps and at its last), its
    last checkpoint exported in fp32, and the three task YAMLs. About 15 s (the run's
    training, then the export)."""
    tmp = tmp_path_factory.mktemp("eval_cmd")
    run = tmp / "run"
    args = ["--out", str(run), "--data", str(tiny_data), "--max-steps", str(STEPS), *SMALL]
    run_recipe([*args, "--save-every", str(STEPS // 2)])  # checkpoints at steps 3 and 6
    hf = tmp / "hf"
    assert main(["export", str(run), "--out", str(hf), "--dtype", "fp32"]) == 0
    write_tasks(tmp / "tasks")
    specs = [str(tmp / "tasks" / f"{name}.yaml") for name in TASKS]
    return {"run": run, "hf": hf, "specs": specs, "tmp": tmp}


@pytest.fixture(scope="module")
def reference(trained) -> dict:
    """lm-eval's ``HFLM`` on the exported model, over the same tasks: its document with the
    per-request records."""
    from lm_eval.models.huggingface import HFLM

    from anneal.eval.score import score
    from anneal.eval.tasks import load_tasks

    hflm = HFLM(pretrained=str(trained["hf"]), device="cpu", dtype="float32", batch_size=3)
    work = trained["tmp"] / "reference"
    loaded = load_tasks(
        trained["specs"], data_dir=None, work_dir=work, num_fewshot=None, limit=None
    )
    kw = dict(step=STEPS, tokens=None, limit=None, num_fewshot=None, source="hf")
    return score(hflm, loaded, samples=True, **kw)


def anneal_eval(target: Path, specs: list[str], *extra: str, ranks: int) -> None:
    """``anneal eval`` on ``ranks`` processes (tests/scripts/ranks.py; the deepspeed runner's
    ``--no_local_rank --module`` form, which the docs give, runs in
    tests/eval/test_eval_watch.py's Slurm jobs)."""
    cmd = launch(ranks, "-m", "anneal.cli", "eval", str(target))
    cmd += ["--tasks", ",".join(specs), "--batch-size", "4", *extra]
    e = {**env(), "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run_process(cmd, timeout_s=300, check=True, cwd=ROOT, env=e)


def assert_as_hflm(results_dir: Path, samples_file: Path, reference: dict) -> None:
    """The scores of ``anneal eval --samples`` equal HFLM's: every request's log-likelihood
    within 1e-4, acc and acc_norm exactly (``results_dir/evals/step-N.json``)."""
    doc = json.loads((results_dir / "evals" / f"step-{STEPS}.json").read_text())
    assert doc["failed"] == {} and set(doc["tasks"]) == set(TASKS), doc["failed"]
    written = json.loads(samples_file.read_text())
    assert written["anneal"] == SAMPLES_MARK and written["step"] == doc["step"]
    ours = {**doc, "samples": written["samples"]}
    assert_same_scores(ours, reference, TASKS)
    assert per_request(ours)["tiny_mc_a"]  # compared something


@pytest.mark.slow  # the module's trained run and export: about 17 s once
def test_one_rank_scores_as_hflm_on_the_export(trained, reference, capsys):
    """At 1 rank (this process, the command's own code path): per-request log-likelihoods
    within 1e-4 and acc / acc_norm equal to HFLM's on the export; RUN/evals/step-N.json names
    the checkpoint and its manifest's sha256; the run's metrics gain the eval row; a summary
    table is printed. The model learned something (acc above chance on the first task, and
    acc != acc_norm there), so the equal accuracies are not ties."""
    from anneal.files import sha256_file

    run, samples = trained["run"], trained["tmp"] / "one" / "samples.json"
    samples.parent.mkdir()
    code = main(
        ["eval", str(run), "--tasks", ",".join(trained["specs"]), "--samples", str(samples)]
    )
    assert code == 0
    assert_as_hflm(run, samples, reference)
    doc = json.loads((run / "evals" / f"step-{STEPS}.json").read_text())
    tag = run / "checkpoints" / f"step{STEPS:08d}"
    assert (doc["source"], doc["checkpoint"], doc["step"]) == ("checkpoint", str(tag), STEPS)
    assert doc["manifest_sha256"] == sha256_file(tag / "manifest.json")
    mc_a = doc["tasks"]["tiny_mc_a"]["metrics"]
    assert mc_a["acc"] > 0.25 and mc_a["acc"] != mc_a["acc_norm"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kind"] == "eval" and rows[-1]["eval/tiny_mc_a/acc"] == mc_a["acc"]
    printed = capsys.readouterr().out
    assert "tiny_mc_b" in printed and "acc_norm" in printed and f"(step {STEPS})" in printed


@pytest.mark.slow  # the module's trained run and export: about 17 s once
def test_a_task_that_fails_is_recorded_and_the_exit_is_1(trained, tmp_path, capsys):
    """A task whose data file is missing fails to load: the others are scored and written
    (under --out, the run left as it was), the failure is in the document and the summary, and
    the command exits 1."""
    broken = tmp_path / "broken.yaml"
    text = Path(trained["specs"][0]).read_text().replace("tiny_mc_a", "broken_mc")
    broken.write_text(text.replace(".jsonl", "_missing.jsonl"))
    metrics_before = (trained["run"] / "metrics.jsonl").read_bytes()
    specs = f"{trained['specs'][0]},{broken}"
    code = main(["eval", str(trained["run"]), "--tasks", specs, "--out", str(tmp_path / "o")])
    assert code == 1
    doc = json.loads((tmp_path / "o" / "evals" / f"step-{STEPS}.json").read_text())
    assert set(doc["tasks"]) == {"tiny_mc_a"} and set(doc["failed"]) == {str(broken)}
    assert "failed:" in capsys.readouterr().out
    assert (trained["run"] / "metrics.jsonl").read_bytes() == metrics_before


@pytest.mark.slow
def test_two_ranks_at_zero3_score_as_hflm(trained, reference):
    """2 ranks through DeepSpeed's runner at the run's own ZeRO-3 (the weights read into the
    partitioned model before the engine is built): the same scores as HFLM. About 11 s on 2
    CPU cores: two ranks start, each imports DeepSpeed and lm-eval and loads the tasks."""
    samples = trained["tmp"] / "zero3" / "samples.json"
    extra = ["--out", str(samples.parent), "--samples", str(samples)]
    anneal_eval(trained["run"], trained["specs"], *extra, ranks=2)
    assert_as_hflm(samples.parent, samples, reference)


@pytest.mark.slow
def test_tensor_parallel_2_scores_as_hflm(trained, reference):
    """2 ranks at tensor-parallel degree 2 (AutoTP shards the whole weights read from the
    checkpoint saved at degree 1), ZeRO-3: the same scores as HFLM. About 11 s, as the test
    above."""
    samples = trained["tmp"] / "tp2" / "samples.json"
    extra = ["--set", "ds.tensor_parallel.autotp_size=2", "--out", str(samples.parent)]
    anneal_eval(trained["run"], trained["specs"], *extra, "--samples", str(samples), ranks=2)
    assert_as_hflm(samples.parent, samples, reference)


@pytest.mark.slow
def test_a_hugging_face_directory_at_tensor_parallel_2_scores_as_hflm(trained, reference):
    """The export itself as the target, on 2 ranks at tensor-parallel degree 2 under ZeRO-3
    (``anneal.hf.load_weights``: each tensor-parallel rank's partition group gets the weights):
    the same scores as HFLM, at the step the export's marker records. About 11 s, as above."""
    samples = trained["tmp"] / "hf_tp2" / "samples.json"
    extra = ["--set", "ds.tensor_parallel.autotp_size=2", "--out", str(samples.parent)]
    anneal_eval(trained["hf"], trained["specs"], *extra, "--samples", str(samples), ranks=2)
    assert_as_hflm(samples.parent, samples, reference)
    doc = json.loads((samples.parent / "evals" / f"step-{STEPS}.json").read_text())
    assert (doc["source"], doc["checkpoint"], doc["manifest_sha256"]) == ("hf", None, None)


# --- refusals ----------------------------------------------------------------------------------


def copy_run(trained, tmp_path: Path, *, steps: tuple[int, ...] = (STEPS,)) -> Path:
    """A copy of the run's config.json and its checkpoints of ``steps``, to damage."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(trained["run"] / "config.json", run / "config.json")
    for step in steps:
        tag = f"step{step:08d}"
        shutil.copytree(trained["run"] / "checkpoints" / tag, run / "checkpoints" / tag)
    return run


def damage(tag: Path) -> Path:
    """One byte of a tag's optimizer states flipped (same size, other bytes): the file."""
    damaged = next(tag.glob("*optim_states.pt"))
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    return damaged


@pytest.mark.slow  # the module's trained run and export: about 17 s once
def test_the_newest_checkpoint_that_verifies_or_the_step_asked_for(trained, tmp_path):
    """A run whose newest checkpoint does not verify is scored at the one before it (the run's
    evals/step-3.json names that tag); ``--step 3`` of the intact run scores that one (under
    --out)."""
    run = copy_run(trained, tmp_path, steps=(STEPS // 2, STEPS))
    damage(run / "checkpoints" / f"step{STEPS:08d}")
    assert main(["eval", str(run), "--tasks", trained["specs"][0]]) == 0
    doc = json.loads((run / "evals" / f"step-{STEPS // 2}.json").read_text())
    assert doc["checkpoint"] == str(run / "checkpoints" / f"step{STEPS // 2:08d}")
    assert not (run / "evals" / f"step-{STEPS}.json").exists()
    out = tmp_path / "out"
    args = ["--step", str(STEPS // 2), "--out", str(out)]
    assert main(["eval", str(trained["run"]), "--tasks", trained["specs"][0], *args]) == 0
    doc = json.loads((out / "evals" / f"step-{STEPS // 2}.json").read_text())
    assert doc["step"] == STEPS // 2 and doc["checkpoint"].endswith(f"step{STEPS // 2:08d}")


def refused(target: Path, trained, capsys, *extra: str) -> str:
    """The one-paragraph error with which ``anneal eval`` exits 2."""
    code = main(["eval", str(target), "--tasks", trained["specs"][0], *extra])
    assert code == 2
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.slow  # the module's trained run and export: about 17 s once
def test_a_run_without_a_checkpoint_is_refused(trained, tmp_path, capsys):
    """A run directory with no checkpoint: refused, naming the run; nothing written."""
    run = copy_run(trained, tmp_path, steps=())
    err = refused(run, trained, capsys)
    assert "no checkpoint in" in err and str(run) in err and "Train it first" in err
    assert not (run / "evals").exists()


@pytest.mark.slow  # the module's trained run and export: about 17 s once
def test_a_tag_whose_manifest_does_not_verify_is_refused(trained, tmp_path, capsys):
    """A tag one of whose files changed after the save (same size, other bytes): refused by
    name, as a tag and through its run (no other checkpoint verifies); a tag without its
    manifest (a save still being written): refused. Nothing written."""
    run = copy_run(trained, tmp_path)
    tag = run / "checkpoints" / f"step{STEPS:08d}"
    damaged = damage(tag)
    err = refused(tag, trained, capsys)
    assert "differ from the sizes and xxh3 hashes" in err and damaged.name in err
    assert "no checkpoint in" in refused(run, trained, capsys)
    (tag / "manifest.json").unlink()
    assert "not a checkpoint whose manifest.json verifies" in refused(tag, trained, capsys)
    assert not (run / "evals").exists()


@pytest.mark.slow  # the module's trained run and export: about 17 s once
def test_sequence_parallelism_is_refused_with_the_reason(trained, tmp_path, capsys):
    """``--set ds.sequence_parallel_size=2``: refused with the adapter's reason, before any
    engine."""
    from anneal.eval.lm import unsupported_layout

    run = copy_run(trained, tmp_path)
    err = refused(run, trained, capsys, "--set", "ds.sequence_parallel_size=2")
    assert " ".join(unsupported_layout(1, 2).split()) in err
    assert not (run / "evals").exists()


@pytest.mark.slow  # the module's trained run and export: about 17 s once
def test_an_existing_evals_file_is_kept_without_force(trained, tmp_path, capsys):
    """``evals/step-N.json`` already there: refused without --force, and with --force when the
    file is not a document anneal eval writes; so is a ``--samples`` file that is not
    ``--samples``' own. The files are left as they were."""
    run = copy_run(trained, tmp_path)
    existing = run / "evals" / f"step-{STEPS}.json"
    existing.parent.mkdir()
    existing.write_text('{"step": 6, "tasks": {}}\n')
    assert "is scored already" in refused(run, trained, capsys)
    existing.write_text("my notes\n")
    assert "replaces only scores that anneal eval wrote" in refused(run, trained, capsys, "--force")
    assert existing.read_text() == "my notes\n"
    existing.unlink()
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    for force in ([], ["--force"]):  # --samples FILE: a file there is never replaced
        assert "the file exists" in refused(run, trained, capsys, "--samples", str(notes), *force)
    assert notes.read_text() == "my notes\n" and not existing.exists()


@pytest.mark.slow  # the module's trained run and export: about 17 s once
def test_out_another_run_and_samples_over_a_users_file_are_refused(trained, tmp_path, capsys):
    """Issue 41 through the command: ``--out OTHER_RUN --force`` (another run's in-loop score
    of the step there) and ``--samples FILE --force`` over a user's ``{}`` are one paragraph,
    exit 2, before any engine; the files are left as they were."""
    from tests.conftest import tree

    other = copy_run(trained, tmp_path / "other_parent")
    theirs = other / "evals" / f"step-{STEPS}.json"
    theirs.parent.mkdir()
    theirs.write_text(json.dumps({"step": STEPS, "source": "loop", "tasks": {}, "failed": {}}))
    mine = tmp_path / "mine.json"
    mine.write_text("{}")
    before = tree(tmp_path)
    err = refused(trained["run"], trained, capsys, "--out", str(other), "--force")
    assert "one run's scores are never filed under another's" in err
    err = refused(trained["run"], trained, capsys, "--samples", str(mine), "--force")
    assert "the file exists" in err and "only such a file" in err
    assert tree(tmp_path) == before


def test_the_scoring_config_has_no_optimizer_and_one_sample_per_replica():
    """A run's ds_config made to score on 4 ranks at tensor-parallel degree 2: no optimizer
    and no scheduler (their "auto" values with them), a batch of 1 per data-parallel replica
    (2 of them), fp32 where the device has no fast bf16, and ZeRO-1 scored at stage 0 (DeepSpeed
    refuses stage 1 and 2 without an optimizer; neither partitions the weights)."""
    from anneal.model import PRESETS
    from anneal.resolution.ds import find_ds_config, load_ds_config
    from anneal.train.eval_engine import scoring_ds_config

    ds = load_ds_config(find_ds_config("zero1_bf16.json"))
    ds["tensor_parallel"] = {"autotp_size": 2}
    scored, layout = scoring_ds_config(
        ds, preset=PRESETS["tiny"], world=4, source="zero1_bf16.json", fast_bf16=False
    )
    assert "optimizer" not in scored and "scheduler" not in scored
    assert (layout.tensor_parallel, layout.data_parallel) == (2, 2)
    assert scored["train_batch_size"] == 2 and scored["gradient_accumulation_steps"] == 1
    assert scored["train_micro_batch_size_per_gpu"] == 1 and not scored["bf16"]["enabled"]
    assert scored["zero_optimization"]["stage"] == 0 and ds["zero_optimization"]["stage"] == 1
