"""House rules that code review would otherwise have to catch: deepspeed.initialize is called
in exactly one place, library modules do not read the rank from the environment, every
test file opens with a docstring saying what it proves, no module is over 400 lines and no
function over 80, and no two of anneal's modules import each other, directly or around a
circle (imports inside functions and under ``if TYPE_CHECKING:`` count). The layer rules of
docs/architecture.md: each part imports only the parts below it that its row of the table
allows (config/, the typed schema, only the ground floor: errors, files, dist, hardware,
json_values; the loop nothing of anneal/hf but its checkpoint loader; anneal/hf nothing of the
launch, the loop, the observers or the CLI); the document's table is this file's and its
drawing is the import graph; and the model and data never import DeepSpeed."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("anneal", "launcher", "recipes") for p in (ROOT / d).rglob("*.py")]


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
LIMITED = [p for d in ("anneal", "launcher", "recipes", "bench") for p in (ROOT / d).rglob("*.py")]


def _over_limits(name: str, text: str) -> list[str]:
    """What of one module (``text``, reported as ``name``) is over the house limits: the module
    over MAX_MODULE_LINES lines, and each function (methods, nested and async ones included;
    from its ``def`` line to its last, as the AST numbers them) over MAX_FUNCTION_LINES."""
    over = []
    if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
        over.append(f"{name}: {lines} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                over.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return over


def test_modules_and_functions_within_the_house_limits():
    """Every module of anneal/, launcher/, recipes/ and bench/ holds at most 400 lines and
    every function in them at most 80: a longer one is split where its meaning splits."""
    assert len(LIMITED) > 100, "the walk found too few modules: it is broken"
    over = [v for p in LIMITED for v in _over_limits(str(p.relative_to(ROOT)), p.read_text())]
    assert not over, "\n".join(["over the house limits (lines of a module, of a function):", *over])


def test_the_limit_check_sees_a_long_function_and_a_long_module():
    """The check above on made-up modules: a function of 80 lines and a module of 400 pass; a
    method of 81 lines (async, in a class), a nested function of 81 and a module of 401 do
    not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    fits = "def f():\n" + body
    assert len(fits.splitlines()) == 80 and _over_limits("m.py", fits) == []
    method = "class C:\n    async def g(self):\n        y = 0\n" + body.replace("    ", "        ")
    nested = "def outer():\n    def inner():\n        y = 0\n" + body.replace("    ", "        ")
    assert _over_limits("m.py", method) == ["m.py:2 g: 81 lines"]
    assert _over_limits("m.py", nested) == ["m.py:1 outer: 82 lines", "m.py:2 inner: 81 lines"]
    module = "".join(f"x{i} = {i}\n" for i in range(400))
    assert _over_limits("m.py", module) == []
    assert _over_limits("m.py", module + "y = 0\n") == ["m.py: 401 lines"]


def test_deepspeed_initialize_is_called_once():
    calls = [
        (p.name, n)
        for p in SOURCES
        for n, line in enumerate(p.read_text().splitlines())
        if re.search(r"deepspeed\.initialize\(", line)
    ]
    assert len(calls) == 1 and calls[0][0] == "engine.py", calls


def test_model_and_data_never_read_the_rank():
    for path in [
        *(ROOT / "anneal" / "model").rglob("*.py"),
        *(ROOT / "anneal" / "data").rglob("*.py"),
    ]:
        text = path.read_text()
        assert not re.search(r"environ.*\b(LOCAL_)?RANK\b", text), path


def test_every_test_file_has_a_docstring():
    for path in (ROOT / "tests").rglob("test_*.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), path.name


def imports_of(path: Path, text: str | None = None) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement in ``path`` (or in ``text``, read as that
    module): at module level, inside functions and under ``if TYPE_CHECKING:`` alike (a type
    named in a signature is a dependency too); relative imports made absolute. ``import a.b``
    gives ("a.b", []), ``from a import b, c`` gives ("a", ["b", "c"])."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = []
    for n in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(n, ast.Import):
            found += [(a.name, []) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                base = ".".join([*package[: len(package) - n.level + 1], *([base] if base else [])])
            found.append((base, [a.name for a in n.names]))
    return found


def _anneal_imports(path: Path, modules: set[str]) -> set[str]:
    """The ``anneal`` modules that ``path`` imports (``imports_of``). ``from anneal.x import y``
    counts as ``anneal.x.y`` where that is a module, else as ``anneal.x``."""
    found = set()
    for base, names in imports_of(path):
        found |= {f"{base}.{a}" if f"{base}.{a}" in modules else base for a in names} or {base}
    return {m for m in found if m in modules}


def _anneal_graph() -> dict[str, set[str]]:
    """Module name -> the anneal modules it imports, for every module under anneal/."""
    files = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (ROOT / "anneal").rglob("*.py")
    }
    return {m: _anneal_imports(p, set(files)) - {m} for m, p in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_circle_among_anneal_modules():
    graph = _anneal_graph()
    assert graph["anneal.cli"], "the import walk found nothing: it is broken"
    assert _cycles(graph) == [], "import circles among anneal's modules"


def _in(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


GROUND = (
    "anneal",
    "anneal.errors",
    "anneal.files",
    "anneal.dist",
    "anneal.hardware",
    "anneal.json_values",
)
# docs/architecture.md, "Who may import whom": each part of anneal, from the top of the map to its
# ground floor, and the parts it may import besides its own modules, all listed after it. Every
# import of every module is checked against it, so a new arrow is a deliberate change of this
# table, of the document's and of its drawing. Aligned by hand, as the document's table.
MAY_IMPORT = {
    "cli": {"train", "eval", "observe", "resolution", "hf", "resilience", "planning", "data",
            "model", "rundir", "run_record", "config", "ground"},
    "train": {"eval", "observe", "resolution", "resilience", "planning", "data", "model", "rundir",
              "run_record", "config", "ground"},
    "eval": {"observe", "resolution", "resilience", "planning", "data", "model", "rundir",
             "run_record", "config", "ground"},
    "observe": {"resolution", "planning", "data", "model", "rundir", "run_record", "config",
                "ground"},
    "resolution": {"resilience", "data", "model", "rundir", "run_record", "config", "ground"},
    "hf": {"resilience", "data", "model", "rundir", "run_record", "config", "ground"},
    "resilience": {"model", "rundir", "run_record", "config", "ground"},
    "planning": {"model", "rundir", "run_record", "config", "ground"},
    "data": {"rundir", "run_record", "config", "ground"},
    "model": {"config", "ground"},
    "rundir": {"run_record", "config", "ground"},
    "run_record": {"ground"},
    "config": {"ground"},
    "ground": set(),
}  # fmt: skip
# Single modules that a part may import of a part below it that its row does not name.
# Continued pretraining (--init-from) reads a Hugging Face checkpoint and checks the data's
# tokenizer against it when the launch is resolved (resolution/: hf.load) and copies its tensors
# into
# the model when the engine is built (train/: hf.load_weights). Neither imports the exporter:
# the loop never does (test_the_hf_loader_imports_nothing_of_the_export).
MAY_IMPORT_MODULES = {
    "resolution": {"anneal.hf.load"},
    "train": {"anneal.hf.load_weights"},
}


def _part(module: str) -> str:
    """The part of docs/architecture.md's map that ``module`` belongs to."""
    if module in GROUND:
        return "ground"
    part = module.split(".")[1]
    assert part in MAY_IMPORT, f"{module}: not on the map of docs/architecture.md"
    return part


def test_the_map_is_a_stack_without_cycles():
    """Each part of the table may import only parts listed after it (single modules
    included), so the table is a stack: no arrow leads up, and no circle is possible."""
    order = list(MAY_IMPORT)
    for part, allowed in MAY_IMPORT.items():
        below = set(order[order.index(part) + 1 :])
        assert allowed <= below, f"{part} may import {sorted(allowed - below)}, not below it"
        modules = {_part(m) for m in MAY_IMPORT_MODULES.get(part, ())}
        assert modules <= below - allowed, (
            f"{part}: {sorted(modules)} not below it, or no exception"
        )


def _broken(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{importer} imports {m}"
        for importer, deps in sorted(graph.items())
        for m in sorted(deps)
        if _part(m) != _part(importer)
        and _part(m) not in MAY_IMPORT[_part(importer)]
        and m not in MAY_IMPORT_MODULES.get(_part(importer), ())
    ]


def test_layer_rules_between_anneal_packages():
    """Every import of every module of anneal (type-only ones counted) follows the table."""
    graph = _anneal_graph()
    assert {_part(m) for m in graph} == set(MAY_IMPORT), "a part of the map has no module"
    assert _broken(graph) == [], "imports that docs/architecture.md does not allow"


def test_the_layer_check_sees_a_forbidden_arrow():
    """The check above on made-up edges: the loop importing the exporter, the ground floor
    importing the schema and the schema importing the Hugging Face loader are refused; the
    exporter importing a manifest reader and the engine importing the Hugging Face loader are
    not."""
    graph = {
        "anneal.train.trainer": {"anneal.hf.export", "anneal.config.run"},
        "anneal.train.engine": {"anneal.hf.load_weights"},
        "anneal.files": {"anneal.config.run", "anneal.errors"},
        "anneal.config.run": {"anneal.hf.load"},
        "anneal.hf.export": {"anneal.resilience.checkpoint"},
    }
    assert _broken(graph) == [
        "anneal.config.run imports anneal.hf.load",
        "anneal.files imports anneal.config.run",
        "anneal.train.trainer imports anneal.hf.export",
    ]


def test_a_type_only_import_counts():
    """An import under ``if TYPE_CHECKING:`` is an arrow of the graph like any other (the guard
    named the run config's type that way while resilience/ stood below config/)."""
    text = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from anneal.config.run import GuardConfig\n"
        "    from . import checkpoint\n"
    )
    path = ROOT / "anneal" / "resilience" / "made_up.py"
    assert imports_of(path, text) == [
        ("typing", ["TYPE_CHECKING"]),
        ("anneal.config.run", ["GuardConfig"]),
        ("anneal.resilience", ["checkpoint"]),
    ]


def test_the_hf_loader_imports_nothing_of_the_export():
    """The modules of hf/ that resolution/ and train/ may import reach, through their own imports,
    only the loader: hf.load, hf.load_weights, the weight files' reader and the experts' two
    sets of names (fused in the model, one matrix each in the files)."""
    graph = _anneal_graph()
    reached, todo = set(), set().union(*MAY_IMPORT_MODULES.values())
    while todo:
        module = todo.pop()
        reached.add(module)
        todo |= {m for m in graph[module] if _part(m) == "hf"} - reached
    assert reached == {
        "anneal.hf.load",
        "anneal.hf.load_weights",
        "anneal.hf.weight_files",
        "anneal.hf.expert_names",
    }


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _section(title: str) -> str:
    """The text of docs/architecture.md's section ``## title``, up to the next section."""
    text = ARCHITECTURE.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _docs_table() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """docs/architecture.md's table, read as ``MAY_IMPORT`` and ``MAY_IMPORT_MODULES``: one row
    per part, its name, then the parts and then the single modules it may import, each as
    code."""
    may, modules = {}, {}
    for row in _section("Who may import whom").splitlines():
        if row.startswith("| `"):
            part, parts, single = (cell.strip() for cell in row.strip().strip("|").split("|"))
            may[part.strip("`")] = set(re.findall(r"`([\w.]+)`", parts))
            if found := set(re.findall(r"`([\w.]+)`", single)):
                modules[part.strip("`")] = found
    return may, modules


def test_the_documents_table_is_the_one_checked():
    """docs/architecture.md's table names the parts in the order of ``MAY_IMPORT``, each with
    the parts and single modules that ``MAY_IMPORT`` and ``MAY_IMPORT_MODULES`` allow it."""
    may, modules = _docs_table()
    assert list(may) == list(MAY_IMPORT)
    assert may == MAY_IMPORT
    assert modules == MAY_IMPORT_MODULES


def _drawn_arrows(graph: dict[str, set[str]]) -> set[tuple[str, str, str]]:
    """The arrows between parts that the map draws for the module graph ``graph``, as (part,
    part it imports, label). An arrow the table allows is drawn unless a longer path of such
    arrows implies it; an arrow made of single modules (``MAY_IMPORT_MODULES``) is always
    drawn, labelled with those modules, and implies nothing beyond them."""
    imported: dict[tuple[str, str], set[str]] = {}
    for module, deps in graph.items():
        for m in deps:
            if _part(m) != _part(module):
                imported.setdefault((_part(module), _part(m)), set()).add(m)
    full: dict[str, set[str]] = {}
    for a, b in imported:
        if b in MAY_IMPORT[a]:
            full.setdefault(a, set()).add(b)

    def reached(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            todo += full.get(part := todo.pop(), set()) - seen
            seen.add(part)
        return seen

    return {
        (a, b, "")
        for a, bs in full.items()
        for b in bs
        if not any(b in reached(c) for c in bs - {b})
    } | {
        (a, b, ", ".join(sorted(m.removeprefix("anneal.") for m in ms)))
        for (a, b), ms in imported.items()
        if b not in MAY_IMPORT[a]
    }


def test_the_drawing_finds_the_arrows_to_draw():
    """``_drawn_arrows`` on made-up modules: the loop's arrow to the launch, implied by the
    observers', is left out; the exceptions into hf/ are drawn with their modules."""
    graph = {
        "anneal.train.trainer": {"anneal.observe.metrics", "anneal.resolution.resolve"},
        "anneal.train.engine": {"anneal.hf.load_weights", "anneal.hf.load"},
        "anneal.observe.metrics": {"anneal.resolution.resolve"},
        "anneal.resolution.preset": {"anneal.hf.load"},
        "anneal.hf.load": {"anneal.errors"},
    }
    assert _drawn_arrows(graph) == {
        ("train", "observe", ""),
        ("observe", "resolution", ""),
        ("train", "hf", "hf.load, hf.load_weights"),
        ("resolution", "hf", "hf.load"),
        ("hf", "ground", ""),
    }


def test_the_drawing_is_the_import_graph():
    """The arrows of docs/architecture.md's drawing (a mermaid flowchart, ``A --> B`` or
    ``A -->|modules| B``) are the ones the imports of anneal's modules give
    (``_drawn_arrows``): none missing, none that the code does not have."""
    block = re.search(r"```mermaid\n(.*?)```", _section("The map"), re.S)[1]
    drawn = set()
    for line in block.splitlines():
        if m := re.fullmatch(r"\s*(\w+) -->(?:\|([^|]*)\|)? (\w+)\s*", line):
            drawn.add((m[1], m[3], m[2] or ""))
    expected = _drawn_arrows(_anneal_graph())
    assert {a for a, _, _ in expected} >= set(MAY_IMPORT) - {"ground"}
    assert sorted(drawn - expected) == [], "drawn, but not in the code"
    assert sorted(expected - drawn) == [], "in the code, but not drawn"


def test_model_and_data_never_import_deepspeed():
    paths = [*(ROOT / "anneal" / "model").rglob("*.py"), *(ROOT / "anneal" / "data").rglob("*.py")]
    assert len(paths) > 5
    for path in paths:
        assert not [b for b, _ in imports_of(path) if _in(b, "deepspeed")], path


# tests/ mirrors anneal/: one folder per package of the map, and these beside them.
TEST_FOLDERS_BESIDE = {
    "ground": "the ground floor and the run directory's modules (anneal/*.py)",
    "house": "rules of the whole repository: the map, owners, names, docs, the suite's shards",
    "launcher": "launcher/: hostfiles, pre-flight, the deepspeed runner, Slurm",
    "bench": "bench/: each benchmark's smoke run",
}


def test_the_tests_mirror_the_packages():
    """Every package of anneal/ has a folder of the same name under tests/ (what tests
    anneal/resilience/universal.py is in tests/resilience/), every folder of tests/ is a package
    or one of ``TEST_FOLDERS_BESIDE``, and no test file stands outside them."""
    packages = {p.parent.name for p in (ROOT / "anneal").glob("*/__init__.py")}
    folders = {p.parent.name for p in (ROOT / "tests").glob("*/__init__.py")}
    assert packages - folders == set(), "packages of anneal/ without a folder under tests/"
    assert folders - packages - set(TEST_FOLDERS_BESIDE) == set(), "test folders of no package"
    assert sorted(p.name for p in (ROOT / "tests").glob("test_*.py")) == []
