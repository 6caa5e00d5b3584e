"""Linear warmup then cosine decay to 0.1 x peak (docs/training.md), from the resolved ds_config.

The values live in the ds_config's ``WarmupCosineLR`` block; Anneal builds this scheduler from
them and hands it to ``deepspeed.initialize``. DeepSpeed's own ``WarmupCosineLR`` departs from
the formula in two ways measured here: the first two optimizer steps run at lr 0 (the scheduler
starts at iteration -1), and its cosine is one step ahead, so the peak is never applied.

Optimizer step t (counted from 1) uses::

    t <= T_warm:  a_t = a_max * (r0 + (1 - r0) * t / T_warm)       (r0 = warmup_min_ratio)
    t >  T_warm:  a_t = a_min + (a_max - a_min) * (1 + cos(pi * p)) / 2,
                  p = (t - T_warm) / (T_max - T_warm)

with ``a_min = cos_min_ratio * a_max`` (0.1 in every shipped config), held at a_min after T_max.
"""

from __future__ import annotations

import math


def lr_ratio(
    t: int,
    *,
    total_num_steps: int,
    warmup_num_steps: int,
    warmup_min_ratio: float = 0.0,
    cos_min_ratio: float = 0.1,
) -> float:
    """Fraction of the peak LR applied at optimizer step ``t`` (1-based)."""
    if warmup_num_steps > 0 and t <= warmup_num_steps:
        return warmup_min_ratio + (1.0 - warmup_min_ratio) * t / warmup_num_steps
    span = max(1, total_num_steps - warmup_num_steps)
    progress = min(1.0, (t - warmup_num_steps) / span)
    return cos_min_ratio + (1.0 - cos_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """LR scheduler with DeepSpeed's scheduler protocol (step / get_lr / state_dict)."""

    def __init__(
        self,
        optimizer,
        *,
        total_num_steps: int,
        warmup_num_steps: int,
        warmup_min_ratio: float = 0.0,
        cos_min_ratio: float = 0.1,
        warmup_type: str = "linear",
    ):
        if warmup_type != "linear":
            raise ValueError(f"warmup_type {warmup_type!r}: only 'linear' is supported")
        self.optimizer = optimizer
        self.kwargs = dict(
            total_num_steps=total_num_steps,
            warmup_num_steps=warmup_num_steps,
            warmup_min_ratio=warmup_min_ratio,
            cos_min_ratio=cos_min_ratio,
        )
        self.peak_lrs = [g["lr"] for g in optimizer.param_groups]
        self.steps_done = 0
        self._apply()

    def _apply(self) -> None:
        ratio = lr_ratio(self.steps_done + 1, **self.kwargs)
        for group, peak in zip(self.optimizer.param_groups, self.peak_lrs, strict=True):
            group["lr"] = peak * ratio

    def step(self, **_: object) -> None:
        self.steps_done += 1
        self._apply()

    def scale_peak(self, factor: float) -> None:
        """Multiply the peak LRs by ``factor`` from the current step on (a guard rewind)."""
        self.peak_lrs = [lr * factor for lr in self.peak_lrs]
        self._apply()

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    get_last_lr = get_lr

    def state_dict(self) -> dict:
        return {"steps_done": self.steps_done, "peak_lrs": self.peak_lrs}

    def load_state_dict(self, state: dict) -> None:
        self.steps_done = state["steps_done"]
        self.peak_lrs = state["peak_lrs"]
        self._apply()
