"""One meaning per name (issue 40; /work/shared/STYLE.md points 16, 21 and 22), kept by fast
checks of the source, each also run on a small made-up case to show that it can fail:

- two packages of anneal/ never hold a module of the same name (two ``progress.py``);
- a top-level name (function, class, assignment at module level) is defined in one module of
  anneal/, unless it is on ``ALLOWED_TWINS`` with its reason: a public verb whose module is its
  namespace (``manifest.verify`` beside ``checks.verify``); a private helper is never on it (one
  home, imported by its public name);
- no private name of an anneal module is imported by another module (of anneal/, launcher/,
  recipes/, bench/ or scripts/), relative imports included, beyond ``ALLOWED_PRIVATE_IMPORTS``;
- ``# fmt: skip`` only on a table aligned by hand that says so beside it (``aligned by hand``
  in a comment of the statement or on the line above it); a call the formatter would wrap
  is the formatter's to wrap.

An entry of ``ALLOWED_TWINS`` or ``ALLOWED_PRIVATE_IMPORTS`` that no longer matches the code
fails, so that the lists only shrink.
"""

from __future__ import annotations

import ast
import tokenize
from collections import defaultdict
from pathlib import Path

from tests.house.test_layout import imports_of

ROOT = Path(__file__).resolve().parents[2]

ALLOWED_TWINS = {
    "log": "each module's logger, logging.getLogger(__name__): named by its module",
    "add_commands": "each cli module adds its own subcommands: data., planning., runs., evaluate.",
    "build_parser": "the `anneal` command's parser (cli) and a recipe's (cli.recipe)",
    "main": "entry points: `anneal` (cli), a recipe (cli.recipe), the report's child process",
    "load": "a verb read with its module: tokenizer., generate., compare., checkpoint., safeload.",
    "run": "a verb read with its module: a corpus prepared (data.prepare), a run (train.entry)",
    "save": "a verb read with its module: a figure (plot_style), a checkpoint (checkpoint)",
    "verify": "a verb read with its module: a prepared directory (checks), a tag (manifest)",
    "install": "a verb read with its module: tokenizer_hf., safeload., loss.",
    "check": "a verb read with its module: eval_watch., memory_layout., checkpoint.",
}
"""Public names that may be defined in several modules of anneal/, each with its reason."""

ALLOWED_PRIVATE_IMPORTS: dict[str, str] = {}
"""``"importer <- module.name"`` (``anneal.`` left out) -> why; empty, and meant to stay short."""

SCANNED = ("anneal", "launcher", "recipes", "bench", "scripts")
"""Where the private imports and the ``# fmt: skip``s are looked for (tests/ too for the
latter)."""


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _anneal_sources() -> dict[str, str]:
    return {_module(p): p.read_text() for p in sorted((ROOT / "anneal").rglob("*.py"))}


def top_level_names(text: str) -> set[str]:
    """What a module defines at its top level: functions, classes and assigned names (dunders
    such as ``__all__`` aside: Python gives them their meaning)."""
    names = set()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def twins(sources: dict[str, str]) -> dict[str, list[str]]:
    """Name -> the modules that define it, for each name defined in two or more."""
    where = defaultdict(list)
    for module, text in sources.items():
        for name in top_level_names(text):
            where[name].append(module)
    return {name: sorted(ms) for name, ms in sorted(where.items()) if len(ms) > 1}


def twin_problems(found: dict[str, list[str]], allowed: dict) -> list[str]:
    """Each twin not allowed, each private name allowed, each allowance that is no twin any
    more."""
    problems = [
        f"{name} is defined in {', '.join(ms)}: give each its own name for what it holds, or "
        f"keep one definition and import it"
        for name, ms in found.items()
        if name not in allowed
    ]
    problems += [
        f"{n}: a private helper has one home, never an allowance" for n in allowed if n[0] == "_"
    ]
    problems += [
        f"{n}: on a list but no longer a twin: remove it" for n in allowed if n not in found
    ]
    return problems


def private_imports(path: Path, text: str | None = None) -> set[str]:
    """``"this <- module.name"`` (``anneal.`` left out) of each private name that ``path``
    imports from another module of anneal (``from anneal.x import _y``, ``from .x import _y``)."""
    module = _module(path)
    return {
        f"{module.removeprefix('anneal.')} <- {base.removeprefix('anneal.')}.{name}"
        for base, names in imports_of(path, text)
        if base.split(".")[0] == "anneal" and base != module
        for name in names
        if name.startswith("_") and not name.startswith("__")
    }


def fmt_skips_without_reason(text: str) -> list[int]:
    """The lines of ``# fmt: skip`` comments whose statement says nowhere (in a comment of its
    own lines or of the line above it) that it is aligned by hand."""
    comments = {
        tok.start[0]: tok.string
        for tok in tokenize.generate_tokens(iter(text.splitlines(keepends=True)).__next__)
        if tok.type == tokenize.COMMENT
    }
    lines = text.splitlines()
    statements = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.stmt | ast.expr)]
    out = []
    for line, comment in sorted(comments.items()):
        if "fmt: skip" not in comment:
            continue
        ends_here = [n for n in statements if n.end_lineno == line] or [None]
        first = min((n.lineno for n in ends_here if n is not None), default=line)
        above = lines[first - 2].lstrip().startswith("#") if first > 1 else False
        said = " ".join(comments.get(i, "") for i in range(first - above, line + 1))
        if "aligned by hand" not in said.lower():
            out.append(line)
    return out


def _py_files(*roots: str) -> list[Path]:
    return [p for r in roots for p in sorted((ROOT / r).rglob("*.py"))]


def test_no_name_is_defined_in_two_modules_of_anneal():
    assert not twin_problems(twins(_anneal_sources()), ALLOWED_TWINS)


def module_twins(paths: list[Path]) -> dict[str, list[str]]:
    """A module's file name (``progress``) -> its paths, for each name that two packages share
    (``__init__`` and ``__main__`` aside)."""
    where = defaultdict(list)
    for p in paths:
        if p.stem not in ("__init__", "__main__"):
            where[p.stem].append(p.parent.name + "/" + p.name)
    return {stem: sorted(ps) for stem, ps in where.items() if len(ps) > 1}


def test_no_two_packages_have_a_module_of_the_same_name():
    assert module_twins(_py_files("anneal")) == {}


def test_the_module_name_check_fails_on_made_up_twins():
    paths = [
        Path(f"anneal/{p}")
        for p in (
            "data/progress.py",
            "observe/progress.py",
            "cli/__init__.py",
            "data/__init__.py",
            "cli/runs.py",
        )
    ]
    assert module_twins(paths) == {"progress": ["data/progress.py", "observe/progress.py"]}


def test_the_twin_check_fails_on_made_up_twins():
    made_up = {
        "anneal.a": "import logging\nlog = logging.getLogger(__name__)\ndef _x():\n    pass\n",
        "anneal.b": "import logging\nlog = logging.getLogger(__name__)\n_x, y = 1, 2\n",
        "anneal.c": "__all__ = []\nclass y: ...\nif True:\n    z = 1\n",
    }
    assert twins(made_up) == {
        "_x": ["anneal.a", "anneal.b"],
        "log": ["anneal.a", "anneal.b"],
        "y": ["anneal.b", "anneal.c"],
    }
    problems = twin_problems(twins(made_up), {"log": "a logger", "_x": "no", "gone": "?"})
    assert problems == [
        "y is defined in anneal.b, anneal.c: give each its own name for what it holds, or keep "
        "one definition and import it",
        "_x: a private helper has one home, never an allowance",
        "gone: on a list but no longer a twin: remove it",
    ]


def test_no_private_name_is_imported_from_another_module_of_anneal():
    found = {i for p in _py_files(*SCANNED) for i in private_imports(p)}
    allowed = set(ALLOWED_PRIVATE_IMPORTS)
    assert sorted(found - allowed) == []
    assert sorted(allowed - found) == [], "on a list but no longer imported: remove it"
    assert len(ALLOWED_PRIVATE_IMPORTS) <= 5


def test_the_private_import_check_fails_on_made_up_imports():
    path = ROOT / "anneal" / "hf" / "autoep.py"
    text = (
        "from anneal.hf.zero import _cut, cut\n"
        "from .reader import _Archive\n"
        "from . import _private_module\n"
        "from anneal.hf.autoep import _mine\n"
        "import anneal.hf.zero\n"
        "def f():\n    from ..data.units import _arrow_files\n"
    )
    assert private_imports(path, text) == {
        "hf.autoep <- hf.zero._cut",
        "hf.autoep <- hf.reader._Archive",
        "hf.autoep <- hf._private_module",
        "hf.autoep <- data.units._arrow_files",
    }


def test_fmt_skip_only_on_a_table_aligned_by_hand():
    found = {}
    for p in _py_files(*SCANNED, "tests"):
        if "fmt: skip" in (text := p.read_text()) and (lines := fmt_skips_without_reason(text)):
            found[str(p.relative_to(ROOT))] = len(lines)
    assert found == {}


def test_the_fmt_skip_check_fails_on_made_up_skips():
    text = (
        "CALL = dict(a=1,\n"
        "            b=2)  # fmt: skip\n"
        "# aligned by hand: one row per step\n"
        "STEPS = {\n"
        '    "a": (1, 2),\n'
        "}  # fmt: skip\n"
        "ROW = (1,  2)  # aligned by hand  # fmt: skip\n"
        "LATER = (1,  2)  # fmt: skip\n"
    )
    assert fmt_skips_without_reason(text) == [2, 8]
