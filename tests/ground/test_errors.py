"""One user-error type, used the same way everywhere.

- ``UserError(message, every_rank=...)`` takes ``every_rank`` as a keyword-only constructor
  argument (default False), keeps it through pickling, and no module sets it by mutating an
  exception after the fact.
- Every ``raise ValueError`` left in ``anneal/`` (found by walking the syntax tree) is listed
  below with the reason user input cannot reach it: a new one fails this test until it is a
  ``UserError`` or its reason is written here.
- The strict ds_config loader refuses a ``scheduler.params.warmup_type`` that Anneal's schedule
  does not implement, naming the file, the key and the choices, before ``Schedule.resolved`` (whose
  own ``ValueError`` is then an internal invariant) could see it.
"""

import ast
import json
import pickle
from pathlib import Path

import pytest

from anneal.errors import UserError
from anneal.resolution.ds import load_ds_config

ROOT = Path(__file__).resolve().parents[2]

INTERNAL_VALUE_ERRORS = {
    ("anneal/model/float8_rule.py", "gains"): (
        "recipe is train.float8, which reaches it only through the strict loader's choices "
        "(anneal/config/run_checks.py: off, tensorwise, rowwise), and only when not off"
    ),
    ("anneal/model/float8_rule.py", "choose_float8"): (
        "layers is train.float8_layers, which reaches it only through the strict loader's "
        "choices (anneal/config/run_checks.py: auto, all)"
    ),
    ("anneal/resolution/ds_resolve.py", "batch_arithmetic"): (
        "its one caller, resolve_ds_config, always passes the accumulation or the "
        "global batch (a missing key reads as auto, and auto/auto computes the batch)"
    ),
    ("anneal/config/schedule.py", "Schedule.resolved"): (
        "warmup_type reaches it only through the strict loader, whose RANGES refuse all but "
        "'linear' (test_warmup_type_is_refused_by_the_loader)"
    ),
    ("anneal/resolution/resolve.py", "_resolve"): (
        "device_type comes from torch or from the launcher's --device, an argparse choice of "
        "cuda/cpu"
    ),
    ("anneal/data/stream.py", "TokenStream.__init__"): (
        "rank and world size come from torch.distributed, never from the user"
    ),
    ("anneal/files.py", "read_regular"): (
        "caught by its callers (rundir._eval_doc: a warning naming the score document; "
        "eval.results' --samples check and eval.task_files' YAML read: a UserError naming the "
        "file; eval.next_line's comparison: False, the file rebuilt), "
        "test_planted_score_documents_are_skipped_with_one_warning_each"
    ),
    ("anneal/json_values.py", "loads_bounded"): (
        "caught by its one caller, rundir._eval_doc, which skips the document with a warning "
        "naming it (test_planted_score_documents_are_skipped_with_one_warning_each)"
    ),
    ("anneal/hf/weight_files.py", "_entry"): (
        "caught by its one caller, safetensors_header, which raises a UserError naming the "
        "file (test_init_from's damaged and truncated weight files)"
    ),
}
"""(module, enclosing function) -> why no user input reaches its ``raise ValueError``."""


def _raises_of(name: str, tree: ast.AST) -> list[str]:
    """Qualified names of the functions that hold a ``raise name(...)``."""
    found: list[str] = []

    def walk(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                walk(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id == name:
                    found.append(".".join(scope) or "<module>")
            walk(child, scope)

    walk(tree, [])
    return found


def _library_trees():
    for path in sorted((ROOT / "anneal").rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), filename=str(path))


def test_every_value_error_left_is_an_internal_invariant():
    found = {
        (module, where)
        for module, tree in _library_trees()
        for where in _raises_of("ValueError", tree)
    }
    unjustified = sorted(found - INTERNAL_VALUE_ERRORS.keys())
    assert not unjustified, (
        f"raise ValueError in {unjustified}: raise UserError if user input can reach it, or "
        f"add the reason it cannot to INTERNAL_VALUE_ERRORS"
    )
    stale = sorted(INTERNAL_VALUE_ERRORS.keys() - found)
    assert not stale, f"INTERNAL_VALUE_ERRORS names raises that are gone: {stale}"


def test_every_rank_is_a_constructor_argument_only():
    mutated = []
    for root in ("anneal", "launcher", "recipes"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                targets = node.targets if isinstance(node, ast.Assign) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr == "every_rank":
                        if path.name != "errors.py":
                            mutated.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not mutated, f"set every_rank with UserError(..., every_rank=True): {mutated}"


def test_user_error_every_rank():
    assert UserError("x").every_rank is False
    err = UserError("bad key", every_rank=True)
    assert err.every_rank is True and str(err) == "bad key"
    with pytest.raises(TypeError):
        UserError("x", True)  # keyword-only, so a second message is never read as the flag
    again = pickle.loads(pickle.dumps(err))
    assert again.every_rank is True and str(again) == "bad key"


def test_warmup_type_is_refused_by_the_loader(tmp_path):
    cfg = json.loads((ROOT / "ds_configs" / "cpu.json").read_text())
    cfg["scheduler"]["params"]["warmup_type"] = "log"
    path = tmp_path / "log_warmup.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(UserError) as e:
        load_ds_config(path)
    msg = str(e.value)
    assert str(path) in msg and "scheduler.params.warmup_type" in msg
    assert '"linear"' in msg and '"log"' in msg
