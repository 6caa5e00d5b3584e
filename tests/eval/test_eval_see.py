"""Seeing downstream scores: `anneal plot` draws each task's main metric against tokens with its
chance line (downstream.png, only for a run with scores, replacing only its own chart), `anneal
report` lists each task's latest score and flags a fall of more than 2 stderr (and a task that
did not score) in an honest problem count, and `anneal compare RUN...` sets cooldown branches
side by side, marks the best of each row and says who wins on what, refusing a path that is not
a run. The runs are made up: train and val rows as tests/observe/test_observe.py writes them, evals/
documents and eval rows written by ``anneal.eval.results`` (the format the evaluators write).
In-process through ``anneal.cli.main``; a few seconds in all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tree
from tests.observe.test_observe import assert_sensible_png, good_run

ACC = [0.26, 0.29, 0.32, 0.31]  # hellaswag acc_norm at steps 25..100: the last within 2 stderr
STEPS = (25, 50, 75, 100)


def cli(capsys, *argv) -> tuple[int, str, str]:
    from anneal.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def task(metrics: dict, chance=0.25) -> dict:
    return {"metrics": metrics, "chance": chance, "config_sha256": "0" * 64, "num_fewshot": 0}


def doc(step: int, tasks: dict, *, tokens="auto", failed=None) -> dict:
    """A results document as ``anneal.eval.results`` describes it."""
    return {
        "step": step,
        "tokens": 1024 * step if tokens == "auto" else tokens,
        "source": "loop",
        "checkpoint": None,
        "manifest_sha256": None,
        "lm_eval_version": "0.4.13",
        "tasks": tasks,
        "failed": failed or {},
        "seconds": 1.0,
        "tokens_scored": 1000,
        "tokens_per_s": 1000.0,
    }


def add_evals(run: Path, docs: list[dict], *, rows: bool = True) -> Path:
    """Write each document to evals/step-N.json and (``rows``) its metrics row, as the
    evaluators do."""
    from anneal.eval import results

    for d in docs:
        results.write(run, d)
    if rows:
        with open(run / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps(results.metrics_row(d)) + "\n" for d in docs)
    return run


def scored_run(run: Path, acc=ACC) -> Path:
    """A good run scored at steps 25..100 on three tasks: hellaswag (acc and acc_norm, chance
    0.25), wikitext (a perplexity only), anneal_next_line (acc, chance 0.25)."""
    docs = [
        doc(
            s,
            {
                "hellaswag": task(
                    {"acc": a - 0.01, "acc_stderr": 0.01, "acc_norm": a, "acc_norm_stderr": 0.01}
                ),
                "wikitext": task({"word_perplexity": 900.0 / (i + 1)}, chance=None),
                "anneal_next_line": task({"acc": 0.3 + 0.05 * i, "acc_stderr": 0.02}),
            },
        )
        for i, (s, a) in enumerate(zip(STEPS, acc, strict=True))
    ]
    return add_evals(good_run(run), docs)


def test_a_tasks_main_metric_is_acc_norm_then_acc_then_the_first_by_name():
    """acc_norm wins over acc; acc over any other; otherwise the first metric by name, never a
    stderr; a filtered metric's stderr is named as results.metric_name names lm-eval's keys."""
    from anneal.observe.downstream import lower_is_better, main_metric, stderr_name

    assert main_metric({"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}) == "acc_norm"
    assert main_metric({"acc_stderr", "acc", "acc_mutual_info"}) == "acc"
    assert main_metric({"word_perplexity", "bits_per_byte", "byte_perplexity"}) == "bits_per_byte"
    assert main_metric({"acc_stderr"}) is None
    assert stderr_name("acc/strict") == "acc_stderr/strict" and stderr_name("acc") == "acc_stderr"
    assert lower_is_better("word_perplexity") and not lower_is_better("acc_norm")


def test_scores_come_from_the_documents_and_the_eval_rows_fill_a_step_without_one(tmp_path):
    """A step's document wins over its eval row (the row says otherwise here); a step with
    only an eval row (its document gone) still counts, with its stderr; a document without
    tokens (a Hugging Face directory scored at --step) takes the train row's of its step."""
    from anneal.eval import results
    from anneal.observe.downstream import read_scores
    from anneal.rundir import read_metrics

    run = good_run(tmp_path / "run")
    hs = {"acc": 0.3, "acc_stderr": 0.01}
    add_evals(run, [doc(25, {"hs": task(hs)}), doc(50, {"hs": task(hs)}, tokens=None)])
    row = results.metrics_row(doc(25, {"hs": task({"acc": 0.9, "acc_stderr": 0.5})}))
    only_row = results.metrics_row(doc(75, {"hs": task({"acc": 0.4, "acc_stderr": 0.02})}))
    with open(run / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in (row, only_row))
    [hs_scores] = read_scores(run, read_metrics(run))
    got = [(s.step, s.tokens, s.value, s.stderr) for s in hs_scores.scores]
    assert got == [
        (25, 25 * 1024, 0.3, 0.01),
        (50, 50 * 1024, 0.3, 0.01),
        (75, 75 * 1024, 0.4, 0.02),
    ]
    assert (hs_scores.metric, hs_scores.chance) == ("acc", 0.25)


def test_the_downstream_chart_draws_each_tasks_main_metric_against_tokens(tmp_path, monkeypatch):
    """downstream.png: one panel per task (by name), each task's main metric against tokens
    with its stderr, the chance line dashed at the document's chance (none for a perplexity),
    the perplexity on a log axis; a valid PNG of a sensible size."""
    from anneal.observe import plot_style, plots

    run = scored_run(tmp_path / "run")
    drawn = {}
    real_save = plot_style.save

    def keep(fig, path):
        drawn[Path(path).name] = [ax for ax in fig.axes if ax.get_visible()]
        return real_save(fig, path)

    monkeypatch.setattr(plots, "save", keep)
    monkeypatch.setattr(plot_style, "save", keep)
    paths = plots.plot_run(run)
    assert run / "plots" / "downstream.png" in paths
    assert_sensible_png(run / "plots" / "downstream.png")
    axes = drawn["downstream.png"]
    assert [ax.get_title() for ax in axes] == ["anneal_next_line", "hellaswag", "wikitext"]
    tokens = [1024 * s for s in STEPS]
    for ax, metric, values in (
        (axes[0], "acc", [0.3, 0.35, 0.4, 0.45]),
        (axes[1], "acc_norm", ACC),
        (axes[2], "word_perplexity", [900.0, 450.0, 300.0, 225.0]),
    ):
        [bars] = [b for b in ax.containers if b.get_label() == metric]
        line = bars.lines[0]
        assert list(line.get_xdata()) == tokens and list(line.get_ydata()) == pytest.approx(values)
        chance = [ln for ln in ax.lines if ln.get_label().startswith("chance")]
        if metric == "word_perplexity":
            assert chance == [] and ax.get_yscale() == "log"
        else:
            assert [ln.get_ydata()[0] for ln in chance] == [0.25]
            assert chance[0].get_linestyle() == "--" and ax.get_yscale() == "linear"


def test_no_downstream_chart_for_a_run_without_scores(tmp_path, capsys):
    """A run with no evals/ and no eval rows gets the four charts it always had, no more."""
    run = good_run(tmp_path / "run")
    rc, out, _ = cli(capsys, "plot", run)
    assert rc == 0 and "downstream.png" not in out
    assert sorted(p.name for p in (run / "plots").iterdir()) == [
        "grad_norm.png",
        "loss.png",
        "lr.png",
        "throughput.png",
    ]


def test_downstream_png_replaces_only_its_own_chart(tmp_path, capsys, caplog):
    """A plots/downstream.png that Matplotlib did not write is refused by `anneal plot` (exit 2,
    the tree as it was) and kept byte for byte by the end of a run, which draws the others;
    Anneal's own downstream.png is replaced."""
    from anneal.observe.report import end_of_run

    run = scored_run(tmp_path / "run")
    (run / "plots").mkdir()
    mine = run / "plots" / "downstream.png"
    mine.write_bytes(b"\xff\xd8\xff\xe0 a photo of mine, named like a chart")
    before = tree(tmp_path)
    rc, _, err = cli(capsys, "plot", run)
    assert rc == 2 and str(mine) in err and "not a chart Anneal drew" in err
    assert tree(tmp_path) == before
    end_of_run(run)
    assert tree(mine) == {k: v for k, v in before.items() if k == str(mine)}
    assert f"{mine}: not a chart Anneal drew" in caplog.text
    assert_sensible_png(run / "plots" / "loss.png")
    mine.unlink()
    assert cli(capsys, "plot", run)[0] == 0
    assert cli(capsys, "plot", run)[0] == 0  # its own chart: replaced
    assert_sensible_png(mine)


def test_the_report_lists_each_tasks_latest_score_and_flags_a_fall(tmp_path, capsys):
    """Each task's latest main metric with its stderr and step; hellaswag 0.31 after a best of
    0.32 is within 2 stderr (0.01 each): healthy. At 0.29 it fell by more than 2 stderr: a
    problem, said with its rule, counted in the last line. A perplexity that rises by more
    than 2 stderr fell too. report.txt keeps the format that says it is Anneal's."""
    from anneal.observe.report import HEALTHY, PROBLEM, health, write_report
    from anneal.rundir import written_by_anneal

    run = scored_run(tmp_path / "ok")
    signals = {s.name: s for s in health(run)}
    hs = signals["downstream hellaswag"]
    assert hs.status == HEALTHY, hs
    assert hs.detail == (
        "acc_norm 0.31 ± 0.01 at step 100 (chance 0.25); best earlier 0.32 at step 75"
    )
    assert signals["downstream anneal_next_line"].detail.startswith("acc 0.45 ± 0.02 at step 100")
    wiki = signals["downstream wikitext"]
    assert wiki.status == HEALTHY and "no stderr, so a fall is not judged" in wiki.detail
    assert write_report(run).endswith("  no problems")

    fell = scored_run(tmp_path / "fell", acc=[0.26, 0.29, 0.32, 0.29])
    signals = {s.name: s for s in health(fell)}
    assert signals["downstream hellaswag"].status == PROBLEM
    assert signals["downstream hellaswag"].detail == (
        "fell: acc_norm 0.29 ± 0.01 at step 100 (chance 0.25), more than 2 x its stderr below "
        "its best earlier 0.32 at step 75"
    )
    text = write_report(fell)
    assert text.splitlines()[-1] == "  1 problem(s)"
    assert written_by_anneal(fell / "report.txt")
    rc, out, _ = cli(capsys, "report", fell, "--strict")
    assert rc == 1 and "fell: acc_norm 0.29" in out

    ppl = good_run(tmp_path / "ppl")
    add_evals(
        ppl,
        [
            doc(s, {"wiki": task({"word_perplexity": v, "word_perplexity_stderr": 1.0}, None)})
            for s, v in ((25, 50.0), (50, 40.0), (75, 43.0))
        ],
    )
    [wiki] = [s for s in health(ppl) if s.name == "downstream wiki"]
    assert wiki.status == PROBLEM and "above its best earlier 40 at step 50" in wiki.detail


def test_a_task_that_did_not_score_and_a_damaged_document_are_problems(tmp_path, capsys, caplog):
    """A task the latest scoring did not score (its document's ``failed``) is a problem with the
    reason, as is one never scored; a task scored once is n/a (nothing to compare). A document
    that is not JSON is left out with a warning naming it (issue 41: a file from elsewhere),
    and the step's metrics row stands in for it: the report, `anneal plot` and the end of a
    run draw what there is."""
    from anneal.observe.report import PROBLEM, UNKNOWN, end_of_run, health

    run = good_run(tmp_path / "run")
    acc = {"acc": 0.3, "acc_stderr": 0.01}
    add_evals(
        run,
        [
            doc(50, {"arc": task(acc), "piqa": task(acc)}),
            doc(100, {"piqa": task(acc)}, failed={"arc": "boom\nat line 3", "mmlu": "offline"}),
        ],
    )
    signals = {s.name: s for s in health(run)}
    assert signals["downstream arc"].status == PROBLEM
    assert signals["downstream arc"].detail == (
        "did not score at step 100 (boom at line 3); last acc 0.3 ± 0.01 at step 50 (chance 0.25)"
    )
    assert signals["downstream mmlu"].status == PROBLEM
    assert signals["downstream mmlu"].detail == "never scored: offline"
    assert signals["downstream piqa"].status != PROBLEM

    once = add_evals(good_run(tmp_path / "once"), [doc(100, {"piqa": task(acc)})])
    [piqa] = [s for s in health(once) if s.name == "downstream piqa"]
    assert piqa.status == UNKNOWN and "one scoring" in piqa.detail

    (once / "evals" / "step-100.json").write_text('{"step": 100, "tasks": ')
    [row] = [s for s in health(once) if s.name.startswith("downstream")]
    assert row.name == "downstream piqa" and "at step 100" in row.detail  # its metrics row
    assert "step-100.json: skipped, not a score document anneal eval writes" in caplog.text
    rc, _, err = cli(capsys, "plot", once)
    assert rc == 0 and (once / "plots" / "downstream.png").is_file()
    end_of_run(once)
    assert (once / "report.txt").read_text().endswith("  no problems\n")
    assert (once / "plots" / "loss.png").is_file()


def branch(run: Path, parent: Path, *, val_loss: float, hs: float, arc: float) -> Path:
    """A cooldown branch of ``parent`` at step 80 (config.json's ``branch`` section, as
    anneal.resolution.cooldown.Branch.to_dict writes it) with its last validation and scores."""
    good_run(run)
    config = json.loads((run / "config.json").read_text())
    config["run"] = {"optim": {"schedule": "wsd"}}
    config["branch"] = {
        "parent_run": str(parent),
        "checkpoint": str(parent / "checkpoints" / "step00000080"),
        "step": 80,
        "manifest_sha256": "ab" * 32,
        "cooldown_tokens": 20480,
        "cooldown_steps": 20,
        "from_ratio": 1.0,
        "same_data": True,
    }
    (run / "config.json").write_text(json.dumps(config))
    with open(run / "metrics.jsonl", "a") as f:
        f.write(
            json.dumps({"kind": "val", "step": 100, "val_loss": val_loss, "val_bpb": val_loss / 2})
            + "\n"
        )
    tasks = {
        "hellaswag": task(
            {"acc_norm": hs, "acc_norm_stderr": 0.01, "acc": 0.2, "acc_stderr": 0.01}
        ),
        "arc_easy": task({"acc": arc, "acc_stderr": 0.02}),
    }
    return add_evals(run, [doc(100, tasks)])


def test_compare_sets_branches_side_by_side_and_says_who_wins(tmp_path, capsys):
    """Two cooldown branches of one parent: their last val_loss and val_bpb and latest scores
    (each task's main metric) in one row each, the best marked; a wins on validation and on
    arc_easy by 0.03 (within 2 x sqrt(0.02^2 + 0.02^2) = 0.057: no clear win), b on hellaswag
    by 0.03 (more than 2 x sqrt(2) x 0.01 = 0.028). The runs are only read."""
    parent = good_run(tmp_path / "parent")
    a = branch(tmp_path / "a", parent, val_loss=3.0, hs=0.40, arc=0.50)
    b = branch(tmp_path / "b", parent, val_loss=3.1, hs=0.43, arc=0.47)
    before = tree(tmp_path)
    rc, out, _ = cli(capsys, "compare", a, b)
    assert rc == 0 and tree(tmp_path) == before
    assert out.splitlines() == [
        f"compare 2 runs: cooldown branches of {parent.resolve()}",
        f"  a  {a}: branch at step 80 (20 steps of cooldown); last validation at step 100, "
        "downstream at step 100",
        f"  b  {b}: branch at step 80 (20 steps of cooldown); last validation at step 100, "
        "downstream at step 100",
        "                      a            b",
        "  val_loss            3.0000*      3.1000",
        "  val_bpb             1.5000*      1.5500",
        "  arc_easy acc        0.5 ± 0.02*  0.47 ± 0.02",
        "  hellaswag acc_norm  0.4 ± 0.01   0.43 ± 0.01*",
        "  * the best of its row: the lowest loss, bits per byte or perplexity, the highest "
        "score otherwise",
        "  a wins on val_loss, val_bpb; no clear win on arc_easy acc (within 2 stderr of b)",
        "  b wins on hellaswag acc_norm",
    ]
    config = json.loads((parent / "config.json").read_text())
    (parent / "config.json").write_text(json.dumps({**config, "run": {}}))
    rc, out, _ = cli(capsys, "compare", a, parent, b)
    assert rc == 0 and "not all cooldown branches of one parent" in out
    assert "  parent  " in out and "not a cooldown branch" in out


def test_compare_refuses_what_is_not_two_runs(tmp_path, capsys):
    """A path that is not a run (a directory without config.json, a file, a missing path), a
    single run, and one run named twice: exit 2 with one paragraph naming it, nothing
    written."""
    parent = good_run(tmp_path / "parent")
    a = branch(tmp_path / "a", parent, val_loss=3.0, hs=0.4, arc=0.5)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    for other in (tmp_path / "notes", tmp_path / "notes.txt", tmp_path / "missing"):
        rc, _, err = cli(capsys, "compare", a, other)
        assert rc == 2 and err.startswith("anneal compare: error: ") and str(other) in err
        assert "not an Anneal run directory (give the --out of a run)" in err
    rc, _, err = cli(capsys, "compare", a)
    assert rc == 2 and "two or more runs" in err
    rc, _, err = cli(capsys, "compare", a, tmp_path / "a" / ".." / "a")
    assert rc == 2 and "the same run as" in err
    assert tree(tmp_path) == before


def test_documents_from_elsewhere_never_break_the_plot_or_the_report(tmp_path, capsys, caplog):
    """evals/ documents edited by hand or written by something else: tasks that are not an
    object, metrics that are strings, booleans, NaN or infinite, a chance that is a string, a
    step that is not a count, a task name with a newline; each such document is left out with
    a warning naming it. A task name with a ``$`` (Matplotlib's math) is drawn as text.
    `anneal plot` and `anneal report` print no traceback, the report's lines stay one per
    signal, and the good scores still show."""
    run = good_run(tmp_path / "run")
    evals = run / "evals"
    evals.mkdir()
    odd = {
        "step-10.json": {"step": 10, "tasks": ["not", "an", "object"]},
        "step-20.json": {"step": "twenty", "tasks": {"x": task({"acc": 0.5})}},
        "step-30.json": {
            "step": 30,
            "tokens": -5,
            "tasks": {
                "bad\nname $x^$": task({"acc": 0.4, "acc_stderr": "0.01"}, chance="0.25"),
                "weird": {"metrics": {"acc": True, "acc_norm": float("nan"), "b": 1e999}},
                "listed": {"metrics": [1, 2]},
            },
            "failed": ["a", "list"],
        },
        "step-40.json": doc(40, {"name $x^$": task({"acc": 0.45, "acc_stderr": 0.01})}),
    }
    for name, body in odd.items():
        (evals / name).write_text(json.dumps(body))
    rc, out, err = cli(capsys, "report", run)
    assert rc == 0, err
    lines = out.splitlines()
    [line] = [ln for ln in lines if "name $x^$" in ln]
    assert "n/a      acc 0.45 ± 0.01 at step 40 (chance 0.25); one scoring" in line
    for step in (10, 20, 30):
        assert f"step-{step}.json: skipped, not a score document" in caplog.text
    assert not any("weird" in ln or "listed" in ln or " x " in ln for ln in lines)
    assert lines[-1] == "  no problems"
    rc, out, err = cli(capsys, "plot", run)
    assert rc == 0 and f"wrote {run / 'plots' / 'downstream.png'}" in out, err
    assert_sensible_png(run / "plots" / "downstream.png")


def test_the_end_of_run_process_imports_no_torch(tmp_path):
    """The plots and report at the end of a run are drawn by ``python -m anneal.observe.report``
    in a process of its own (``anneal.observe.progress.finish_run``), which every run that
    reaches its last step waits for: it draws the charts and the report, and imports neither
    torch nor DeepSpeed (importing torch for the manifests' rank helpers, ``anneal.dist``, made
    it 2.7 s instead of 1.1 s here)."""
    import subprocess
    import sys

    from tests.conftest import env

    run = scored_run(tmp_path / "run")
    code = (
        "import sys\nfrom anneal.observe import report\n"
        f"rc = report.main([{str(run)!r}, '--end-of-run'])\n"
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules)\n"
        "print('rc', rc, 'heavy', heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "rc 0 heavy []" in done.stdout, done.stdout + done.stderr
    assert (run / "report.txt").is_file() and (run / "plots" / "loss.png").is_file()
