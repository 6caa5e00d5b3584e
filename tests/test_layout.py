"""House rules that code review would otherwise have to catch: deepspeed.initialize is called
in exactly one place, library modules do not read the rank from the environment, every
test file opens with a docstring saying what it proves, and no two of anneal's modules import
each other, directly or around a circle (imports inside functions count). The layer rules of
docs/architecture.md: each package imports only the parts below it on the map (the ground
floor, errors, files, dist and hardware, nothing else of anneal; the loop nothing of anneal/hf
but its checkpoint loader;
anneal/hf nothing of the loop, the observers or the CLI), and the model and data never import
DeepSpeed."""

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
    assert len(calls) == 1 and calls[0][0] == "engine.py", calls


def test_model_and_data_never_read_the_rank():
    for path in [ROOT / "anneal" / "model.py", *(ROOT / "anneal" / "data").rglob("*.py")]:
        text = path.read_text()
        assert not re.search(r"environ.*\b(LOCAL_)?RANK\b", text), path


def test_every_test_file_has_a_docstring():
    for path in (ROOT / "tests").glob("test_*.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), path.name


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement in ``path``, at module level and inside
    functions (``if TYPE_CHECKING:`` blocks left out: they never run); relative imports made
    absolute. ``import a.b`` gives ("a.b", []), ``from a import b, c`` gives ("a", ["b", "c"])."""
    tree = ast.parse(path.read_text())
    skip = {
        id(node)
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
        for node in ast.walk(n)
    }
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = []
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            found += [(a.name, []) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                base = ".".join([*package[: len(package) - n.level + 1], *([base] if base else [])])
            found.append((base, [a.name for a in n.names]))
    return found


def _anneal_imports(path: Path, modules: set[str]) -> set[str]:
    """The ``anneal`` modules that ``path`` imports (``_imports``). ``from anneal.x import y``
    counts as ``anneal.x.y`` where that is a module, else as ``anneal.x``."""
    found = set()
    for base, names in _imports(path):
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


GROUND = ("anneal", "anneal.errors", "anneal.files", "anneal.dist", "anneal.hardware")
# docs/architecture.md, "The map": each part of anneal and the parts it may import besides its
# own modules. Every import of every module is checked against it, so a new arrow is a
# deliberate change of this table and of the picture.
MAY_IMPORT = {
    "ground": set(),
    "run_record": {"ground"},
    "rundir": {"ground", "run_record"},
    "model": {"ground"},
    "data": {"ground", "run_record", "rundir"},
    "planning": {"ground", "run_record", "rundir", "model"},
    "resilience": {"ground", "run_record", "rundir", "model"},
    "config": {"ground"},
    "launch": {"ground", "run_record", "rundir", "model", "data", "resilience", "config"},
    "observe": {"ground", "run_record", "rundir", "model", "data", "planning", "config",
                "launch"},
    "train": {"ground", "run_record", "rundir", "model", "data", "planning", "resilience",
              "config", "launch", "observe"},
    "hf": {"ground", "run_record", "rundir", "model", "data", "resilience"},
    "cli": {"ground", "run_record", "rundir", "model", "data", "planning", "resilience",
            "config", "launch", "observe", "train", "hf"},
}  # fmt: skip
# Single modules that a part may import from a part the table keeps it from. Continued
# pretraining (--init-from) reads a Hugging Face checkpoint when the launch is resolved
# (config/) and copies its tensors into the model when the engine is built (train/); both
# read the weight files through hf.weight_files; these three modules import nothing else of
# hf/ (test_the_hf_loader_imports_nothing_of_the_export).
MAY_IMPORT_MODULES = {
    "launch": {"anneal.hf.load", "anneal.hf.weight_files"},
    "train": {"anneal.hf.load", "anneal.hf.load_weights", "anneal.hf.weight_files"},
}


def _part(module: str) -> str:
    """The part of docs/architecture.md's map that ``module`` belongs to."""
    if module in GROUND:
        return "ground"
    part = module.split(".")[1]
    assert part in MAY_IMPORT, f"{module}: not on the map of docs/architecture.md"
    return part


def test_the_map_is_a_stack_without_cycles():
    graph = {part: allowed for part, allowed in MAY_IMPORT.items()}
    assert _cycles(graph) == []
    assert all(a != part for part, allowed in graph.items() for a in allowed)


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
    graph = _anneal_graph()
    assert {_part(m) for m in graph} == set(MAY_IMPORT), "a part of the map has no module"
    assert _broken(graph) == [], "imports that docs/architecture.md does not allow"


def test_the_layer_check_sees_a_forbidden_arrow():
    """The check above on made-up edges: the loop importing the exporter and the ground floor
    importing the config are refused; the exporter importing a manifest reader and the engine
    importing the Hugging Face loader are not."""
    graph = {
        "anneal.train.trainer": {"anneal.hf.export", "anneal.config.run"},
        "anneal.train.engine": {"anneal.hf.load_weights"},
        "anneal.files": {"anneal.config.run", "anneal.errors"},
        "anneal.hf.export": {"anneal.resilience.checkpoint"},
    }
    assert _broken(graph) == [
        "anneal.files imports anneal.config.run",
        "anneal.train.trainer imports anneal.hf.export",
    ]


def test_the_hf_loader_imports_nothing_of_the_export():
    """The modules that config/ and train/ may import from hf/ import no other module of it."""
    graph = _anneal_graph()
    allowed = set().union(*MAY_IMPORT_MODULES.values())
    for module in allowed:
        assert {m for m in graph[module] if _part(m) == "hf"} <= allowed, module


def test_model_and_data_never_import_deepspeed():
    paths = [ROOT / "anneal" / "model.py", *(ROOT / "anneal" / "data").rglob("*.py")]
    assert len(paths) > 5
    for path in paths:
        assert not [b for b, _ in _imports(path) if _in(b, "deepspeed")], path
