"""Resolve a launch into a ``Plan`` before anything is written or any engine is built.

``resolve_plan`` is pure apart from reading files (the ds_config, the data directory's
``meta.json``, checkpoint manifests, the run's ``config.json``): it takes the world size and the
device kind as arguments, so the launcher's pre-flight and the tests resolve the GPU path of a
launch on a machine without a GPU, exactly as the ranks will.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from anneal import checkpoint, ds_config
from anneal import model as modellib
from anneal.config import RunConfig, config_differences, optim_keys_set
from anneal.errors import UserError

DEVICE_TYPES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A launch, resolved and validated."""

    cfg: RunConfig
    ds_config: dict
    """The DeepSpeed config exactly as the engine gets it ("auto" values filled in)."""
    resolved_from: dict[str, str]
    """For each run-dependent ds_config key: its value and where it came from."""
    preset: modellib.ModelPreset
    out: Path
    resume_from: Path | None
    world_size: int
    device_type: str
    meta: dict
    """The data directory's meta.json."""
    notes: list[str]

    @property
    def seq_len(self) -> int:
        return self.preset.seq_len

    @property
    def micro_batch(self) -> int:
        return self.ds_config["train_micro_batch_size_per_gpu"]

    @property
    def grad_accum(self) -> int:
        return self.ds_config["gradient_accumulation_steps"]

    @property
    def tokens_per_step(self) -> int:
        return self.ds_config["train_batch_size"] * self.seq_len

    @property
    def bf16(self) -> bool:
        return ds_config.bf16_enabled(self.ds_config)

    @property
    def has_validation(self) -> bool:
        """Whether the val split holds at least one window of seq_len + 1 tokens."""
        from anneal.data.prepared import has_validation

        return has_validation(self.meta, seq_len=self.seq_len)

    def config_document(self) -> dict:
        """What ``config.json`` holds: the run config, the resolved ds_config and where its
        run-dependent values came from, the model and the launch."""
        return {
            "run": self.cfg.to_dict(),
            "ds_config": self.ds_config,
            "resolved_from": self.resolved_from,
            "model": {
                **dataclasses.asdict(self.preset),
                "seq_len": self.seq_len,
                "params": modellib.count_params(self.preset),
            },
            "launch": {"world_size": self.world_size, "device": self.device_type},
        }

    def describe(self) -> str:
        """The resolved launch, printed at start."""
        ds = self.ds_config
        n_params = modellib.count_params(self.preset)
        lines = [
            f"model {self.cfg.model.preset}: {n_params:,} parameters "
            f"({modellib.human_count(n_params)}), vocab {self.preset.vocab_size}, seq "
            f"{self.seq_len}; {self.world_size} rank(s) on {self.device_type}; ZeRO stage "
            f"{ds.get('zero_optimization', {}).get('stage', 0)}, "
            f"{'bf16' if self.bf16 else 'fp32'}",
            f"resolved ({self.cfg.ds_config}, then the recipe's defaults, then --set):",
        ]
        lines += [f"  {key} = {how}" for key, how in self.resolved_from.items()]
        return "\n".join(lines)


def _precision(cfg: RunConfig, ds: dict, *, fast_bf16: bool, device_type: str):
    """(ds_config with bf16 decided, note or None). ``auto`` keeps the file's bf16 only where
    the device has fast bf16 (this CPU ran a bf16 matmul about 400x slower than fp32)."""
    want = cfg.train.precision
    if want == "bf16":
        return ds_config.set_bf16(ds, True), None
    if want == "fp32" or (ds_config.bf16_enabled(ds) and not fast_bf16):
        note = None
        if ds_config.bf16_enabled(ds) and want == "auto":
            note = (
                f"device {device_type} has no fast bf16: training in fp32 "
                f"(bf16.enabled -> false; --set train.precision=bf16 forces bf16)"
            )
        return ds_config.set_bf16(ds, False), note
    return ds, None


def resolve_plan(
    cfg: RunConfig,
    overrides: list[str] = (),
    *,
    world_size: int,
    device_type: str,
    fast_bf16: bool | None = None,
) -> Plan:
    """Resolve and check everything a launch needs on ``world_size`` ranks of ``device_type``.

    ``fast_bf16`` defaults to ``device_type == "cuda"``; a rank passes what its device reports.
    Raises UserError (marked as seen by every rank) before anything is written.
    """
    try:
        return _resolve(
            cfg,
            list(overrides),
            world_size=world_size,
            device_type=device_type,
            fast_bf16=device_type == "cuda" if fast_bf16 is None else fast_bf16,
        )
    except UserError as e:
        e.every_rank = True
        raise


def _resolve(cfg, overrides, *, world_size, device_type, fast_bf16) -> Plan:
    from anneal.data.prepared import check_matches_run, check_prepared

    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {device_type!r}")
    if cfg.train.max_steps < 1:
        raise UserError(f"--max-steps must be at least 1, got {cfg.train.max_steps}.")
    ds_path = ds_config.find_ds_config(cfg.ds_config)
    ds = ds_config.load_ds_config(ds_path)
    ds = ds_config.override_ds_config(ds, ds_config.ds_overrides(overrides), source=str(ds_path))
    ds, note = _precision(cfg, ds, fast_bf16=fast_bf16, device_type=device_type)
    notes = [note] if note else []

    data_dir = Path(cfg.data.path)
    meta = check_prepared(data_dir)  # complete, undamaged, tokenizer unchanged
    preset = cfg.model.resolve(meta["vocab_size"])
    ds, resolved_from = ds_config.resolve_ds_config(
        ds,
        source=str(ds_path),
        data_parallel_size=world_size,
        max_steps=cfg.train.max_steps,
        seq_len=preset.seq_len,
        optim=cfg.optim,
        optim_set=optim_keys_set(overrides),
    )

    out = Path(cfg.out)
    resume_from = checkpoint.find_resume(cfg.resume, out / "checkpoints")
    if resume_from is not None:
        check_matches_run(meta, data_dir=data_dir, run_dir=out)
        checkpoint.check_tokenizer(
            resume_from, data_dir=data_dir, tokenizer_sha256=meta.get("tokenizer_sha256")
        )
    plan = Plan(
        cfg=cfg,
        ds_config=ds,
        resolved_from=resolved_from,
        preset=preset,
        out=out,
        resume_from=resume_from,
        world_size=world_size,
        device_type=device_type,
        meta=meta,
        notes=notes,
    )
    if not plan.has_validation and cfg.train.eval_samples > 0:
        raise UserError(
            f"--data {data_dir}: has no validation windows of {plan.seq_len + 1} tokens (its val "
            f"split holds {meta['splits']['val']['tokens']:,} tokens), so validation cannot run. "
            f"Prepare it again with a larger --val-fraction, or train without evaluation: "
            f"--set train.eval_samples=0."
        )
    old_path = out / "config.json"
    if old_path.is_file():
        diffs = config_differences(json.loads(old_path.read_text()), plan.config_document())
        if diffs and not cfg.resume_explicit:
            raise UserError(
                f"--out {out} holds a different run (its config.json differs: "
                f"{'; '.join(diffs[:5])}). Anneal will not mix two runs in one directory: "
                f"choose a new --out, or pass --resume auto (or a checkpoint path) to continue "
                f"that run with the new settings."
            )
    return plan
