"""DeepSpeed JSON: the strict schema, loading, ``ds.*`` overrides and resolution of ``"auto"``.

Every DeepSpeed key has one home: a JSON file in ``ds_configs/``, edited per cluster. Anneal
reads it strictly (DeepSpeed itself silently accepts a top-level ``gradient_clipp1ng``), applies
``--set ds.*`` overrides through the same schema, and fills the values that belong to the run
rather than the cluster when the file says ``"auto"`` (or leaves them out):

==================================  =============================================================
key                                 ``"auto"`` becomes
==================================  =============================================================
``optimizer.params.lr``             the run config's ``optim.lr`` (the recipe's peak LR)
``train_batch_size``                ``optim.global_batch_tokens / seq_len`` samples
``gradient_accumulation_steps``     ``train_batch_size / (micro-batch x data-parallel size)``
``scheduler.params.total_num_steps`` ``--max-steps``
``scheduler.params.warmup_num_steps`` the warmup rule, ``warmup_steps`` below
==================================  =============================================================

An explicit number in the file is the cluster owner's choice and is kept; ``--set`` beats both.
``resolve_ds_config`` returns the resolved dict and, per filled key, where its value came from,
which the run prints at start and writes to ``config.json``.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from anneal.config.run import AUTO, REPO_ROOT, OptimConfig, batch_arithmetic, suggest
from anneal.errors import UserError

DS_CONFIG_DIR = REPO_ROOT / "ds_configs"

Num = (int, float)
Auto = "auto-or-int"
AutoNum = "auto-or-number"
_OFFLOAD = {
    "device": str,
    "pin_memory": bool,
    "buffer_count": int,
    "fast_init": bool,
    "ratio": Num,
    "nvme_path": str,
}

DS_SCHEMA: dict[str, Any] = {
    "train_batch_size": Auto,
    "train_micro_batch_size_per_gpu": int,
    "gradient_accumulation_steps": Auto,
    "gradient_clipping": Num,
    "steps_per_print": int,
    "wall_clock_breakdown": bool,
    "prescale_gradients": bool,
    "gradient_predivide_factor": Num,
    "communication_data_type": str,
    "zero_allow_untested_optimizer": bool,
    "zero_force_ds_cpu_optimizer": bool,
    "memory_breakdown": bool,
    "bf16": {"enabled": bool, "immediate_grad_update": bool},
    "fp16": {
        "enabled": bool,
        "loss_scale": Num,
        "initial_scale_power": int,
        "loss_scale_window": int,
        "hysteresis": int,
        "min_loss_scale": Num,
    },
    "data_types": {"grad_accum_dtype": str},
    "zero_optimization": {
        "stage": int,
        "overlap_comm": bool,
        "contiguous_gradients": bool,
        "reduce_scatter": bool,
        "reduce_bucket_size": Num,
        "allgather_partitions": bool,
        "allgather_bucket_size": Num,
        "round_robin_gradients": bool,
        "sub_group_size": Num,
        "stage3_prefetch_bucket_size": Num,
        "stage3_param_persistence_threshold": Num,
        "stage3_max_live_parameters": Num,
        "stage3_max_reuse_distance": Num,
        "memory_efficient_linear": bool,
        "stage3_gather_16bit_weights_on_model_save": bool,
        "offload_optimizer": _OFFLOAD,
        "offload_param": _OFFLOAD,
    },
    "optimizer": {
        "type": str,
        "params": {
            "lr": AutoNum,
            "betas": list,
            "eps": Num,
            "weight_decay": Num,
            "torch_adam": bool,
            "adam_w_mode": bool,
            "fused": bool,
        },
    },
    "scheduler": {
        "type": str,
        "params": {
            "total_num_steps": Auto,
            "warmup_min_ratio": Num,
            "warmup_num_steps": Auto,
            "cos_min_ratio": Num,
            "warmup_type": str,
        },
    },
    "activation_checkpointing": {
        "partition_activations": bool,
        "cpu_checkpointing": bool,
        "contiguous_memory_optimization": bool,
        "number_checkpoints": int,
        "synchronize_checkpoint_boundary": bool,
        "profile": bool,
    },
    "flops_profiler": {
        "enabled": bool,
        "profile_step": int,
        "module_depth": int,
        "top_modules": int,
        "detailed": bool,
        "output_file": str,
    },
    "comms_logger": {"enabled": bool, "verbose": bool, "prof_all": bool, "debug": bool},
    # Anneal turns load_universal on by itself for the one load that changes the world size.
    "checkpoint": {"load_universal": bool, "tag_validation": str, "use_node_local_storage": bool},
}


REQUIRED = [
    ("train_micro_batch_size_per_gpu",),
    ("gradient_clipping",),
    ("optimizer", "type"),
    ("scheduler", "type"),
    ("scheduler", "params", "cos_min_ratio"),
]


_INT64 = 2**63 - 1
RANGES: dict[tuple[str, ...], tuple[Any, str]] = {
    ("train_micro_batch_size_per_gpu",): (lambda v: v >= 1, "at least 1"),
    ("gradient_accumulation_steps",): (lambda v: v >= 1, 'at least 1, or "auto"'),
    ("train_batch_size",): (lambda v: v >= 1, 'at least 1, or "auto"'),
    ("gradient_clipping",): (lambda v: v >= 0, "0 (off) or a positive norm"),
    ("steps_per_print",): (lambda v: v >= 1, "at least 1"),
    ("zero_optimization", "stage"): (lambda v: v in (0, 1, 2, 3), "a ZeRO stage: 0, 1, 2 or 3"),
    ("optimizer", "params", "lr"): (lambda v: v > 0, 'a number above 0, or "auto"'),
    ("optimizer", "params", "betas"): (
        lambda v: len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
        "two numbers in [0, 1), e.g. [0.9, 0.95]",
    ),
    ("optimizer", "params", "eps"): (lambda v: v >= 0, "0 or a small positive number (1e-8)"),
    ("optimizer", "params", "weight_decay"): (lambda v: v >= 0, "0 or a positive number"),
    ("scheduler", "params", "total_num_steps"): (lambda v: v >= 1, 'at least 1, or "auto"'),
    ("scheduler", "params", "warmup_num_steps"): (lambda v: v >= 0, 'a step count, or "auto"'),
    ("scheduler", "params", "warmup_min_ratio"): (lambda v: 0 <= v <= 1, "between 0 and 1"),
    ("scheduler", "params", "cos_min_ratio"): (lambda v: 0 <= v <= 1, "between 0 and 1"),
    ("scheduler", "params", "warmup_type"): (
        lambda v: v == "linear",
        '"linear": DeepSpeed\'s WarmupCosineLR also takes "log", which anneal/config/schedule.py '
        "does not implement",
    ),
}
"""Bounds of the keys Anneal reads itself or that DeepSpeed would refuse only at engine start
(``"auto"`` is always allowed where the schema allows it). Every number anywhere must also be
finite and inside the 64-bit integer range."""


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_numbers(node: Any, *, source: str, prefix: str = "") -> None:
    """Every number in the tree finite (json reads NaN and Infinity) and within int64."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        dotted = f"{prefix}{key}" if isinstance(node, dict) else f"{prefix[:-1]}[{key}]"
        if isinstance(value, dict | list):
            _check_numbers(value, source=source, prefix=f"{dotted}.")
        elif _number(value) and not (math.isfinite(value) and abs(value) <= _INT64):
            raise UserError(
                f"{source}: key {dotted!r} is {json.dumps(value)}, not a finite number (or past "
                f"the 64-bit integer range). Write a finite value in the file or the --set."
            )


def check_ranges(cfg: dict, *, source: str) -> None:
    """UserError for a number out of its key's bounds (``RANGES``)."""
    _check_numbers(cfg, source=source)
    for path, (ok, want) in RANGES.items():
        value = _get(cfg, path)
        if value == AUTO:
            continue
        if not ok(value):
            dotted = ".".join(path)
            raise UserError(
                f"{source}: {dotted} is {json.dumps(value)}; it must be {want}. Fix it in the "
                f"file, or override it with --set ds.{dotted}=VALUE."
            )


def _type_name(spec: Any) -> str:
    if spec is Num:
        return "a number"
    if spec == Auto:
        return 'an integer or "auto"'
    if spec == AutoNum:
        return 'a number or "auto"'
    if isinstance(spec, dict):
        return "an object"
    return {int: "an integer", bool: "true or false", str: "a string", list: "a list"}[spec]


def _check_value(value: Any, spec: Any) -> bool:
    if spec == Auto:
        return value == AUTO or (isinstance(value, int) and not isinstance(value, bool))
    if spec == AutoNum:
        return value == AUTO or (isinstance(value, Num) and not isinstance(value, bool))
    if spec is int or spec is Num:
        return isinstance(value, spec) and not isinstance(value, bool)
    if isinstance(spec, dict):
        return isinstance(value, dict)
    return isinstance(value, spec)


@functools.cache
def _deepspeed_zero_model() -> tuple[type, frozenset[str]]:
    """DeepSpeed's own model of ``zero_optimization`` and every key it takes (field names and
    their ``stage3_*`` aliases). Imported only when a key is not in ``DS_SCHEMA``."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig as model

    fields = model.model_fields
    return model, frozenset(fields) | {f.alias for f in fields.values() if f.alias}


def _check_zero_section(section: dict, extra: list[str], *, source: str) -> None:
    """Let DeepSpeed's own model judge a ``zero_optimization`` section that uses keys
    ``DS_SCHEMA`` does not list (``extra``): a value it refuses is an error now, before any model
    is built, rather than at engine start. The whole section goes in, since some of its checks
    tie keys together (``compute_grad_norm: false`` only at stage 1 or 2)."""
    import pydantic

    model, _ = _deepspeed_zero_model()
    try:
        model(**section)
    except pydantic.ValidationError as e:
        why = "; ".join(
            ".".join(["zero_optimization", *map(str, err["loc"])]) + f": {err['msg']}"
            for err in e.errors()
        )
        raise UserError(
            f"{source}: DeepSpeed's own check of zero_optimization, which Anneal defers to for "
            f"the keys it does not list ({', '.join(extra)}), refuses it: {why}. Fix the value "
            f"in the file or the --set."
        ) from None


def validate_ds_config(
    cfg: dict, schema: dict = DS_SCHEMA, *, source: str, prefix: str = ""
) -> None:
    """Unknown keys at any level and wrong types raise UserError naming source and key.

    ``zero_optimization`` is the one section DeepSpeed checks itself (its pydantic model forbids
    unknown keys), so there a key that ``DS_SCHEMA`` does not list but DeepSpeed's model does is
    taken, and the section is checked by that model (``_check_zero_section``): any ZeRO option
    of the installed DeepSpeed can be tried from the JSON or ``--set`` without a code change.
    """
    zero = prefix == "zero_optimization."
    extra = []
    for key, value in cfg.items():
        dotted = f"{prefix}{key}"
        if key not in schema:
            if zero and key in _deepspeed_zero_model()[1]:
                extra.append(dotted)
                continue
            known = sorted(_deepspeed_zero_model()[1]) if zero else list(schema)
            why = (
                "DeepSpeed would refuse it only at engine start"
                if zero
                else "DeepSpeed would ignore it silently; Anneal refuses"
            )
            raise UserError(
                f"{source}: unknown key {dotted!r}{suggest(key, known)}. {why}. Known keys "
                f"here: {', '.join(known)}."
            )
        spec = schema[key]
        if not _check_value(value, spec):
            raise UserError(
                f"{source}: key {dotted!r} must be {_type_name(spec)}, got {json.dumps(value)}."
            )
        if isinstance(spec, dict):
            validate_ds_config(value, spec, source=source, prefix=f"{dotted}.")
    if extra:
        _check_zero_section(cfg, extra, source=source)


def _no_duplicates(source: str):
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise UserError(f"{source}: key {key!r} is set twice; keep one.")
            seen[key] = value
        return seen

    return hook


def find_ds_config(name_or_path: str) -> Path:
    """A path as given, else a name inside ds_configs/."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if (DS_CONFIG_DIR / name_or_path).is_file() and path.parent == Path("."):
        return DS_CONFIG_DIR / name_or_path
    shipped = ", ".join(sorted(p.name for p in DS_CONFIG_DIR.glob("*.json")))
    raise UserError(
        f"--ds-config {name_or_path}: no such file. Give a path to a DeepSpeed "
        f"JSON file or one of the shipped names in {DS_CONFIG_DIR}: {shipped}."
    )


def load_ds_config(path: str | Path) -> dict:
    """Read and strictly validate a DeepSpeed JSON config (not yet resolved)."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"{source}: cannot read the DeepSpeed config ({e.strerror}).") from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"{source}: not UTF-8 text (byte {e.start}), so not a DeepSpeed JSON config. Give "
            f"the path of a JSON file, or one of the names in {DS_CONFIG_DIR}."
        ) from None
    try:
        cfg = json.loads(text, object_pairs_hook=_no_duplicates(source))
    except json.JSONDecodeError as e:
        raise UserError(
            f"{source}: not valid JSON at line {e.lineno}, column {e.colno}: "
            f"{e.msg}. DeepSpeed configs are strict JSON (no comments, no "
            f"trailing commas)."
        ) from None
    except RecursionError:
        raise UserError(
            f"{source}: nested too deeply to be a DeepSpeed config. Give a DeepSpeed JSON file "
            f"(see {DS_CONFIG_DIR})."
        ) from None
    if not isinstance(cfg, dict):
        raise UserError(f"{source}: the top level must be a JSON object.")
    validate_ds_config(cfg, source=source)
    check_ranges(cfg, source=source)
    for key_path in REQUIRED:
        node = cfg
        for k in key_path:
            if not isinstance(node, dict) or k not in node:
                raise UserError(f"{source}: missing required key {'.'.join(key_path)!r}.")
            node = node[k]
    opt = cfg["optimizer"]["type"]
    if opt.lower() not in ("adamw", "adam"):
        raise UserError(f"{source}: optimizer.type {opt!r} is not supported; use AdamW.")
    if cfg["scheduler"]["type"] != "WarmupCosineLR":
        raise UserError(
            f"{source}: scheduler.type must be 'WarmupCosineLR', got {cfg['scheduler']['type']!r}."
        )
    return cfg


def ds_overrides(overrides: list[str]) -> list[tuple[list[str], str]]:
    """The ``ds.a.b=value`` overrides as (key path, raw JSON-or-text value)."""
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.startswith("ds."):
            out.append((key[3:].split("."), value))
    return out


def override_ds_config(cfg: dict, overrides: list[tuple[list[str], str]], *, source: str) -> dict:
    """Apply ``ds.a.b=value`` overrides (values parsed as JSON, else kept as text) and
    re-validate, so an override can neither invent a key nor change a type."""
    cfg = json.loads(json.dumps(cfg))
    for keys, raw in overrides:
        dotted = ".".join(keys)
        if not all(keys):
            raise UserError(
                f"--set ds.{dotted}={raw}: empty key in the path; write the dotted DeepSpeed "
                f"key, e.g. ds.optimizer.params.lr=6e-4."
            )
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = cfg
        for depth, k in enumerate(keys[:-1]):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                parent = ".".join(keys[: depth + 1])
                raise UserError(
                    f"--set ds.{dotted}={raw}: {parent!r} is a value ({json.dumps(node)}), not "
                    f"an object, so it has no key {keys[depth + 1]!r}. Set ds.{parent}=VALUE "
                    f"instead."
                )
        node[keys[-1]] = value
    validate_ds_config(cfg, source=f"{source} (with --set ds.* overrides)")
    check_ranges(cfg, source=f"{source} (with --set ds.* overrides)")
    return cfg


def warmup_steps(*, optim: OptimConfig, tokens_per_step: int, max_steps: int) -> int:
    """The ``"auto"`` warmup: the recipe's warmup in tokens, as optimizer steps, capped at
    ``optim.warmup_max_share`` of the run so that a short run (a smoke test) always fits.

    ``min(ceil(warmup_tokens / tokens_per_step), floor(warmup_max_share * max_steps))``
    """
    wanted = math.ceil(optim.warmup_tokens / tokens_per_step)
    return min(wanted, math.floor(optim.warmup_max_share * max_steps))


def _get(cfg: dict, path: tuple[str, ...]) -> Any:
    node = cfg
    for k in path:
        if not isinstance(node, dict) or k not in node:
            return AUTO
        node = node[k]
    return node


def resolve_ds_config(
    cfg: dict,
    *,
    source: str,
    data_parallel_size: int,
    max_steps: int,
    seq_len: int,
    optim: OptimConfig,
    optim_set: frozenset[str] = frozenset(),
) -> tuple[dict, dict[str, str]]:
    """Fill the ``"auto"`` values from the run and check the batch arithmetic.

    ``optim_set`` names the ``optim.*`` keys given with ``--set``: such a key beside an explicit
    number in the file would have no effect, which is an error rather than a surprise. Returns
    the resolved copy and, for each run-dependent key, a note saying where its value came from.
    """
    cfg = json.loads(json.dumps(cfg))
    sources: dict[str, str] = {}

    def from_run(field: str) -> str:
        return f"--set optim.{field}" if field in optim_set else "recipe"

    def explicit(key: str, field: str) -> None:
        if field in optim_set:
            raise UserError(
                f"{source}: {key} is set explicitly in the file, so --set optim.{field} would "
                f'have no effect. Write "auto" for {key} in the file (the run config fills it '
                f"in), or override the file's value with --set ds.{key}=VALUE."
            )

    micro = cfg["train_micro_batch_size_per_gpu"]
    accum = _get(cfg, ("gradient_accumulation_steps",))
    total = _get(cfg, ("train_batch_size",))
    if accum == AUTO and total == AUTO:
        samples = max(1, round(optim.global_batch_tokens / seq_len))
        total_from = (
            f"{from_run('global_batch_tokens')}: {optim.global_batch_tokens:,} tokens / "
            f"seq_len {seq_len}"
        )
    else:
        if accum != AUTO:
            explicit("gradient_accumulation_steps", "global_batch_tokens")
        if total != AUTO:
            explicit("train_batch_size", "global_batch_tokens")
        samples = None if total == AUTO else total
        total_from = "ds_config"
    batch = batch_arithmetic(
        micro_batch_per_gpu=micro,
        data_parallel_size=data_parallel_size,
        grad_accum_steps=None if accum == AUTO else accum,
        train_batch_size=samples,
        source=f"{source} ({total_from})" if total_from != "ds_config" else source,
    )
    cfg["train_batch_size"] = batch.train_batch_size
    cfg["gradient_accumulation_steps"] = batch.grad_accum_steps
    sources["train_batch_size"] = (
        f"{batch.train_batch_size} samples x {seq_len} = "
        f"{batch.train_batch_size * seq_len:,} tokens ({total_from})"
    )
    sources["gradient_accumulation_steps"] = (
        f"{batch.grad_accum_steps} ({'ds_config' if accum != AUTO else 'auto'}: "
        f"{batch.train_batch_size} / (micro {micro} x {data_parallel_size} ranks))"
    )

    params = cfg["optimizer"].setdefault("params", {})
    if params.get("lr", AUTO) == AUTO:
        params["lr"] = optim.lr
        sources["optimizer.params.lr"] = f"{optim.lr:g} ({from_run('lr')})"
    else:
        explicit("optimizer.params.lr", "lr")
        sources["optimizer.params.lr"] = f"{params['lr']:g} (ds_config)"

    sched = cfg["scheduler"].setdefault("params", {})
    given_total = sched.get("total_num_steps", AUTO)
    if given_total != AUTO and given_total != max_steps:
        raise UserError(
            f"{source}: scheduler.params.total_num_steps is {given_total} but the run has "
            f'--max-steps {max_steps}. Set it to "auto" (Anneal fills it in from --max-steps).'
        )
    sched["total_num_steps"] = max_steps
    sources["scheduler.params.total_num_steps"] = f"{max_steps} (--max-steps)"
    tokens_per_step = batch.train_batch_size * seq_len
    if sched.get("warmup_num_steps", AUTO) == AUTO:
        sched["warmup_num_steps"] = warmup_steps(
            optim=optim, tokens_per_step=tokens_per_step, max_steps=max_steps
        )
        sources["scheduler.params.warmup_num_steps"] = (
            f"{sched['warmup_num_steps']} (auto: min(ceil({optim.warmup_tokens:,} warmup tokens "
            f"/ {tokens_per_step:,} per step), {optim.warmup_max_share:g} x {max_steps} steps))"
        )
    else:
        for field in ("warmup_tokens", "warmup_max_share"):
            explicit("scheduler.params.warmup_num_steps", field)
        warm = sched["warmup_num_steps"]
        if warm > max_steps:
            raise UserError(
                f"{source}: scheduler.params.warmup_num_steps ({warm}) exceeds --max-steps "
                f"({max_steps}), so the run would end before the LR reaches its peak. Set "
                f'warmup_num_steps to "auto" (the recipe\'s warmup, capped at '
                f"{optim.warmup_max_share:g} of the run), lower it with --set "
                f"ds.scheduler.params.warmup_num_steps=N, or raise --max-steps."
            )
        sources["scheduler.params.warmup_num_steps"] = f"{warm} (ds_config)"
    return cfg, sources


def check_with_deepspeed(resolved: dict, *, source: str) -> None:
    """Let DeepSpeed's own config class (``DeepSpeedConfig``: its pydantic models of ZeRO,
    precision, activation checkpointing, ... and its sanity checks) judge the resolved config
    now, as the engine will, so that what it refuses is a UserError before anything is written.

    The scheduler is Anneal's (``WarmupCosine``), so it is left out as ``build_engine`` leaves
    it out; so is ``train_batch_size``, which DeepSpeed would check against the world size of
    this process (1 before the ranks start) while Anneal has already checked it against the
    run's (``batch_arithmetic``)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    engine_view = {k: v for k, v in resolved.items() if k not in ("scheduler", "train_batch_size")}
    try:
        DeepSpeedConfig(json.loads(json.dumps(engine_view)))
    except Exception as e:  # pydantic's ValidationError, AssertionError, ValueError, ...
        why = " ".join(str(e).split())[:600]
        raise UserError(
            f"{source}: DeepSpeed's own check of the config refuses it ({type(e).__name__}: "
            f"{why}). Fix that key in the file or the --set."
        ) from None


def bf16_enabled(ds_cfg: dict) -> bool:
    return bool(ds_cfg.get("bf16", {}).get("enabled", False))


def set_bf16(ds_cfg: dict, enabled: bool) -> dict:
    cfg = json.loads(json.dumps(ds_cfg))
    cfg.setdefault("bf16", {})["enabled"] = enabled
    return cfg
