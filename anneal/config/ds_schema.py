"""The DeepSpeed JSON schema and its checks: which keys exist and their types (``DS_SCHEMA``),
which are required (``REQUIRED``), and the bounds of the numbers (``RANGES``).

DeepSpeed itself silently accepts a top-level ``gradient_clipp1ng`` and refuses a bad value only
at engine start, minutes into a launch; these checks refuse both up front with the file, the
dotted key and a fix. ``zero_optimization`` is the one section DeepSpeed models strictly itself,
so there its own model judges the keys this schema does not list.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

from anneal.config.run import AUTO
from anneal.config.run_checks import suggest
from anneal.errors import UserError
from anneal.json_values import INT64_MAX, is_number

Num = (int, float)
NS_METHODS = ("gram", "standard")
"""DeepSpeed 0.19.8's Newton-Schulz variants for Muon (``optimizer.params.ns_method``)."""
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
            # DeepSpeed's Muon (anneal/resolution/optimizer.py): "auto" LRs come from the run.
            "muon_lr": AutoNum,
            "adam_lr": AutoNum,
            "momentum": Num,
            "ns_method": str,
        },
    },
    "scheduler": {
        "type": str,
        "params": {
            "total_num_steps": Auto,
            "warmup_min_ratio": Num,
            "warmup_num_steps": Auto,
            "cos_min_ratio": AutoNum,
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
    # DeepSpeed's AutoTP training (anneal/resolution/parallel.py); its other keys are not taken.
    "tensor_parallel": {"autotp_size": int, "tp_overlap_comm": bool},
    # DeepSpeed's Ulysses sequence parallelism (anneal/resolution/parallel.py, train/sequence.py).
    "sequence_parallel_size": int,
    # DeepSpeed's AutoEP expert parallelism (anneal/resolution/expert_layout.py): filled in for a
    # sparse model; its routing comes from the model's config, so only these keys are taken.
    "expert_parallel": {
        "enabled": bool,
        "autoep_size": int,
        "preset_model": str,
        "use_grouped_mm": bool,
        "expert_tensor_parallel_size": int,
        "load_balance_coeff": Num,
    },
    # Anneal turns load_universal on by itself for the one load that changes the world size.
    "checkpoint": {"load_universal": bool, "tag_validation": str, "use_node_local_storage": bool},
}


REQUIRED = [
    ("train_micro_batch_size_per_gpu",),
    ("gradient_clipping",),
    ("optimizer", "type"),
    ("scheduler", "type"),
]


RANGES: dict[tuple[str, ...], tuple[Any, str]] = {
    ("train_micro_batch_size_per_gpu",): (lambda v: v >= 1, "at least 1"),
    ("gradient_accumulation_steps",): (lambda v: v >= 1, 'at least 1, or "auto"'),
    ("train_batch_size",): (lambda v: v >= 1, 'at least 1, or "auto"'),
    ("gradient_clipping",): (lambda v: v >= 0, "0 (off) or a positive norm"),
    ("steps_per_print",): (lambda v: v >= 1, "at least 1"),
    ("zero_optimization", "stage"): (lambda v: v in (0, 1, 2, 3), "a ZeRO stage: 0, 1, 2 or 3"),
    ("tensor_parallel", "autotp_size"): (
        lambda v: v >= 0,
        "the ranks per tensor-parallel group (0 or 1: no tensor parallelism)",
    ),
    ("sequence_parallel_size",): (
        lambda v: v >= 1,
        "the ranks that share each sequence (1: no sequence parallelism)",
    ),
    ("expert_parallel", "autoep_size"): (
        lambda v: v >= 1,
        "the ranks that share out each layer's experts (1: every rank holds all of them)",
    ),
    ("expert_parallel", "expert_tensor_parallel_size"): (
        lambda v: v == 1,
        "1: DeepSpeed 0.19.8's AutoEP runs expert tensor parallelism only with AutoTP, which "
        "Anneal does not combine with experts",
    ),
    ("expert_parallel", "load_balance_coeff"): (
        lambda v: False,
        "left out: DeepSpeed 0.19.8's AutoEP rejects aux-loss-free balancing (DeepSeek-V3's "
        "expert bias). Drop the key; the router is balanced by its auxiliary loss "
        "(--set model.moe_aux_loss_coef=...)",
    ),
    ("optimizer", "params", "lr"): (lambda v: v > 0, 'a number above 0, or "auto"'),
    ("optimizer", "params", "betas"): (
        lambda v: len(v) == 2 and all(is_number(b) and 0 <= b < 1 for b in v),
        "two numbers in [0, 1), e.g. [0.9, 0.95]",
    ),
    ("optimizer", "params", "muon_lr"): (lambda v: v > 0, 'a number above 0, or "auto"'),
    ("optimizer", "params", "adam_lr"): (lambda v: v > 0, 'a number above 0, or "auto"'),
    ("optimizer", "params", "momentum"): (
        lambda v: 0 <= v < 1,
        "in [0, 1): Muon's momentum (0.95 is DeepSpeed's and Moonlight's)",
    ),
    ("optimizer", "params", "ns_method"): (
        lambda v: v in NS_METHODS,
        f"one of {', '.join(NS_METHODS)}: DeepSpeed's Newton-Schulz variants",
    ),
    ("optimizer", "params", "eps"): (lambda v: v >= 0, "0 or a small positive number (1e-8)"),
    ("optimizer", "params", "weight_decay"): (lambda v: v >= 0, "0 or a positive number"),
    ("scheduler", "params", "total_num_steps"): (lambda v: v >= 1, 'at least 1, or "auto"'),
    ("scheduler", "params", "warmup_num_steps"): (lambda v: v >= 0, 'a step count, or "auto"'),
    ("scheduler", "params", "warmup_min_ratio"): (lambda v: 0 <= v <= 1, "between 0 and 1"),
    ("scheduler", "params", "cos_min_ratio"): (
        lambda v: 0 <= v <= 1,
        'between 0 and 1, or "auto" (the run optim.min_lr_ratio, else the schedule default)',
    ),
    ("scheduler", "params", "warmup_type"): (
        lambda v: v == "linear",
        '"linear": DeepSpeed\'s WarmupCosineLR also takes "log", which anneal/config/schedule.py '
        "does not implement",
    ),
}
"""Bounds of the keys Anneal reads itself or that DeepSpeed would refuse only at engine start
(``"auto"`` is always allowed where the schema allows it). Every number anywhere must also be
finite and inside the 64-bit integer range."""


def value_or_auto(cfg: dict, path: tuple[str, ...]) -> Any:
    """The value at ``path``, or ``"auto"`` where the file leaves it out: a run-dependent key
    that is missing is filled from the run like one that says ``"auto"``."""
    node = cfg
    for k in path:
        if not isinstance(node, dict) or k not in node:
            return AUTO
        node = node[k]
    return node


def _check_finite(node: Any, *, source: str, prefix: str = "") -> None:
    """Every number in the tree finite (json reads NaN and Infinity) and within int64."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        dotted = f"{prefix}{key}" if isinstance(node, dict) else f"{prefix[:-1]}[{key}]"
        if isinstance(value, dict | list):
            _check_finite(value, source=source, prefix=f"{dotted}.")
        elif is_number(value) and not (math.isfinite(value) and abs(value) <= INT64_MAX):
            raise UserError(
                f"{source}: key {dotted!r} is {json.dumps(value)}, not a finite number (or past "
                f"the 64-bit integer range). Write a finite value in the file or the --set."
            )


@dataclasses.dataclass(frozen=True)
class Degrees:
    """The parallel degrees of a ds_config: the ranks of each kind of group (1: none)."""

    tp: int = 1
    """``tensor_parallel.autotp_size``: ranks per tensor-parallel (AutoTP) group."""
    sp: int = 1
    """``sequence_parallel_size``: ranks that share each sequence (Ulysses)."""
    ep: int = 1
    """``expert_parallel.autoep_size``: ranks that share out each layer's experts (AutoEP)."""


def degrees(ds: dict) -> Degrees:
    """The one read of a ds_config's parallel degrees, each at least 1: DeepSpeed takes an
    ``autotp_size`` of 0 and 1 as off, a missing ``sequence_parallel_size`` as 1, and no
    ``expert_parallel`` section as every rank holding every expert."""
    tensor = ds.get("tensor_parallel", {})
    tp = tensor.get("autotp_size", 0) if isinstance(tensor, dict) else 0
    experts = ds.get("expert_parallel", {})
    ep = experts.get("autoep_size", 1) if isinstance(experts, dict) else 1
    return Degrees(
        tp=max(1, int(tp)),
        sp=_at_least_one(ds.get("sequence_parallel_size", 1)),
        ep=_at_least_one(ep),
    )


def _at_least_one(value: Any) -> int:
    return max(1, value) if isinstance(value, int) and not isinstance(value, bool) else 1


def check_ds_ranges(cfg: dict, *, source: str) -> None:
    """UserError for a number out of its key's bounds (``RANGES``)."""
    _check_finite(cfg, source=source)
    for path, (ok, want) in RANGES.items():
        value = value_or_auto(cfg, path)
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
