"""``RUN/evals/step-<N>.json`` through its one owner: ``anneal.eval.results.write`` writes it by
way of ``anneal.rundir.write_eval``, ``rundir.read_eval`` gives it back only when it is such a
document (of that step, with its tasks; not a link, not another file under its name), and
``check_results_file`` keeps ``anneal eval`` from replacing a file it did not write."""

import json
from types import SimpleNamespace

import pytest

from anneal import rundir
from anneal.errors import UserError
from anneal.eval import results


def doc(step: int) -> dict:
    return {"step": step, "tokens": 10 * step, "tasks": {"t": {"metrics": {"acc": 0.5}}}}


def test_written_read_back_and_only_such_a_document(tmp_path):
    path = results.write(tmp_path, doc(3))
    assert path == rundir.eval_path(tmp_path, 3) == tmp_path / "evals" / "step-3.json"
    results.write(tmp_path, doc(12))
    assert rundir.read_eval(tmp_path, 3) == doc(3)
    assert rundir.read_evals(tmp_path) == [doc(3), doc(12)]
    assert rundir.read_eval(tmp_path, 4) is None
    rundir.eval_path(tmp_path, 5).write_text(json.dumps(doc(6)))  # another step's
    rundir.eval_path(tmp_path, 7).write_text("{not json")
    rundir.eval_path(tmp_path, 8).symlink_to(path)
    assert [rundir.read_eval(tmp_path, s) for s in (5, 7, 8)] == [None, None, None]


def test_an_existing_file_is_replaced_only_with_force_and_only_when_ours(tmp_path):
    target = SimpleNamespace(results_dir=tmp_path, step=3, run_dir=tmp_path, hf_dir=None)
    results.check_results_file(target, force=False)  # nothing there
    results.write(tmp_path, doc(3))
    with pytest.raises(UserError, match="step 3 is scored already"):
        results.check_results_file(target, force=False)
    results.check_results_file(target, force=True)
    rundir.eval_path(tmp_path, 3).write_text(json.dumps({"step": 3}))  # no tasks: not ours
    with pytest.raises(UserError, match="replaces only scores that anneal eval wrote"):
        results.check_results_file(target, force=True)
