"""What a user gives the run config, checked: ``--set section.key=value`` overrides parsed
through the dataclass types of ``anneal.config.run``, and the range of every numeric key.

Both run before anything is written or any engine is built: the launcher's pre-flight and every
rank apply the same overrides and the same checks, so a mistake is one paragraph naming the flag
or key and its fix (``anneal.errors.UserError``) rather than a failure minutes into the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any

from anneal.config.run import (
    RENAMED_KEYS,
    DataConfig,
    GuardConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    split_specs,
    warn_renamed,
)
from anneal.config.schedule import DECAY_SHAPES, SCHEDULES
from anneal.errors import UserError
from anneal.files import check_path_length
from anneal.json_values import INT64_MAX

_SECTIONS = {
    "model": ModelConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "guard": GuardConfig,
}
_CHOICES = {
    ("train", "precision"): ("auto", "bf16", "fp32"),
    ("train", "loss"): ("chunked", "plain"),
    ("train", "compile"): ("off", "torch", "deepcompile"),
    ("train", "float8"): ("off", "tensorwise", "rowwise"),
    ("train", "float8_layers"): ("auto", "all"),
    ("optim", "schedule"): SCHEDULES,
    ("optim", "decay_shape"): DECAY_SHAPES,
    ("optim", "optimizer"): ("adamw", "muon"),
    ("optim", "muon_scale"): ("rms", "deepspeed"),
}
_PATHS = {("data", "path"), ("model", "init_from"), ("train", "cooldown_from")}
"""The keys that hold a path: never empty, never longer than the file system takes."""


def setting_choices(section: str, field: str) -> tuple[str, ...]:
    """The values a ``section.field`` setting takes (``train.float8``: off, tensorwise, ...),
    for a command line that offers the same choices (``anneal estimate``)."""
    return _CHOICES[section, field]


def _quoted(text: str, limit: int = 40) -> str:
    """``text`` quoted for a message, cut to ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _coerce(text: str, typ: Any, where: str) -> Any:
    if typing.get_origin(typ) is tuple:  # a list of names: "a,b" (empty: none)
        return split_specs(text)
    options = typing.get_args(typ)
    if type(None) in options:  # an optional key: "auto" leaves it to its default rule
        if text.lower() in ("auto", "none"):
            return None
        typ = next(t for t in options if t is not type(None))
    if typ is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise UserError(f"{where}: expected true or false, got {_quoted(text)}.")
    try:
        return typ(text)
    except ValueError:
        example = "an integer such as 100" if typ is int else "a number such as 3e-4"
        raise UserError(
            f"{where}: expected {typ.__name__} ({example}), got {_quoted(text)}."
        ) from None


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply ``section.key=value`` strings through the dataclass types.

    Unknown sections or keys are errors with a suggestion; values are parsed to the field's
    type. ``ds.*`` overrides are not handled here (``anneal.resolution.ds.override_ds_config``).
    """
    sections = {name: getattr(cfg, name) for name in _SECTIONS}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, field = key.partition(".")
        where = f"--set {key}={_quoted(value)[1:-1]}"
        if not sep or not dot:
            raise UserError(
                f"{where}: overrides look like section.key=value, e.g. "
                f"train.max_steps=100 or ds.gradient_clipping=0.5."
            )
        if section == "ds":
            continue
        given = key  # the messages name the key as typed
        if key in RENAMED_KEYS:  # an old name: still read, said once
            warn_renamed(key, RENAMED_KEYS[key])
            key = RENAMED_KEYS[key]
            section, _, field = key.partition(".")
        if section not in _SECTIONS:
            raise UserError(
                f"{where}: unknown section {section!r}"
                f"{suggest(section, [*_SECTIONS, 'ds'])}; sections are "
                f"{', '.join([*_SECTIONS, 'ds'])}."
            )
        fields = {f.name: f for f in dataclasses.fields(_SECTIONS[section])}
        if field not in fields:
            raise UserError(
                f"{where}: {section} has no key {field!r}"
                f"{suggest(field, fields)}; keys are {', '.join(fields)}."
            )
        typ = typing.get_type_hints(_SECTIONS[section])[field]
        parsed = _coerce(value, typ, where)
        choices = _CHOICES.get((section, field))
        if choices and parsed not in choices:
            raise UserError(f"{where}: {key} must be one of {', '.join(choices)}.")
        if (section, field) in _PATHS and isinstance(parsed, str):
            if not parsed:
                raise UserError(f"{where}: the path is empty (an unset shell variable?). Give one.")
            check_path_length(parsed, flag=f"--set {given}")
        _check_override(where, key, parsed, before=getattr(sections[section], field))
        sections[section] = dataclasses.replace(sections[section], **{field: parsed})
    return dataclasses.replace(cfg, **sections)


def _check_override(where: str, key: str, value, *, before) -> None:
    """A number given with ``--set`` outside its key's range (``_RANGES``) is refused here,
    where the value it would replace (the recipe's, not the dataclass default) is known."""
    if key not in _RANGES or key in FLAGS or not isinstance(value, int | float):
        return  # a flag's key: check_ranges names the flag
    ok, want = _RANGES[key]
    finite = math.isfinite(value) and abs(value) <= INT64_MAX
    if not (finite and ok(value)) and not isinstance(value, bool):
        kept = "its default" if before is None else f"the value it replaces ({before!r})"
        raise UserError(
            f"{key} is {value!r}: it must be {want}{'' if finite else ', and a finite number'}. "
            f"Give --set {key}=VALUE with such a value, or drop {where} to keep {kept}.",
            every_rank=True,
        )


def optim_keys_set(overrides: list[str]) -> frozenset[str]:
    """The ``optim.*`` fields given with ``--set`` (the ds_config resolution checks them)."""
    return frozenset(
        item.partition("=")[0].removeprefix("optim.")
        for item in overrides
        if item.startswith("optim.")
    )


def suggest(word: str, candidates) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, else an empty string."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------------------------
# Ranges: every numeric key, checked before anything is written or any engine is built.

MAX_DIM = 2**20
"""Largest model dimension (and context length) accepted: beyond any real model, and it keeps
every shape product inside the integer range of torch."""
_YEAR_S = 365 * 24 * 3600

_SIZE = (lambda v: 0 <= v <= MAX_DIM, f"0 (keep the preset's) or a positive size up to {MAX_DIM:,}")
_AT_LEAST_1 = (lambda v: v >= 1, "at least 1")
_STEPS = (lambda v: v >= 0, "0 (off) or a positive number of steps")
_RANGES: dict[str, tuple[Any, str]] = {
    "model.seq_len": (
        lambda v: 0 <= v <= MAX_DIM,
        f"0 (the preset's context) or a positive number of tokens up to {MAX_DIM:,}",
    ),
    "model.hidden_size": _SIZE,
    "model.intermediate_size": _SIZE,
    "model.num_hidden_layers": _SIZE,
    "model.num_attention_heads": _SIZE,
    "model.num_experts": _SIZE,
    "model.experts_per_token": _SIZE,
    "model.expert_intermediate_size": _SIZE,
    "model.moe_aux_loss_coef": (
        lambda v: 0 <= v <= 100,
        'a weight from 0 (no load balancing) to 100, or "auto" (the preset\'s)',
    ),
    "model.moe_z_loss_coef": (
        lambda v: 0 <= v <= 100,
        'a weight from 0 (no z-loss) to 100, or "auto" (the preset\'s)',
    ),
    "model.rope_theta": (
        lambda v: v == 0 or 1 < v <= 1e12,
        "0 (the preset's, 10,000) or a RoPE base above 1, e.g. 500000 (Llama 3)",
    ),
    "data.prefetch_batches": (lambda v: 0 <= v <= 1024, "0 (no read-ahead) to 1024 micro-batches"),
    "optim.lr": (lambda v: v > 0, "a finite number above 0 (the peak learning rate)"),
    "optim.global_batch_tokens": (lambda v: v >= 1, "a positive number of tokens"),
    "optim.warmup_tokens": (lambda v: v >= 0, "0 or a positive number of tokens"),
    "optim.warmup_max_share": (lambda v: 0 <= v <= 1, "a share of the run between 0 and 1"),
    "optim.decay_share": (lambda v: 0 < v <= 1, "a share of the run above 0 and at most 1"),
    "optim.min_lr_ratio": (
        lambda v: 0 <= v <= 1,
        'a share of the peak LR between 0 and 1, or "auto" (the schedule\'s default)',
    ),
    "optim.muon_lr": (
        lambda v: 0 < v <= 100,
        'a finite number above 0 (the Muon half\'s peak LR), or "auto" (optim.lr)',
    ),
    "optim.cooldown_tokens": (
        lambda v: v >= 0,
        "0 (not a cooldown branch) or the tokens of the branch's decay",
    ),
    "train.max_steps": _AT_LEAST_1,
    "train.stop_at_step": _STEPS,
    "train.val_every": (lambda v: v >= 0, "0 (only after the last step) or a number of steps"),
    "train.val_samples": (lambda v: v >= 0, "0 (no validation) or a number of windows"),
    "train.eval_tasks_every": (
        lambda v: v >= 0,
        "0 (only after the last step) or a number of steps",
    ),
    "train.eval_tasks_limit": (lambda v: v >= 0, "0 (every item) or a number of items per task"),
    "train.save_every": (lambda v: v >= 0, "0 (only after the last step) or a number of steps"),
    "train.keep_last": (lambda v: v >= 0, "0 (keep every checkpoint) or a number of checkpoints"),
    "train.keep_every": _STEPS,
    "train.log_every": _AT_LEAST_1,
    "train.loss_chunk_tokens": (
        lambda v: 1 <= v <= MAX_DIM,
        f"a positive number of tokens up to {MAX_DIM:,}",
    ),
    "train.heartbeat_timeout_s": (
        lambda v: 0 <= v <= _YEAR_S,
        f"0 (no heartbeat) or a number of seconds up to {_YEAR_S:,}",
    ),
    "train.collective_timeout_s": (
        lambda v: 0 < v <= _YEAR_S,
        f"a positive number of seconds up to {_YEAR_S:,}",
    ),
    "train.seed": (lambda v: 0 <= v < 2**32, f"an integer from 0 to {2**32 - 1:,} (numpy's range)"),
    "guard.window": _AT_LEAST_1,
    "guard.min_history": (lambda v: v >= 0, "0 or a number of steps"),
    "guard.mad_k": (lambda v: v > 0, "a number above 0"),
    "guard.min_jump": (lambda v: v >= 0, "0 or a positive share"),
    "guard.skip_margin_steps": (lambda v: v >= 0, "0 or a number of steps"),
    "guard.max_rewinds": (lambda v: v >= 0, "0 or a number of incidents"),
    "guard.span_steps": _AT_LEAST_1,
    "guard.lr_scale": (lambda v: 0 < v <= 1, "in (0, 1]: above 0 and at most 1 (1 keeps the LR)"),
}
FLAGS = {
    "train.max_steps": "--max-steps",
    "train.val_every": "--val-every",
    "train.save_every": "--save-every",
    "train.seed": "--seed",
}
"""Keys that a recipe flag sets; a message names the flag, the fix is the flag."""


def check_ranges(cfg: RunConfig) -> None:
    """UserError for the first numeric key outside its range (every one has a rule in
    ``_RANGES``): not finite, past the integer range, or out of the key's own bounds. Pure, so
    the launcher's pre-flight and every rank run the same check before anything starts."""
    for section in _SECTIONS:
        values = getattr(cfg, section)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            choices = _CHOICES.get((section, f.name))
            if choices and value not in choices:
                raise UserError(
                    f"{section}.{f.name} is {value!r}: it must be one of "
                    f"{', '.join(choices)}. Give --set {section}.{f.name}=VALUE with one of them "
                    f"(its default is {f.default!r})."
                )
            if isinstance(value, tuple):
                _check_name_list(f"{section}.{f.name}", value)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            key = f"{section}.{f.name}"
            ok, want = _RANGES[key]
            finite = math.isfinite(value) and abs(value) <= INT64_MAX
            if finite and ok(value):
                continue
            flag = FLAGS.get(key)
            fix = (
                f"Pass {flag} with a value {want}"
                if flag
                else f"Give --set {key}=VALUE with a value {want} (its default is {f.default!r})"
            )
            raise UserError(
                f"{key} is {value!r}{f' ({flag})' if flag else ''}: it must be {want}"
                f"{'' if finite else ', and a finite number'}. {fix}."
            )


def _check_name_list(key: str, names: tuple) -> None:
    """A list key (``train.eval_tasks``) holds non-empty strings, none of them twice."""
    bad = [n for n in names if not isinstance(n, str) or not n.strip()]
    twice = sorted({n for n in names if names.count(n) > 1 and n not in bad})
    if bad or twice:
        why = f"{bad[0]!r} is not a name" if bad else f"{twice[0]!r} is given twice"
        raise UserError(
            f"{key} is {list(names)!r}: {why}. Give each task once, by a non-empty name or "
            f"path: --set {key}=hellaswag,path/to/task.yaml (a recipe: a tuple of strings)."
        )
