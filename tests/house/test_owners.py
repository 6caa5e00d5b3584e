"""Each document on disk has one owner module, and no other library module opens it: no module
of anneal/, launcher/ or recipes/ but its owner spells the file's name as a path (a string that
is the name, or ends in /name; the text of a message, an f-string's literal part or a
docstring, may mention it). The owners: ``anneal.rundir`` for a run's ``config.json`` (read as
``anneal.run_record.RunRecord``), ``anneal.data.prepared_dir`` for a prepared directory's
``meta.json`` and ``token_bytes.npy``, ``anneal.hf.export`` for an export's marker. Files another
program writes too: only ``anneal.resilience.ds_files`` spells DeepSpeed's checkpoint file names
anywhere in anneal/ (code, messages and docstrings alike). And a run's record: read strictly
where a run must be there, leniently for labels, its accessors typed."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("anneal", "launcher", "recipes") for p in sorted((ROOT / d).rglob("*.py"))]

OWNERS = {
    "meta.json": {
        # PreparedDir: the one reader and writer of a prepared (or synthetic) directory's
        # meta.json, its structure checked by read_meta.
        "anneal/data/prepared_dir.py",
    },
    "token_bytes.npy": {
        # PreparedDir.token_bytes and write_token_bytes (the Trainer and prepare go through it).
        "anneal/data/prepared_dir.py",
    },
    "config.json": {
        # A run's config.json: rundir names, writes and reads it (as a RunRecord).
        "anneal/rundir.py",
        # A Hugging Face model directory's own config.json, another document of the same
        # name: read_hf_config reads a pretrained model's (--init-from) ...
        "anneal/hf/load.py",
        # ... and `anneal generate` checks that an export directory holds one.
        "anneal/hf/generate.py",
    },
    "anneal_export.json": {
        # The export's marker: write_marker and read_marker (is_export, export_every_save).
        "anneal/hf/export.py",
    },
}

PATTERN_OWNERS = {
    # DeepSpeed's checkpoint layout: its file names (model and optimizer states, each rank's,
    # AutoEP's expert files): issue 40's grep, word for word (planning's estimate of the
    # weights, gradients and optimizer state is ``MemoryEstimate.model_state``).
    r"mp_rank_|zero_pp_rank_|optim_states|model_states|expp_rank_"
    r"|layer_\S*_expert_": {"anneal/resilience/ds_files.py"},
}


def _path_strings(source: str) -> list[tuple[int, str]]:
    """(line, file name) of each string constant in ``source`` that is one of ``OWNERS``'
    names or ends in /name; the literal parts of f-strings (messages) and docstrings are left
    out, what an f-string computes (``{d / 'meta.json'}``) is not."""
    tree = ast.parse(source)
    text = {
        id(part)
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        for part in node.values
        if isinstance(part, ast.Constant)
    }
    text |= {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, name)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in text
        for name in OWNERS
        if node.value == name or node.value.endswith("/" + name)
    ]


def test_only_the_owners_spell_the_file_names():
    """Every module of anneal/, launcher/ and recipes/ that spells a document's name as a
    path is that document's owner (OWNERS), and every owner still does."""
    found: dict[str, set[str]] = {name: set() for name in OWNERS}
    for path in SOURCES:
        for _, name in _path_strings(path.read_text()):
            found[name].add(path.relative_to(ROOT).as_posix())
    assert found == OWNERS


def test_only_ds_files_spells_deepspeeds_checkpoint_files():
    """Every module of anneal/ whose text spells one of DeepSpeed's checkpoint file names (in
    code, a message or a docstring) is its owner (PATTERN_OWNERS), as ``git grep`` finds them,
    and every owner still does."""
    for pattern, owners in PATTERN_OWNERS.items():
        found = {
            path.relative_to(ROOT).as_posix()
            for path in sorted((ROOT / "anneal").rglob("*.py"))
            if re.search(pattern, path.read_text())
        }
        assert found == owners, pattern
        assert re.search(pattern, "zero_pp_rank_1_mp_rank_00_model_states.pt")
        assert not re.search(pattern, "est.model_state + est.runtime")


def test_the_scan_sees_a_path_and_not_a_message():
    """The scan on made-up code: a path built with the name, in code or inside an f-string's
    expression, is found; the same name in a message or a docstring is not."""
    source = '''
"""Reads meta.json."""
def f(d, e):
    """meta.json"""
    a = d / "meta.json"
    b = np.load(str(d) + "/token_bytes.npy")
    raise E(f"{e / 'anneal_export.json'} is not config.json; see meta.json")
'''
    assert sorted(_path_strings(source)) == [
        (5, "meta.json"),
        (6, "token_bytes.npy"),
        (7, "anneal_export.json"),
    ]


def test_a_run_record_reads_strictly_and_its_accessors_never_raise(tmp_path):
    """``rundir.read_record`` refuses what is not a run's config.json with a UserError that
    names the file (none there, not JSON, no such section) and gives None for a missing one
    with ``missing_ok``; ``record_or_empty`` reads anything, and its accessors give the values
    of a run's document, or empty ones for a section or key of another type."""
    import json

    import pytest

    from anneal import rundir
    from anneal.errors import UserError

    with pytest.raises(UserError, match="no config.json; not an Anneal run directory"):
        rundir.read_record(tmp_path)
    assert rundir.read_record(tmp_path, missing_ok=True) is None
    path = rundir.config_path(tmp_path)
    path.write_text("{not json")
    with pytest.raises(UserError, match=r"config.json: cannot be read as JSON"):
        rundir.read_record(tmp_path)
    path.write_text(json.dumps({"model": {"vocab_size": 300}}))
    with pytest.raises(UserError, match=r"config.json: not a run's config.json \(no 'run'"):
        rundir.read_record(tmp_path)
    assert rundir.read_record(tmp_path, section="model").vocab_size == 300
    doc = {
        "run": {
            "data": {"path": "/data"},
            "optim": {"schedule": "wsd"},
            "train": {"loss": "plain"},
        },
        "model": {"vocab_size": 300, "params": 1234},
        "ds_config": {
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 2},
            "scheduler": {"params": {"warmup_num_steps": 10}},
            "optimizer": {"params": {"lr": 3e-4}},
        },
        "launch": {"device": "cuda"},
        "cooldown": {"parent_run": "/runs/parent"},
    }
    path.write_text(json.dumps(doc))
    record = rundir.read_record(tmp_path)
    assert record.path == path and record.doc == doc
    assert (record.data_path, record.optim, record.loss_settings) == (
        "/data",
        {"schedule": "wsd"},
        {"loss": "plain"},
    )
    assert (record.vocab_size, record.params, record.gradient_clipping) == (300, 1234, 1.0)
    assert (record.zero_stage, record.warmup_steps, record.peak_lr) == (2, 10, 3e-4)
    assert (record.device, record.parent_run) == ("cuda", Path("/runs/parent"))
    garbage = {k: ["not", "a", "section"] for k in doc}
    for text in ("[1, 2]", "{broken", json.dumps(garbage)):
        path.write_text(text)
        empty = rundir.record_or_empty(tmp_path)
        assert (empty.run, empty.model, empty.ds_config, empty.cooldown) == ({}, {}, {}, None)
        assert (empty.data_path, empty.vocab_size, empty.warmup_steps, empty.device) == (
            None,
            None,
            None,
            "?",
        )
