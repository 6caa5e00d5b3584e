"""Task YAMLs that a user names, read as untrusted input before lm-eval sees them, and the
sandbox lm-eval renders every task template in.

A task YAML is data until it names Python: ``!function module.name`` (a ``.py`` file beside
the YAML, else an importable module), ``class: !function ...`` (a Python task), or an
``include:`` of a YAML that does. That Python is code by design (lm-eval imports it), so
:func:`inspect` returns one line for each, which the launch prints ("... runs Python from
PATH: trust it as you trust a recipe"). Everything else in the file is data:

- the file is a regular file of at most ``MAX_YAML_BYTES``, and its YAML, aliases expanded, at
  most ``MAX_YAML_NODES`` nodes (a "billion laughs" alias bomb is refused in milliseconds
  instead of hanging whatever walks it: the config's hash, lm-eval's copies), no alias cycle,
  and no ``!!python/...`` tag;
- a Jinja template in it (any string with ``{{``, ``{%`` or ``{#``) reaches no attribute or
  key that starts with ``_`` (``cycler.__init__.__globals__`` and the like, the ways out of a
  template into Python), refused before launch with the key that holds it;
- and, whatever a template holds, lm-eval renders it in a ``jinja2.sandbox.SandboxedEnvironment``
  (:func:`sandbox_templates`, installed over ``lm_eval.utils.env`` before any task loads), which
  raises ``SecurityError`` for an unsafe attribute instead of running it.

lm-eval's own named tasks are read from the installed package, trusted as the package is.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from anneal.errors import UserError
from anneal.files import read_regular

MAX_YAML_BYTES = 1 << 20
"""Bytes of one task YAML at most (lm-eval's largest shipped YAML is a few kB)."""
MAX_YAML_NODES = 100_000
"""Nodes of one task YAML at most, every alias counted as the nodes it stands for."""
TRUST = "trust it as you trust a recipe"
_PYTHON_TAG = "tag:yaml.org,2002:python/"
_TEMPLATE_MARKS = ("{{", "{%", "{#")


def inspect(spec: str) -> list[str]:
    """The lines that say which Python the task YAML (or every YAML of the directory) ``spec``
    runs, one per ``!function``; a UserError for a file that is not plain bounded YAML or a
    template that reaches into Python. Reads no more than ``MAX_YAML_BYTES`` of a file."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml"))
        files = [p for p in files if "__pycache__" not in p.parts and p.is_file()]
    else:
        files = [path]
    notes: list[str] = []
    for file in files:
        for note in _inspect_file(spec, file, seen=set()):
            if note not in notes:
                notes.append(note)
    return notes


def _inspect_file(spec: str, path: Path, *, seen: set[Path]) -> list[str]:
    path = path.expanduser().resolve()
    if path in seen:  # an include cycle: lm-eval refuses it when it loads
        return []
    seen.add(path)
    root = _compose(spec, path)
    notes: list[str] = []
    for key, node in _walk(root):
        if node.tag == "!function":
            notes.append(_python_note(path, str(node.value)))
        elif node.tag.startswith(_PYTHON_TAG):
            raise UserError(
                f"task spec {spec}: {path}, key {key}: the tag {node.tag} asks the YAML loader "
                f"for a Python object, which a task YAML never needs. Remove it; name Python "
                f"with `!function module.name`, which is code: {TRUST}."
            )
        elif isinstance(node, yaml.ScalarNode) and any(m in node.value for m in _TEMPLATE_MARKS):
            _check_template(spec, path, key, node.value)
        if key == "include":  # lm-eval merges a top-level include
            for included in _scalars(node):
                inc = Path(included).expanduser()
                inc = inc if inc.is_absolute() else path.parent / inc
                if inc.is_file():  # a missing one: lm-eval says so when it loads
                    notes += _inspect_file(spec, inc, seen=seen)
    return notes


def _compose(spec: str, path: Path) -> yaml.Node:
    """The YAML node tree of ``path`` (resolved: no link left to follow), read within the
    bounds by ``files.read_regular``, which opens a FIFO without blocking."""
    try:
        data = read_regular(path, limit=MAX_YAML_BYTES)
    except OSError as e:
        raise UserError(f"task spec {spec}: {path} cannot be read ({e.strerror}).") from None
    except ValueError as e:  # a FIFO, a device or a directory, or over the bound
        raise UserError(
            f"task spec {spec}: {path}: {e}. Give the path of a task YAML file: a few kB (the "
            f"documents go in its data files)."
        ) from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        root = yaml.compose(data, Loader=loader)
    except yaml.YAMLError as e:
        reason = " ".join(str(e).replace('"<byte string>", ', "").split())[:300]
        raise UserError(
            f"task spec {spec}: {path} is not a readable task YAML ({reason}). Fix the file."
        ) from None
    if root is None:
        raise UserError(f"task spec {spec}: {path} is empty. Give a task YAML.")
    nodes = _expanded_nodes(root, memo={}, active=set())
    if nodes is None or nodes > MAX_YAML_NODES:
        what = "an alias cycle" if nodes is None else f"{nodes:,} nodes"
        raise UserError(
            f"task spec {spec}: {path} expands, its aliases followed, to {what} (at most "
            f"{MAX_YAML_NODES:,}): an alias bomb, or not a task YAML. Nothing was loaded. "
            f"Remove the aliases (*name) that repeat its blocks, or give the task's own YAML."
        )
    return root


def _expanded_nodes(node: yaml.Node, *, memo: dict, active: set) -> int | None:
    """Nodes under ``node``, aliases counted as often as they occur (computed once per node,
    so a bomb costs its size in the file); None for a cycle."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        return None
    active.add(key)
    total = 1
    for child in _children(node):
        n = _expanded_nodes(child, memo=memo, active=active)
        if n is None:
            return None
        total += n
    active.discard(key)
    memo[key] = total
    return total


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _walk(root: yaml.Node):
    """(dotted key, node) of every node once (aliases visited once: the count bounds them)."""
    seen, stack = set(), [("", root)]
    while stack:
        key, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield key or "(top)", node
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else "?"
                stack.append((f"{key}.{name}" if key else str(name), v))
        elif isinstance(node, yaml.SequenceNode):
            stack += [(f"{key}[{i}]", child) for i, child in enumerate(node.value)]


def _scalars(node: yaml.Node) -> list[str]:
    if isinstance(node, yaml.ScalarNode):
        return [node.value]
    return [n.value for n in _children(node) if isinstance(n, yaml.ScalarNode)]


def _python_note(path: Path, qualified: str) -> str:
    """The line that names the Python a ``!function`` runs (as lm-eval finds it: a ``.py``
    beside the YAML first, else an importable module)."""
    module = qualified.rpartition(".")[0]
    local = (path.parent / f"{module.replace('.', '/')}.py").resolve()
    if module and local.exists():
        where = f"from {local}"
    else:
        where = f"({qualified}, imported from the installed packages)"
    return f"{path} runs Python {where}: {TRUST} (a task YAML that names Python is code)."


def _check_template(spec: str, path: Path, key: str, text: str) -> None:
    """Refuse a template that reaches an attribute or key starting with ``_``."""
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.sandbox import SandboxedEnvironment

    try:
        tree = SandboxedEnvironment().parse(text)
    except TemplateSyntaxError:
        return  # not a template lm-eval can render either; it fails there, running nothing
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Const)):
        if isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node, nodes.Getitem):
            name = node.arg.value if isinstance(node.arg, nodes.Const) else None
        else:
            name = node.value if str(node.value).startswith("__") else None
        if isinstance(name, str) and name.startswith("_"):
            raise UserError(
                f"task spec {spec}: {path}, key {key}: the template reaches {name!r}, an "
                f"internal attribute of a Python object (the way out of a template into "
                f"Python). Templates render in a sandbox: they may read the document's fields, "
                f"call their plain methods and use filters. Remove it; a task that needs Python "
                f"names a function with `!function module.name`, which is code: {TRUST}."
            )


def sandbox_templates() -> None:
    """Render lm-eval's task templates (``lm_eval.utils.apply_template``, which every
    ``doc_to_*`` template goes through) in a ``SandboxedEnvironment`` of the same settings and
    filters, replacing lm-eval's plain ``jinja2.Environment``; idempotent."""
    from jinja2.sandbox import SandboxedEnvironment
    from lm_eval import utils

    if isinstance(utils.env, SandboxedEnvironment):
        return
    plain = utils.env
    env = SandboxedEnvironment(
        loader=plain.loader,
        undefined=plain.undefined,
        keep_trailing_newline=plain.keep_trailing_newline,
    )
    env.filters.update(plain.filters)
    utils.env = env


# --- Local data files -------------------------------------------------------------------------


def jsonl_files(configs: list[dict]) -> list[Path]:
    """The local ``.jsonl`` files that the ``data_files`` of ``configs`` name (relative ones
    from the working directory, as lm-eval and ``datasets`` take them)."""
    found: list[Path] = []

    def strings(value) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, dict):
            return [s for v in value.values() for s in strings(v)]
        if isinstance(value, list | tuple):
            return [s for v in value for s in strings(v)]
        return []

    for cfg in configs:
        kwargs = cfg.get("dataset_kwargs") if isinstance(cfg, dict) else None
        if isinstance(kwargs, dict):
            for name in strings(kwargs.get("data_files")):
                path = Path(name).expanduser()
                if path.suffix == ".jsonl" and path.is_file() and path not in found:
                    found.append(path)
    return found


def check_data_files(path: Path) -> None:
    """A UserError naming the first broken line of a local JSONL file that the task YAML(s)
    at ``path`` (a file or a directory) read; nothing when there is none."""
    from lm_eval.tasks._yaml_loader import load_yaml

    configs = []
    for yaml_path in sorted(path.rglob("*.yaml")) if path.is_dir() else [path]:
        try:
            configs.append(load_yaml(yaml_path, resolve_func=False))
        except Exception:  # lm-eval's own error about it stands
            continue
    for data in jsonl_files(configs):
        check_jsonl(data)


def check_jsonl(path: Path) -> None:
    """A UserError naming the first line of ``path`` that is not one JSON object; nothing
    when every non-blank line is one."""
    import json

    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.strip())
            except ValueError as e:
                why = f"column {e.colno}: {e.msg}" if hasattr(e, "colno") else str(e)[:200]
                raise UserError(
                    f"{path}, line {number}: not a JSON object ({why}). Each line of a JSONL "
                    f'data file is one JSON object, e.g. {{"question": ..., "label": 0}}: '
                    f"fix or remove that line."
                ) from None
            if not isinstance(row, dict):
                raise UserError(
                    f"{path}, line {number}: a JSON {type(row).__name__}, not an object. Each "
                    f"line of a JSONL data file is one JSON object of the document's fields: "
                    f"fix or remove that line."
                )


def line_of_item(path: Path, index: int) -> int | None:
    """The line number of the ``index``-th document (from 0) of the JSONL file ``path`` (blank
    lines are no document); None past its end."""
    with open(path, "rb") as f:
        seen = -1
        for number, raw in enumerate(f, start=1):
            seen += bool(raw.strip())
            if seen == index:
                return number
    return None


def check_targets(spec: str, task) -> None:
    """A UserError naming the first document of a multiple-choice ``task`` (evaluated or
    few-shot) whose target is not one of its choices (an index out of range, or text that is
    none of them): its file and line where its split is one local JSONL file."""
    if task.get_config("output_type") != "multiple_choice":
        return
    pools = [(task.get_config("test_split") or task.get_config("validation_split"), None)]
    if task.get_config("fewshot_split"):
        pools.append((task.get_config("fewshot_split"), task.fewshot_docs()))
    for split, docs in pools:
        docs = task.eval_docs if docs is None else docs
        for index, doc in enumerate(docs or []):
            choices, target = task.doc_to_choice(doc), task.doc_to_target(doc)
            if not _valid_target(target, choices):
                raise UserError(_target_refusal(spec, task, split, index, target, choices))


def _valid_target(target, choices) -> bool:
    if isinstance(target, list):
        return bool(target) and all(_valid_target(t, choices) for t in target)
    if isinstance(target, bool):
        return False
    if isinstance(target, int):
        return 0 <= target < len(choices)
    return isinstance(target, str) and target in choices


def _target_refusal(spec: str, task, split, index: int, target, choices) -> str:
    files = (task.get_config("dataset_kwargs") or {}).get("data_files")
    name = files.get(split) if isinstance(files, dict) else None
    where = f"split {split!r}, document {index} (from 0)"
    if isinstance(name, str) and name.endswith(".jsonl") and not task.get_config("process_docs"):
        line = line_of_item(Path(name).expanduser(), index)
        where = f"{name}, line {line}" if line else where
    shown = repr(target)[:80]
    return (
        f"task {task.get_config('task')} ({spec}): {where}: its answer {shown} is not one of "
        f"its {len(choices)} choices (doc_to_target gives an index from 0 to "
        f"{len(choices) - 1}, or the text of a choice). Fix that document's answer field, or "
        f"remove the document."
    )
