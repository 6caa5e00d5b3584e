"""The DeepSpeed JSON a run uses: finding it, reading it strictly, ``--set ds.*`` overrides,
and DeepSpeed's own last word on the resolved result.

Every DeepSpeed key has one home: a JSON file in ``ds_configs/``, edited per cluster. Anneal
reads it strictly against ``anneal.config.ds_schema`` (DeepSpeed itself silently accepts a
top-level ``gradient_clipp1ng``) and applies ``--set ds.*`` overrides through the same schema.
The values that belong to the run rather than the cluster are filled where the file says
``"auto"`` by ``resolve_ds_config`` (``anneal.resolution.ds_resolve``), named here too because the
launch resolves a ds_config through this module.
"""

from __future__ import annotations

import json
from pathlib import Path

from anneal.config.ds_schema import REQUIRED, check_ds_ranges, validate_ds_config
from anneal.config.run import REPO_ROOT, RunConfig
from anneal.errors import UserError
from anneal.resolution.ds_resolve import resolve_ds_config as resolve_ds_config

DS_CONFIG_DIR = REPO_ROOT / "ds_configs"


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
    check_ds_ranges(cfg, source=source)
    for key_path in REQUIRED:
        node = cfg
        for k in key_path:
            if not isinstance(node, dict) or k not in node:
                raise UserError(f"{source}: missing required key {'.'.join(key_path)!r}.")
            node = node[k]
    opt = cfg["optimizer"]["type"]
    if opt.lower() not in ("adamw", "adam", "muon"):
        raise UserError(
            f"{source}: optimizer.type {opt!r} is not supported; use AdamW (Muon: --set "
            f"optim.optimizer=muon with this file as it is)."
        )
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
    check_ds_ranges(cfg, source=f"{source} (with --set ds.* overrides)")
    return cfg


def check_with_deepspeed(resolved: dict, *, source: str) -> None:
    """Let DeepSpeed's own config class (``DeepSpeedConfig``: its pydantic models of ZeRO,
    precision, activation checkpointing, ... and its sanity checks) judge the resolved config
    now, as the engine will, so that what it refuses is a UserError before anything is written.

    The scheduler is Anneal's (``WarmupDecay``), so it is left out as ``build_engine`` leaves
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


def precision(cfg: RunConfig, ds: dict, *, fast_bf16: bool, device_type: str):
    """(ds_config with bf16 decided, note or None). ``auto`` keeps the file's bf16 only where
    the device has fast bf16 (this CPU ran a bf16 matmul about 400x slower than fp32)."""
    want = cfg.train.precision
    if want == "bf16":
        return set_bf16(ds, True), None
    if want == "fp32" or (bf16_enabled(ds) and not fast_bf16):
        note = None
        if bf16_enabled(ds) and want == "auto":
            note = (
                f"device {device_type} has no fast bf16: training in fp32 "
                f"(bf16.enabled -> false; --set train.precision=bf16 forces bf16)"
            )
        return set_bf16(ds, False), note
    return ds, None
