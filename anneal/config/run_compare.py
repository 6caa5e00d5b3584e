"""Comparing a run directory's ``config.json`` with a new launch: which keys differ, less those
that may change between launches of one run (split from ``anneal.config.run``, the schema, by
meaning)."""

from __future__ import annotations

from typing import Any

from anneal.config.run import RENAMED_KEYS

# Keys that may change between launches of the same run (and every guard.* key: tuning the guard
# after a spike is what a resume is for).
_RESUMABLE_KEYS = {
    "resume",
    "resume_explicit",
    "restart",
    "force",
    "train.stop_at_step",
    "train.log_every",
    "train.memory_per_rank",
    "train.loss",
    "train.loss_chunk_tokens",
    "train.heartbeat_timeout_s",
    "train.collective_timeout_s",
    "train.eval_tasks",  # scoring reads the weights and changes nothing of the run
    "train.eval_tasks_every",
    "train.eval_tasks_limit",
    "data.prefetch_batches",
    "train.compile",  # the same losses within 1e-5 relative (docs/throughput.md)
}


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:  # a tuple reads back from config.json as a list
            flat[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return flat


def _under_new_names(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened document with the keys an older Anneal wrote under their new names
    (``run.train.eval_every`` -> ``run.train.val_every``, the ``branch`` section ->
    ``cooldown``), so an older run compares equal."""
    new_names = {f"run.{old}": f"run.{new}" for old, new in RENAMED_KEYS.items()}
    return {
        new_names.get(k, "cooldown." + k[7:] if k.startswith("branch.") else k): v
        for k, v in flat.items()
    }


_LAYOUT_KEYS = {
    "ds_config.gradient_accumulation_steps",
    "ds_config.train_micro_batch_size_per_gpu",
    "resolved_from.gradient_accumulation_steps",
    "resolved_from.train_micro_batch_size_per_gpu",
    "resolved_from.train_batch_size",
}
"""How the global batch splits over the ranks: they change with the number of ranks (a job
resubmitted on fewer nodes) and, while ``ds_config.train_batch_size`` holds, the run does not."""


_ADDED_KEYS = {
    "run.data.document_mask": False,
    "run.train.float8": "off",
    "run.train.float8_layers": "auto",
    "run.train.compile": "off",
}
"""Keys an older Anneal did not write, and the value an older run trained with."""


def config_differences(old: dict, new: dict) -> list[str]:
    """Keys whose values differ between two resolved ``config.json`` documents. The split of
    the global batch into micro-batches and accumulation steps counts only with another global
    batch: a run resumed on another number of ranks keeps its global batch."""
    a, b = (_ADDED_KEYS | _under_new_names(_flatten(doc)) for doc in (old, new))
    same_batch = a.get("ds_config.train_batch_size") == b.get("ds_config.train_batch_size")
    diffs = []
    for key in sorted(set(a) | set(b)):
        short = key.removeprefix("run.")
        if short in _RESUMABLE_KEYS or key.startswith("launch.") or short.startswith("guard."):
            continue
        if same_batch and key in _LAYOUT_KEYS:
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            diffs.append(f"{key}: {a.get(key, '<unset>')!r} -> {b.get(key, '<unset>')!r}")
    return diffs
