"""House rules that code review would otherwise have to catch: deepspeed.initialize is called
in exactly one place, library modules do not read the rank from the environment, and every
test file opens with a docstring saying what it proves."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("anneal", "launcher", "recipes") for p in (ROOT / d).rglob("*.py")]


def test_deepspeed_initialize_is_called_once():
    calls = [
        (p.name, n)
        for p in SOURCES
        for n, line in enumerate(p.read_text().splitlines())
        if re.search(r"deepspeed\.initialize\(", line)
    ]
    assert len(calls) == 1 and calls[0][0] == "train.py", calls


def test_model_and_data_never_read_the_rank():
    for path in [ROOT / "anneal" / "model.py", *(ROOT / "anneal" / "data").rglob("*.py")]:
        text = path.read_text()
        assert not re.search(r"environ.*\b(LOCAL_)?RANK\b", text), path


def test_every_test_file_has_a_docstring():
    for path in (ROOT / "tests").glob("test_*.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), path.name
