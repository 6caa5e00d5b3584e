"""The typed run config (one small frozen dataclass per concern) and the batch arithmetic.

What a model size wants (preset, peak LR, warmup, global batch, run length) lives here, with
the recipe's defaults; what a cluster wants lives in the DeepSpeed JSON (``anneal.config.ds``).
``--set section.key=value`` overrides go through these types. User mistakes raise
``anneal.errors.UserError`` with one paragraph naming the flag or key and how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from pathlib import Path
from typing import Any

from anneal.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
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
        heads, hidden = preset.num_attention_heads, preset.hidden_size
        if hidden % heads or (hidden // heads) % 2:
            fits = [h for h in range(1, 129) if hidden % h == 0 and hidden // h % 2 == 0]
            other = f"--set model.num_attention_heads to one of {fits[-4:]}, or " if fits else ""
            near = 2 * heads * max(1, round(hidden / heads / 2))
            raise UserError(
                f"model.hidden_size ({hidden}) must be model.num_attention_heads ({heads}) "
                f"times an even head size (rotary embeddings turn pairs of channels), but "
                f"{hidden} / {heads} = {hidden / heads:g}. Set {other}--set model.hidden_size "
                f"to a multiple of {2 * heads} (e.g. {near})."
            )
        return preset


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    path: str = "data/stdlib"
    """Prepared data directory (``anneal data prepare``)."""
    prefetch_batches: int = 4
    """Micro-batches read ahead of the model by a background thread."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """What a model size wants from the optimizer and schedule; recipes set these from
    published tables. Each fills the matching ds_config value when the file says ``"auto"``."""

    lr: float = 3e-4
    """Peak learning rate (``optimizer.params.lr``); the schedule decays to 0.1 x this."""
    global_batch_tokens: int = 524_288
    """Tokens per optimizer step over all ranks (``train_batch_size`` x seq_len); the
    accumulation steps follow from the ds_config's micro-batch and the data-parallel size."""
    warmup_tokens: int = 375_000_000
    """Linear warmup length in tokens (GPT-3 warmed up over 375M tokens at every size)."""
    warmup_max_share: float = 0.1
    """Cap of the ``"auto"`` warmup as a share of the run, so a short run always fits."""


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
    keep_every: int = 0
    """Checkpoints whose step is a multiple of this are milestones, never deleted by
    ``keep_last``; 0: none."""
    log_every: int = 10
    """Console line every N steps (metrics.jsonl gets every step)."""
    memory_per_rank: bool = False
    """Also write every rank's memory to each train row (``mem_gib``, a list) and TensorBoard
    (``train/mem_gib/rank<N>``). Off: the smallest, the largest and the rank of the largest
    only, so a row has the same size at any number of ranks."""
    heartbeat_timeout_s: float = 180.0
    """A rank whose heartbeat stops for this long (or whose process is gone) is reported by
    the others, which then exit non-zero (``anneal.resilience.heartbeat``); 0: no heartbeat."""
    collective_timeout_s: float = 1800.0
    """Timeout of every collective (``deepspeed.init_distributed``): the backstop for a hang
    the heartbeat does not see. Keep it above the longest checkpoint save or validation."""
    seed: int = 1234
    export_every_save: bool = False
    """Export a verified Hugging Face model to RUN/hf after every checkpoint (rank 0)."""
    wandb: bool = False
    """Mirror metrics to Weights & Biases when wandb is installed (offline unless configured)."""
    precision: str = "auto"
    """auto | bf16 | fp32. auto keeps the ds_config's bf16 where the device has fast bf16 and
    turns it off (saying so) where it does not, as on CPUs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """The loss-spike guard (``anneal.resilience.guard``; docs/resilience.md). A step is a spike
    when its
    loss or global grad norm is not finite, or when its loss (mean over ranks) exceeds both
    ``median + mad_k * 1.4826 * MAD`` and ``median * (1 + min_jump)`` of the last ``window``
    good steps. A non-finite step whose update DeepSpeed skipped is logged and passed over; any
    other spike rewinds to the newest checkpoint before it and skips the samples in between."""

    enabled: bool = True
    """Watch every step; false: log nothing, rewind nothing."""
    window: int = 100
    """Good steps of loss history behind the running median and MAD."""
    min_history: int = 20
    """Good steps seen before a finite loss can count as a spike (the loss falls fast and
    noisily at the start)."""
    mad_k: float = 6.0
    """Spike threshold in robust standard deviations (1.4826 x MAD) above the median."""
    min_jump: float = 0.25
    """A spike is also at least this share above the median (a floor when the loss is flat and
    its MAD tiny)."""
    skip_margin_steps: int = 1
    """Steps' worth of samples after the spiking step that the rewind skips as well."""
    max_rewinds: int = 3
    """Incidents (rewinds and skipped non-finite steps) allowed within ``span_steps`` before
    the run stops with a message naming the steps and samples."""
    span_steps: int = 1000
    """The window, in steps, in which ``max_rewinds`` is counted."""
    lr_scale: float = 1.0
    """Multiply the peak LR by this on each rewind (e.g. 0.8); 1 keeps it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    out: str
    ds_config: str
    resume: str = AUTO
    """auto (newest intact checkpoint in out/, if any) | none | PATH (a checkpoint tag dir)."""
    resume_explicit: bool = False
    """True when --resume was given: only then may a launch continue a run whose config
    differs from the one in out/config.json."""
    restart: bool = False
    """--restart: start over in ``out`` although it holds a run; that run's files (config,
    checkpoints, metrics, plots, report) are first moved to ``out/previous-<time>/``."""
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    guard: GuardConfig = GuardConfig()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS = {
    "model": ModelConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "guard": GuardConfig,
}
_CHOICES = {("train", "precision"): ("auto", "bf16", "fp32")}


def _shown(text: str, limit: int = 40) -> str:
    """``text`` quoted for a message, cut to ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _coerce(text: str, typ: Any, where: str) -> Any:
    if typ is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise UserError(f"{where}: expected true or false, got {_shown(text)}.")
    try:
        return typ(text)
    except ValueError:
        example = "an integer such as 100" if typ is int else "a number such as 3e-4"
        raise UserError(
            f"{where}: expected {typ.__name__} ({example}), got {_shown(text)}."
        ) from None


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply ``section.key=value`` strings through the dataclass types.

    Unknown sections or keys are errors with a suggestion; values are parsed to the field's
    type. ``ds.*`` overrides are not handled here (see ``override_ds_config``).
    """
    sections = {name: getattr(cfg, name) for name in _SECTIONS}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, field = key.partition(".")
        where = f"--set {key}={_shown(value)[1:-1]}"
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
            raise UserError(f"{where}: must be one of {', '.join(choices)}.")
        sections[section] = dataclasses.replace(sections[section], **{field: parsed})
    return dataclasses.replace(cfg, **sections)


# ---------------------------------------------------------------------------------------------
# Ranges: every numeric key, checked before anything is written or any engine is built.

MAX_DIM = 2**20
"""Largest model dimension (and context length) accepted: beyond any real model, and it keeps
every shape product inside the integer range of torch."""
_INT64 = 2**63 - 1
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
    "data.prefetch_batches": (lambda v: 0 <= v <= 1024, "0 (no read-ahead) to 1024 micro-batches"),
    "optim.lr": (lambda v: v > 0, "a finite number above 0 (the peak learning rate)"),
    "optim.global_batch_tokens": (lambda v: v >= 1, "a positive number of tokens"),
    "optim.warmup_tokens": (lambda v: v >= 0, "0 or a positive number of tokens"),
    "optim.warmup_max_share": (lambda v: 0 <= v <= 1, "a share of the run between 0 and 1"),
    "train.max_steps": _AT_LEAST_1,
    "train.stop_at_step": _STEPS,
    "train.eval_every": (lambda v: v >= 0, "0 (only after the last step) or a number of steps"),
    "train.eval_samples": (lambda v: v >= 0, "0 (no validation) or a number of windows"),
    "train.save_every": (lambda v: v >= 0, "0 (only after the last step) or a number of steps"),
    "train.keep_last": (lambda v: v >= 0, "0 (keep every checkpoint) or a number of checkpoints"),
    "train.keep_every": _STEPS,
    "train.log_every": _AT_LEAST_1,
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
    "train.eval_every": "--eval-every",
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
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            key = f"{section}.{f.name}"
            ok, want = _RANGES[key]
            finite = math.isfinite(value) and abs(value) <= _INT64
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


def optim_keys_set(overrides: list[str]) -> frozenset[str]:
    """The ``optim.*`` fields given with ``--set`` (the ds_config resolution checks them)."""
    return frozenset(
        item.partition("=")[0].removeprefix("optim.")
        for item in overrides
        if item.startswith("optim.")
    )


@dataclasses.dataclass(frozen=True)
class Batch:
    train_batch_size: int
    """Samples per optimizer step over all ranks."""
    grad_accum_steps: int
    micro_batch_per_gpu: int
    data_parallel_size: int


def batch_arithmetic(
    *,
    micro_batch_per_gpu: int,
    data_parallel_size: int,
    grad_accum_steps: int | None = None,
    train_batch_size: int | None = None,
    source: str = "the ds_config",
) -> Batch:
    """``train_batch_size = micro x accumulation x data-parallel size``, the one place it is
    computed. Give the accumulation, the global batch, or both (then they must agree)."""
    for name, value in (
        ("train_micro_batch_size_per_gpu", micro_batch_per_gpu),
        ("data-parallel size", data_parallel_size),
        ("gradient_accumulation_steps", grad_accum_steps),
        ("train_batch_size", train_batch_size),
    ):
        if value is not None and value < 1:
            raise UserError(f"{source}: {name} must be at least 1, got {value}.")
    per_step = micro_batch_per_gpu * data_parallel_size
    if grad_accum_steps is not None:
        want = per_step * grad_accum_steps
        if train_batch_size is not None and train_batch_size != want:
            raise UserError(
                f"{source}: train_batch_size is {train_batch_size} but "
                f"train_micro_batch_size_per_gpu ({micro_batch_per_gpu}) x "
                f"gradient_accumulation_steps ({grad_accum_steps}) x data-parallel size "
                f'({data_parallel_size}) = {want}. Set train_batch_size to {want} or to "auto".'
            )
        return Batch(want, grad_accum_steps, micro_batch_per_gpu, data_parallel_size)
    if train_batch_size is None:
        raise ValueError("batch_arithmetic needs grad_accum_steps or train_batch_size")
    if train_batch_size % per_step:
        lower = max(per_step, train_batch_size // per_step * per_step)
        raise UserError(
            f"{source}: a global batch of {train_batch_size} samples does not divide across "
            f"train_micro_batch_size_per_gpu ({micro_batch_per_gpu}) x data-parallel size "
            f"({data_parallel_size}) = {per_step} samples per accumulation step. Use a global "
            f"batch that is a multiple of {per_step} (e.g. {lower} or {lower + per_step}: --set "
            f"optim.global_batch_tokens=SAMPLES*seq_len), or a micro-batch that divides "
            f"{train_batch_size // data_parallel_size or 1}, or another number of ranks."
        )
    return Batch(
        train_batch_size, train_batch_size // per_step, micro_batch_per_gpu, data_parallel_size
    )


def suggest(word: str, candidates) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, else an empty string."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------------------------
# Comparing a run directory's config with a new launch.

# Keys that may change between launches of the same run (and every guard.* key: tuning the guard
# after a spike is what a resume is for).
_RESUMABLE_KEYS = {
    "resume",
    "resume_explicit",
    "restart",
    "train.stop_at_step",
    "train.log_every",
    "train.memory_per_rank",
    "train.heartbeat_timeout_s",
    "train.collective_timeout_s",
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
        if short in _RESUMABLE_KEYS or key.startswith("launch.") or short.startswith("guard."):
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            diffs.append(f"{key}: {a.get(key, '<unset>')!r} -> {b.get(key, '<unset>')!r}")
    return diffs
