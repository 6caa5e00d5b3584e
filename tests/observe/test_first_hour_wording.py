"""Wording a new user met in their first hour (issue 46, point 10): ``anneal compare``'s "no
clear win" is a clause about one row, not a tail of the list; runs of which none is a cooldown
branch are said to be so; a task that failed is a "failed" cell and a line in ``compare`` and
named on downstream.png, never silently absent; the continued-pretraining recipe's help says
what it does; ``anneal eval``'s table has a chance column; "1 unit", not "1 units"."""

from __future__ import annotations

import json
from pathlib import Path

from tests.eval.test_eval_see import add_evals, branch, cli, doc, task
from tests.observe.test_observe import good_run


def test_compare_says_no_clear_win_of_one_row_and_names_a_failed_task(tmp_path, capsys):
    parent = good_run(tmp_path / "parent")
    a = branch(tmp_path / "a", parent, val_loss=3.0, hs=0.40, arc=0.50)
    b = branch(tmp_path / "b", parent, val_loss=3.1, hs=0.43, arc=0.47)
    acc = {"acc": 0.3, "acc_stderr": 0.01}
    add_evals(b, [doc(120, {"arc_easy": task(acc)}, failed={"piqa": "offline"})])
    rc, out, _ = cli(capsys, "compare", a, b)
    lines = out.splitlines()
    assert rc == 0
    [piqa] = [ln for ln in lines if ln.startswith("  piqa ")]
    assert piqa.split()[-1] == "failed" and piqa.split()[-2] == "-"
    assert f"  b: piqa did not score at its latest scoring (anneal report {b} says why)" in lines
    for run in (a, b):  # neither a cooldown branch now
        config = json.loads((run / "config.json").read_text())
        config.pop("branch")
        (run / "config.json").write_text(json.dumps(config))
    rc, out, _ = cli(capsys, "compare", a, b)
    assert "compare 2 runs: none of them a cooldown branch; compared as they are" in out


def test_no_clear_win_is_its_own_clause(tmp_path, capsys):
    parent = good_run(tmp_path / "parent")
    a = branch(tmp_path / "a", parent, val_loss=3.0, hs=0.40, arc=0.50)
    b = branch(tmp_path / "b", parent, val_loss=3.1, hs=0.43, arc=0.47)
    rc, out, _ = cli(capsys, "compare", a, b)
    assert "  a wins on val_loss, val_bpb; no clear win on arc_easy acc (within 2 stderr of b)" in (
        out.splitlines()
    )


def test_downstream_chart_names_a_task_that_did_not_score(tmp_path, monkeypatch):
    from anneal.observe import plot_style, plots

    run = good_run(tmp_path / "run")
    acc = {"acc": 0.3, "acc_stderr": 0.01}
    add_evals(
        run,
        [
            doc(50, {"arc": task(acc)}),
            doc(100, {"arc": task(acc)}, failed={"anneal_next_line": "x"}),
        ],
    )
    titles = {}

    def keep(fig, path):
        titles[Path(path).name] = fig._suptitle.get_text() if fig._suptitle else ""
        return Path(path)

    monkeypatch.setattr(plots, "save", keep)
    monkeypatch.setattr(plot_style, "save", keep)
    plots.plot_run(run)
    assert "did not score at the latest scoring: anneal_next_line" in titles["downstream.png"]


def test_the_continued_pretraining_recipe_says_what_it_does():
    from anneal.cli.recipe import build_parser
    from anneal.model import PRETRAINED

    text = build_parser("recipes/continue_pretraining.py", preset=PRETRAINED).description
    assert text.startswith("Continue pretraining the Hugging Face model of --init-from DIR")
    assert "Pretrain the pretrained" not in text
    assert build_parser("r", preset="tiny").description.startswith("Pretrain the tiny preset")


def test_the_eval_table_has_a_chance_column(capsys):
    from types import SimpleNamespace

    from anneal.cli.evaluate import _print_summary

    tasks = {
        "anneal_next_line": task({"acc": 0.36, "acc_stderr": 0.03}),
        "wikitext": task({"word_perplexity": 90.0}, chance=None),
    }
    _print_summary(doc(10, tasks), SimpleNamespace(tag_dir="RUN/step10", hf_dir=None))
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["task", "metric", "value", "stderr", "chance"]
    assert lines[2].split() == ["anneal_next_line", "acc", "0.36", "0.03", "0.25"]
    assert lines[3].split() == ["wikitext", "word_perplexity", "90"]


def test_one_unit_is_one_unit(tmp_path, capsys):
    """``anneal data prepare --tasks 2 --task 0`` on a file of one unit."""
    from anneal.cli import main

    src = tmp_path / "a.txt"
    src.write_text("one small document\n" * 50)
    out = tmp_path / "data"
    args = ["data", "prepare", "--input", str(src), "--out", str(out), "--vocab-size", "300"]
    assert main([*args, "--tasks", "2"]) == 0
    plan = capsys.readouterr().out
    assert "1 work unit," in plan and "1 work units" not in plan
    assert main([*args, "--tasks", "2", "--task", "0"]) == 0
    done = capsys.readouterr().out
    assert ": 1 unit, " in done or ": 0 units, " in done, done
