"""Which tasks a scoring runs: lm-eval task objects from the specs the user gave.

A spec is one of:

- ``anneal_next_line``: the task shipped with Anneal, built from the run's prepared data's val
  split under ``work_dir`` (``anneal.eval.next_line``);
- a path to a task YAML, or to a directory of them (every task in it): it contains a ``/`` or
  ends in ``.yaml``/``.yml`` (write ``./mytasks`` for a directory in the working directory).
  It is read through ``TaskManager(include_defaults=False)``, which costs no time; relative
  ``data_files`` in it are relative to the working directory, as in lm-eval;
- any other word: an lm-eval task, group or tag name. Resolving one builds lm-eval's index of
  its 14,683 shipped YAMLs, once per process (7 s measured here on 2 shared cores, 26 s
  elsewhere); its dataset is
  downloaded at load time unless it is in the local cache.

Only loglikelihood tasks are in scope (output types ``multiple_choice``, ``loglikelihood``,
``loglikelihood_rolling``), which every rank scores in lockstep; a generation task
(``generate_until``) is refused. :func:`check_specs` refuses a bad spec before launch with a
UserError; :func:`load_tasks` never raises for one task: what fails to load (a bad YAML, a
missing data file, a dataset not reachable offline, a generation task) lands in
``LoadedTasks.failed`` with one line, and the other tasks are scored.

``load_tasks`` applies ``num_fewshot`` the way ``lm_eval.simple_evaluate`` does (on the task's
config; a task whose YAML sets 0 keeps 0; none given and none in the YAML means 0), seeds the
few-shot sampler with lm-eval's default seed (1234), and installs the few-shot guard
(``anneal.eval.fewshot``: no item among its own demonstrations). ``limit`` is applied by
``lm_eval.evaluator.evaluate`` (its first ``limit`` documents); here it only decides which
documents ``chance`` averages over. Per task, ``info`` holds ``config_sha256``, the sha256 of
the task's config as loaded (before ``num_fewshot`` is applied; keys sorted, functions by their
source, local data files by the sha256 of their bytes, so it is the same in every process and
wherever the files lie), and ``chance``, the mean over the evaluated documents of
1/(number of choices) for a multiple-choice task, None otherwise.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from anneal.errors import UserError
from anneal.files import sha256_file

log = logging.getLogger(__name__)

SHIPPED = "anneal_next_line"
"""The spec of the task Anneal ships (``anneal.eval.next_line``)."""
LOGLIKELIHOOD_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")
"""The lm-eval output types Anneal scores."""
DEFAULT_OUTPUT_TYPE = "generate_until"
"""lm-eval's ``TaskConfig.output_type`` when a YAML names none."""
FEWSHOT_SEED = 1234
"""lm-eval's default ``fewshot_random_seed`` (``simple_evaluate``)."""
MAX_REASON_CHARS = 600


@dataclasses.dataclass
class LoadedTasks:
    """The tasks of one scoring, ready for ``lm_eval.evaluator.evaluate``."""

    tasks: dict[str, object]
    """lm-eval task objects by task name."""
    info: dict[str, dict]
    """Per task: ``{"config_sha256": hex, "chance": float | None}``."""
    failed: dict[str, str]
    """Task name (or the spec as written, when it failed before naming a task) -> one line."""


def is_path_spec(spec: str) -> bool:
    """True when ``spec`` names a YAML file or a directory rather than a task name."""
    return spec.endswith((".yaml", ".yml")) or "/" in spec


# --- Before launch --------------------------------------------------------------------------


def check_specs(specs: Sequence[str]) -> list[str]:
    """Refuse, before launch, a spec that cannot be scored: a missing YAML path, a file that is
    not a task YAML (or not plain bounded YAML, or with a template that reaches into Python:
    ``anneal.eval.task_files``), a generation task, an unknown lm-eval name (which builds
    lm-eval's index, 7-26 s, only when a bare name is given). The shipped task's data is
    checked at load. Returns one line per Python file a task YAML runs, for the launch to
    print."""
    from anneal.eval import task_files

    names, notes = [], []
    for spec in specs:
        if not isinstance(spec, str) or not spec.strip():
            raise UserError(f"task spec {spec!r}: give a task name or the path of a task YAML.")
        if spec == SHIPPED:
            continue
        if is_path_spec(spec):
            if Path(spec).expanduser().exists():  # a missing one: _check_path says so
                notes += task_files.inspect(spec)  # before lm-eval reads it
            _check_path(spec)
        else:
            names.append(spec)
    if names:
        index = _default_manager().task_index
        for name in names:
            _check_name(name, index)
    return notes


def _check_path(spec: str) -> None:
    from lm_eval.tasks._index import TaskIndex

    path = Path(spec).expanduser()
    if path.is_dir():
        entries = [e for e in TaskIndex.build([path]).values() if e.cfg and "task" in e.cfg]
        entries = [e for e in entries if isinstance(e.cfg["task"], str)]
        if not entries:
            raise UserError(
                f"task spec {spec}: the directory holds no task YAML (a file with a `task:` "
                f"key). Give a directory of task YAMLs, or the path of one."
            )
        for entry in entries:
            _check_output_type(spec, entry.name, entry.cfg)
        return
    if not path.is_file():
        raise UserError(
            f"task spec {spec}: no such file or directory. Give the path of a task YAML (or a "
            f"directory of them), an lm-eval task name, or {SHIPPED}."
        )
    cfg = _read_yaml(spec, path)
    if "class" in cfg:  # a Python task: its output type is known once it is loaded
        return
    if "group" in cfg:
        for member in cfg.get("task") or []:
            if isinstance(member, dict) and "task" in member:
                _check_output_type(spec, member["task"], {**cfg, **member})
        return
    if not isinstance(cfg.get("task"), str):
        raise UserError(
            f"task spec {spec}: the YAML has no `task:` key naming the task (nor a `group:`); "
            f"it is not an lm-eval task config. See lm-eval's docs/task_guide.md."
        )
    _check_output_type(spec, cfg["task"], cfg)


def _read_yaml(spec: str, path: Path) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        return load_yaml(path, resolve_func=False)
    except Exception as e:  # yaml errors, a missing include, not a mapping
        raise UserError(
            f"task spec {spec}: not a readable task YAML ({_reason(e)}). Fix the file."
        ) from e


def _check_output_type(spec: str, task: str, cfg: dict) -> None:
    output_type = cfg.get("output_type", DEFAULT_OUTPUT_TYPE)
    if output_type not in LOGLIKELIHOOD_TYPES:
        raise UserError(_output_type_refusal(spec, task, output_type))


def _output_type_refusal(spec: str, task: str, output_type: str) -> str:
    """The paragraph that refuses a task of another output type than loglikelihood."""
    named = spec if spec == task else f"{spec} (task {task})"
    return (
        f"task spec {named}: output_type {output_type!r} is not scored by Anneal. Only "
        f"loglikelihood tasks are ({', '.join(LOGLIKELIHOOD_TYPES)}): their requests are known "
        f"before the model runs, so every rank builds the same list and calls forward the same "
        f"number of times; a generation task's lengths differ by rank and would hang a "
        f"multi-rank run. Remove it from --tasks (train.eval_tasks), or use a multiple-choice "
        f"or cloze variant of it."
    )


def _check_name(name: str, index: dict) -> None:
    if name not in index:
        close = difflib.get_close_matches(name, list(index), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UserError(
            f"task spec {name}: lm-eval {_lm_eval_version()} knows no task, group or tag of "
            f"that name.{hint} `lm-eval ls tasks` lists them; a YAML file is given by its path "
            f"(ending in .yaml), a directory as ./{name}."
        )
    for task, cfg in _leaf_configs(name, index, seen=set()):
        _check_output_type(name, task, cfg)


def _leaf_configs(name: str, index: dict, *, seen: set) -> list[tuple[str, dict]]:
    """(task name, raw config) of each task that ``name`` (a task, group or tag) stands for;
    Python tasks are left out (their output type is known once loaded)."""
    from lm_eval.tasks._index import Kind

    if name in seen or name not in index:
        return []
    seen.add(name)
    entry = index[name]
    if entry.kind is Kind.TASK:
        return [(name, entry.cfg or {})]
    if entry.kind is Kind.TAG:
        return [leaf for t in sorted(entry.tags) for leaf in _leaf_configs(t, index, seen=seen)]
    if entry.kind is Kind.GROUP:
        out = []
        members = (entry.cfg or {}).get("task") or []
        for member in members if isinstance(members, list) else [members]:
            if isinstance(member, str):
                out += _leaf_configs(member, index, seen=seen)
            elif isinstance(member, dict) and isinstance(member.get("task"), str):
                out += _leaf_configs(member["task"], index, seen=seen) or [(member["task"], member)]
        return out
    return []


@functools.lru_cache(maxsize=1)
def _default_manager():
    """lm-eval's TaskManager over its shipped YAMLs (7-26 s on 2 cores), once a process."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


# --- Loading ---------------------------------------------------------------------------------


def load_tasks(
    specs: Sequence[str],
    *,
    data_dir: Path | None,
    work_dir: Path,
    num_fewshot: int | None,
    limit: int | None,
) -> LoadedTasks:
    """Every task of ``specs``, ready for ``lm_eval.evaluator.evaluate``; what fails to load is
    in ``failed`` (never raised). ``data_dir`` is the run's prepared data (for the shipped task,
    built under ``work_dir``, a directory the caller owns). Deterministic: every rank that
    calls it gets the same tasks, documents and few-shot demonstrations. lm-eval renders their
    templates in a sandbox (``anneal.eval.task_files.sandbox_templates``)."""
    from anneal.eval.task_files import sandbox_templates

    sandbox_templates()
    loaded = LoadedTasks(tasks={}, info={}, failed={})
    for spec in specs:
        try:
            built = _load_spec(spec, data_dir=data_dir, work_dir=Path(work_dir))
        except Exception as e:  # a task that fails to load is never fatal
            log.warning("task %s did not load: %s", spec, _reason(e))
            loaded.failed[spec] = _reason(e)
            continue
        for name, task in built.items():
            if name in loaded.tasks or name in loaded.failed:
                log.warning("task %s (from %s) is already loaded; scored once", name, spec)
                continue
            try:
                loaded.info[name] = _prepare(spec, task, num_fewshot=num_fewshot, limit=limit)
                loaded.tasks[name] = task
            except Exception as e:
                log.warning("task %s did not load: %s", name, _reason(e))
                loaded.info.pop(name, None)
                loaded.failed[name] = _reason(e)
    return loaded


def _load_spec(spec: str, *, data_dir: Path | None, work_dir: Path) -> dict[str, object]:
    from lm_eval.tasks import TaskManager

    check_specs([spec])
    if spec == SHIPPED:
        from anneal.eval import next_line

        if data_dir is None:
            raise UserError(
                f"task {SHIPPED} is built from the run's prepared data, and none was given."
            )
        config = next_line.task_config(data_dir, work_dir)
        return TaskManager(include_defaults=False).load(config)["tasks"]
    if is_path_spec(spec):
        path = Path(spec).expanduser()
        try:
            if path.is_dir():
                manager = TaskManager(include_path=str(path), include_defaults=False)
                return manager.load(manager.all_subtasks)["tasks"]
            return TaskManager(include_defaults=False).load(str(path))["tasks"]
        except Exception:  # a broken line of a local data file: named, else lm-eval's error
            from anneal.eval.task_files import check_data_files

            check_data_files(path)
            raise
    return _default_manager().load(spec)["tasks"]


def _prepare(spec: str, task, *, num_fewshot: int | None, limit: int | None) -> dict:
    """Check ``task``'s output type, apply ``num_fewshot`` as ``simple_evaluate`` does, seed
    and guard its few-shot sampler; its ``info``."""
    from anneal.eval import fewshot, task_files

    output_type = task.get_config("output_type") or getattr(task, "OUTPUT_TYPE", None)
    if output_type not in LOGLIKELIHOOD_TYPES:
        raise UserError(_output_type_refusal(spec, task.get_config("task"), output_type))
    if is_path_spec(spec):  # the user's own documents: every answer among its choices
        task_files.check_targets(spec, task)
    config_sha256 = config_hash(task)
    if num_fewshot is not None:
        if task.get_config("num_fewshot") == 0:
            log.info("task %s sets num_fewshot 0 in its config; kept", task.get_config("task"))
        else:
            task.set_config(key="num_fewshot", value=num_fewshot)
    elif task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    fewshot.guard(task)
    task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return {"config_sha256": config_sha256, "chance": chance(task, limit)}


def chance(task, limit: int | None) -> float | None:
    """For a multiple-choice task, the mean over the documents ``evaluate`` scores (the first
    ``limit``) of 1/(number of choices): the accuracy of a uniform guess. None otherwise."""
    from lm_eval.evaluator_utils import get_sample_size

    if task.get_config("output_type") != "multiple_choice":
        return None
    docs = task.doc_iterator(limit=get_sample_size(task, limit))
    shares = [1.0 / len(task.doc_to_choice(doc)) for _, doc in docs]
    return sum(shares) / len(shares) if shares else None


# --- The config's hash ------------------------------------------------------------------------


def config_hash(task) -> str:
    """sha256 of the task's config (``TaskConfig.to_dict``) in a canonical form: keys sorted,
    functions as their source (else their qualified name), non-finite numbers as text, each
    local file of ``dataset_kwargs.data_files`` as the sha256 of its bytes, and without
    ``metadata.config_source`` (the YAML's path)."""
    cfg = task.config.to_dict(keep_callable=True)
    if isinstance(cfg.get("metadata"), dict):  # where the YAML lay is not what it says
        cfg["metadata"] = {k: v for k, v in cfg["metadata"].items() if k != "config_source"}
    kwargs = cfg.get("dataset_kwargs")
    if isinstance(kwargs, dict) and "data_files" in kwargs:
        cfg["dataset_kwargs"] = {**kwargs, "data_files": _hashed_files(kwargs["data_files"])}
    text = json.dumps(_canonical(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _hashed_files(value):
    if isinstance(value, dict):
        return {k: _hashed_files(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_hashed_files(v) for v in value]
    if isinstance(value, str) and Path(value).is_file():
        return "sha256:" + sha256_file(Path(value))
    return value


def _canonical(value):
    """``value`` as JSON-able data that is the same in every process (no memory addresses)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _canonical(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_canonical(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if callable(value):
        try:
            return inspect.getsource(value)
        except (TypeError, OSError):
            name = getattr(value, "__qualname__", type(value).__qualname__)
            return f"{getattr(value, '__module__', '')}.{name}"
    return type(value).__qualname__


def _reason(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if not isinstance(error, UserError):
        text = f"{type(error).__name__}: {text}"
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."
