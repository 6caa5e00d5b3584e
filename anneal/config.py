"""Typed run config, strict DeepSpeed JSON loading and the batch arithmetic.

Every DeepSpeed key has one home: the JSON file in ``ds_configs/``. Anneal reads it strictly
(DeepSpeed itself silently accepts a top-level ``gradient_clipp1ng``), fills the two values that
depend on the run (``train_batch_size`` and the scheduler's ``total_num_steps``, written as
``"auto"``), and writes the resolved result into the run directory.

User mistakes raise ``anneal.errors.UserError`` with one paragraph naming the file and key and
saying how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from pathlib import Path
from typing import Any

from anneal.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent
DS_CONFIG_DIR = REPO_ROOT / "ds_configs"
AUTO = "auto"


# ---------------------------------------------------------------------------------------------
# Run config: one small frozen dataclass per concern.


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    preset: str = "tiny"
    """Name in anneal.model.PRESETS."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (HF gradient checkpointing)."""
    seq_len: int = 0
    """Context length in tokens; 0 takes the preset's."""
    hidden_size: int = 0
    """Shape overrides of the preset (0 keeps the preset's), for sweeps of custom sizes."""
    intermediate_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0

    def resolve(self, vocab_size: int):
        """The preset with this config's overrides and the data's vocabulary."""
        from anneal.model import get_preset

        preset = get_preset(self.preset).with_vocab(vocab_size)
        shape = {
            k: getattr(self, k)
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if getattr(self, k)
        }
        if "num_attention_heads" in shape:
            shape["num_key_value_heads"] = shape["num_attention_heads"]
        if self.seq_len:
            shape["seq_len"] = self.seq_len
        preset = dataclasses.replace(preset, **shape)
        if preset.hidden_size % preset.num_attention_heads:
            raise UserError(
                f"model.hidden_size ({preset.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({preset.num_attention_heads})."
            )
        return preset


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    path: str = "data/stdlib"
    """Prepared data directory (``anneal data prepare``)."""
    prefetch_batches: int = 4
    """Micro-batches read ahead of the model by a background thread."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    max_steps: int = 300
    """Optimizer steps in the whole run; the LR schedule ends here."""
    stop_at_step: int = 0
    """Exit cleanly after this step without changing the schedule (a preemption drill); 0: off."""
    eval_every: int = 100
    """Validate every N optimizer steps (and after the last); 0: only after the last."""
    eval_samples: int = 64
    """Windows of the val split in each validation pass: the same held-out set every time,
    whatever the number of ranks."""
    save_every: int = 100
    """Checkpoint every N optimizer steps (and after the last); 0: only after the last."""
    keep_last: int = 3
    """Intact checkpoints kept; older ones are deleted after a new one is complete."""
    log_every: int = 10
    """Console line every N steps (metrics.jsonl gets every step)."""
    seed: int = 1234
    precision: str = "auto"
    """auto | bf16 | fp32. auto keeps the ds_config's bf16 where the device has fast bf16 and
    turns it off (saying so) where it does not, as on CPUs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    out: str
    ds_config: str
    resume: str = AUTO
    """auto (newest intact checkpoint in out/, if any) | none | PATH (a checkpoint tag dir)."""
    resume_explicit: bool = False
    """True when --resume was given: only then may a launch continue a run whose config
    differs from the one in out/config.json."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}
_CHOICES = {("train", "precision"): ("auto", "bf16", "fp32")}


def _coerce(text: str, typ: Any, where: str) -> Any:
    if typ is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise UserError(f"{where}: expected true or false, got {text!r}.")
    try:
        return typ(text)
    except ValueError:
        raise UserError(f"{where}: expected {typ.__name__}, got {text!r}.") from None


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply ``section.key=value`` strings through the dataclass types.

    Unknown sections or keys are errors with a suggestion; values are parsed to the field's
    type. ``ds.*`` overrides are not handled here (see ``override_ds_config``).
    """
    sections = {name: getattr(cfg, name) for name in _SECTIONS}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, field = key.partition(".")
        where = f"--set {item}"
        if not sep or not dot:
            raise UserError(
                f"{where}: overrides look like section.key=value, e.g. "
                f"train.max_steps=100 or ds.gradient_clipping=0.5."
            )
        if section == "ds":
            continue
        if section not in _SECTIONS:
            raise UserError(
                f"{where}: unknown section {section!r}"
                f"{_suggest(section, [*_SECTIONS, 'ds'])}; sections are "
                f"{', '.join([*_SECTIONS, 'ds'])}."
            )
        fields = {f.name: f for f in dataclasses.fields(_SECTIONS[section])}
        if field not in fields:
            raise UserError(
                f"{where}: {section} has no key {field!r}"
                f"{_suggest(field, fields)}; keys are {', '.join(fields)}."
            )
        typ = typing.get_type_hints(_SECTIONS[section])[field]
        parsed = _coerce(value, typ, where)
        choices = _CHOICES.get((section, field))
        if choices and parsed not in choices:
            raise UserError(f"{where}: must be one of {', '.join(choices)}.")
        sections[section] = dataclasses.replace(sections[section], **{field: parsed})
    return dataclasses.replace(cfg, **sections)


def ds_overrides(overrides: list[str]) -> list[tuple[list[str], str]]:
    """The ``ds.a.b=value`` overrides as (key path, raw JSON-or-text value)."""
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.startswith("ds."):
            out.append((key[3:].split("."), value))
    return out


def _suggest(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------------------------
# DeepSpeed JSON: the subset of keys Anneal supports, with their types.

Num = (int, float)
Auto = "auto-or-int"
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
    "gradient_accumulation_steps": int,
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
        "stage3_gather_16bit_weights_on_model_save": bool,
        "offload_optimizer": _OFFLOAD,
        "offload_param": _OFFLOAD,
    },
    "optimizer": {
        "type": str,
        "params": {
            "lr": Num,
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
            "warmup_num_steps": int,
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
}

REQUIRED = [
    ("train_micro_batch_size_per_gpu",),
    ("gradient_accumulation_steps",),
    ("gradient_clipping",),
    ("optimizer", "type"),
    ("optimizer", "params", "lr"),
    ("scheduler", "type"),
    ("scheduler", "params", "warmup_num_steps"),
    ("scheduler", "params", "cos_min_ratio"),
]


def _type_name(spec: Any) -> str:
    if spec is Num:
        return "a number"
    if spec == Auto:
        return 'an integer or "auto"'
    if isinstance(spec, dict):
        return "an object"
    return {int: "an integer", bool: "true or false", str: "a string", list: "a list"}[spec]


def _check_value(value: Any, spec: Any) -> bool:
    if spec == Auto:
        return value == AUTO or (isinstance(value, int) and not isinstance(value, bool))
    if spec is int or spec is Num:
        return isinstance(value, spec) and not isinstance(value, bool)
    if isinstance(spec, dict):
        return isinstance(value, dict)
    return isinstance(value, spec)


def validate_ds_config(
    cfg: dict, schema: dict = DS_SCHEMA, *, source: str, prefix: str = ""
) -> None:
    """Unknown keys at any level and wrong types raise UserError naming source and key."""
    for key, value in cfg.items():
        dotted = f"{prefix}{key}"
        if key not in schema:
            raise UserError(
                f"{source}: unknown key {dotted!r}{_suggest(key, schema)}. DeepSpeed would "
                f"ignore it silently; Anneal refuses. Known keys here: {', '.join(schema)}."
            )
        spec = schema[key]
        if not _check_value(value, spec):
            raise UserError(
                f"{source}: key {dotted!r} must be {_type_name(spec)}, got {json.dumps(value)}."
            )
        if isinstance(spec, dict):
            validate_ds_config(value, spec, source=source, prefix=f"{dotted}.")


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
        text = path.read_text()
    except OSError as e:
        raise UserError(f"{source}: cannot read the DeepSpeed config ({e.strerror}).") from None
    try:
        cfg = json.loads(text, object_pairs_hook=_no_duplicates(source))
    except json.JSONDecodeError as e:
        raise UserError(
            f"{source}: not valid JSON at line {e.lineno}, column {e.colno}: "
            f"{e.msg}. DeepSpeed configs are strict JSON (no comments, no "
            f"trailing commas)."
        ) from None
    if not isinstance(cfg, dict):
        raise UserError(f"{source}: the top level must be a JSON object.")
    validate_ds_config(cfg, source=source)
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


def override_ds_config(cfg: dict, overrides: list[tuple[list[str], str]], *, source: str) -> dict:
    """Apply ``ds.a.b=value`` overrides (values parsed as JSON, else kept as text) and
    re-validate, so an override can neither invent a key nor change a type."""
    cfg = json.loads(json.dumps(cfg))
    for keys, raw in overrides:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = cfg
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    validate_ds_config(cfg, source=f"{source} (with --set ds.* overrides)")
    return cfg


def train_batch_size(
    *, micro_batch_per_gpu: int, grad_accum_steps: int, data_parallel_size: int
) -> int:
    """Global batch in samples: micro x accumulation x data-parallel size."""
    for name, value in (
        ("train_micro_batch_size_per_gpu", micro_batch_per_gpu),
        ("gradient_accumulation_steps", grad_accum_steps),
        ("data-parallel size", data_parallel_size),
    ):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}.")
    return micro_batch_per_gpu * grad_accum_steps * data_parallel_size


def resolve_ds_config(cfg: dict, *, source: str, data_parallel_size: int, max_steps: int) -> dict:
    """Fill ``auto`` values and check the batch arithmetic. Returns a new dict."""
    cfg = json.loads(json.dumps(cfg))
    micro = cfg["train_micro_batch_size_per_gpu"]
    accum = cfg["gradient_accumulation_steps"]
    want = train_batch_size(
        micro_batch_per_gpu=micro, grad_accum_steps=accum, data_parallel_size=data_parallel_size
    )
    given = cfg.get("train_batch_size", AUTO)
    if given != AUTO and given != want:
        raise UserError(
            f"{source}: train_batch_size is {given} but train_micro_batch_size_per_gpu ({micro}) "
            f"x gradient_accumulation_steps ({accum}) x data-parallel size "
            f'({data_parallel_size}) = {want}. Set train_batch_size to {want} or to "auto".'
        )
    cfg["train_batch_size"] = want
    params = cfg["scheduler"]["params"]
    total = params.get("total_num_steps", AUTO)
    if total != AUTO and total != max_steps:
        raise UserError(
            f"{source}: scheduler.params.total_num_steps is {total} but the run has "
            f'--max-steps {max_steps}. Set it to "auto" (Anneal fills it in).'
        )
    params["total_num_steps"] = max_steps
    if params["warmup_num_steps"] > max_steps:
        raise UserError(
            f"{source}: scheduler.params.warmup_num_steps "
            f"({params['warmup_num_steps']}) exceeds --max-steps ({max_steps})."
        )
    return cfg


def bf16_enabled(ds_cfg: dict) -> bool:
    return bool(ds_cfg.get("bf16", {}).get("enabled", False))


def set_bf16(ds_cfg: dict, enabled: bool) -> dict:
    cfg = json.loads(json.dumps(ds_cfg))
    cfg.setdefault("bf16", {})["enabled"] = enabled
    return cfg


# ---------------------------------------------------------------------------------------------
# Comparing a run directory's config with a new launch.

# Keys that may change between launches of the same run.
_RESUMABLE_KEYS = {
    "resume",
    "resume_explicit",
    "train.stop_at_step",
    "train.log_every",
    "data.prefetch_batches",
}


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def config_differences(old: dict, new: dict) -> list[str]:
    """Keys whose values differ between two resolved ``config.json`` documents."""
    a, b = _flatten(old), _flatten(new)
    diffs = []
    for key in sorted(set(a) | set(b)):
        short = key.removeprefix("run.")
        if short in _RESUMABLE_KEYS or key.startswith("launch."):
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            diffs.append(f"{key}: {a.get(key, '<unset>')!r} -> {b.get(key, '<unset>')!r}")
    return diffs
