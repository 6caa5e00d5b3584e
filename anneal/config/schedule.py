"""The LR schedules (docs/training.md): linear warmup, then cosine decay to the floor
(``optim.schedule = "cosine"``), or the peak held and a short final decay (``"wsd"``,
warmup-stable-decay), from the resolved ds_config and the run's ``optim`` section.

The warmup and the run length live in the ds_config's ``WarmupCosineLR`` block; Anneal builds
this scheduler from them and hands it to ``deepspeed.initialize``. DeepSpeed's own
``WarmupCosineLR`` departs from the formula in two ways measured here: the first two optimizer
steps run at lr 0 (the scheduler starts at iteration -1), and its cosine is one step ahead, so
the peak is never applied.

Optimizer step t (counted from 1) uses ``a_t = a_max * ratio(t)``::

    t <= T_warm:  ratio = r0 + (1 - r0) * t / T_warm                  (r0 = warmup_min_ratio)
    cosine, t > T_warm:
                  ratio = m + (1 - m) * (1 + cos(pi * p)) / 2,  p = (t - T_warm) / (T_max - T_warm)
    wsd, T_warm < t <= T_s:   ratio = 1                               (the stable phase)
    wsd, t > T_s: ratio = m + (1 - m) * f(p),  p = (t - T_s) / D,  T_s = T_max - D,
                  D = min(max(1, round(decay_share * T_max)), T_max - T_warm)
                  f = 1 - p (linear), 1 - sqrt(p) (1-sqrt), (1 + cos(pi * p)) / 2 (cosine)

with the floor ``m = min_ratio`` (``scheduler.params.cos_min_ratio`` of the resolved ds_config),
held after T_max. Under wsd the ratio at a step before T_s depends on T_max only through
T_s, so a run resumed with a larger T_max goes on at the peak and decays from its new end.

A cooldown branch (``anneal.resolution.cooldown``) starts from step S of a wsd run, where the ratio
was r, and decays over its own D = T_max - S steps with the same shapes::

    branch, t > S:  ratio = m + (r - m) * f(p),  p = min(1, (t - S) / D)
"""

from __future__ import annotations

import dataclasses
import math

SCHEDULES = ("cosine", "wsd")
DECAY_SHAPES = ("linear", "1-sqrt", "cosine")
DEFAULT_FLOOR = {"cosine": 0.1, "wsd": 0.0}
"""The floor of each schedule when neither ``optim.min_lr_ratio`` nor the ds_config's
``cos_min_ratio`` gives one: cosine's 0.1 as in every shipped config (Chinchilla, GPT-3); wsd
decays to 0 as Haegele et al. 2024 (arXiv 2405.18392) and MiniCPM (arXiv 2404.06395) do."""


def lr_ratio(
    t: int,
    *,
    total_num_steps: int,
    warmup_num_steps: int,
    warmup_min_ratio: float = 0.0,
    cos_min_ratio: float = 0.1,
) -> float:
    """Fraction of the peak LR applied at optimizer step ``t`` (1-based), warmup-cosine."""
    if warmup_num_steps > 0 and t <= warmup_num_steps:
        return warmup_min_ratio + (1.0 - warmup_min_ratio) * t / warmup_num_steps
    span = max(1, total_num_steps - warmup_num_steps)
    progress = min(1.0, (t - warmup_num_steps) / span)
    return cos_min_ratio + (1.0 - cos_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decay_num_steps(*, total_num_steps: int, warmup_num_steps: int, decay_share: float) -> int:
    """WSD's final decay in steps: ``decay_share`` of the run, rounded (at least one step),
    within what the warmup leaves."""
    wanted = max(1, round(decay_share * total_num_steps))
    return max(0, min(wanted, total_num_steps - warmup_num_steps))


def _decay(shape: str, p: float) -> float:
    """The share of (peak - floor) left at progress ``p`` in [0, 1] of the decay."""
    if shape == "linear":
        return 1.0 - p
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(p)
    return 0.5 * (1.0 + math.cos(math.pi * p))


def wsd_ratio(
    t: int,
    *,
    total_num_steps: int,
    warmup_num_steps: int,
    warmup_min_ratio: float = 0.0,
    min_ratio: float = 0.0,
    decay_share: float = 0.2,
    decay_shape: str = "1-sqrt",
) -> float:
    """Fraction of the peak LR applied at optimizer step ``t`` (1-based), warmup-stable-decay."""
    if warmup_num_steps > 0 and t <= warmup_num_steps:
        return warmup_min_ratio + (1.0 - warmup_min_ratio) * t / warmup_num_steps
    decay = decay_num_steps(
        total_num_steps=total_num_steps,
        warmup_num_steps=warmup_num_steps,
        decay_share=decay_share,
    )
    start = total_num_steps - decay
    if t <= start:
        return 1.0
    if t >= total_num_steps:
        return min_ratio
    return min_ratio + (1.0 - min_ratio) * _decay(decay_shape, (t - start) / decay)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """One run's schedule, resolved: what the scheduler applies and what it saves."""

    kind: str = "cosine"
    total_num_steps: int
    warmup_num_steps: int
    warmup_min_ratio: float = 0.0
    min_ratio: float = 0.1
    decay_share: float = 0.2
    decay_shape: str = "1-sqrt"
    cooldown_step: int = 0
    """A cooldown branch's first step S (its parent's checkpoint); 0: not a branch."""
    cooldown_ratio: float = 1.0
    """The parent's ratio at step S, where the branch's decay starts."""

    @classmethod
    def resolved(cls, sched_params: dict, optim) -> Schedule:
        """From a resolved ds_config's ``scheduler.params`` (run length, warmup, floor in
        ``cos_min_ratio``) and the run's ``optim`` section (the kind and the decay)."""
        warmup_type = sched_params.get("warmup_type", "linear")
        if warmup_type != "linear":
            raise ValueError(f"warmup_type {warmup_type!r}: only 'linear' is supported")
        get = optim.get if isinstance(optim, dict) else lambda k, d: getattr(optim, k, d)
        return cls(
            kind=get("schedule", "cosine"),
            total_num_steps=int(sched_params["total_num_steps"]),
            warmup_num_steps=int(sched_params["warmup_num_steps"]),
            warmup_min_ratio=float(sched_params.get("warmup_min_ratio", 0.0)),
            min_ratio=float(sched_params["cos_min_ratio"]),
            decay_share=float(get("decay_share", 0.2)),
            decay_shape=get("decay_shape", "1-sqrt"),
        )

    def ratio(self, t: int) -> float:
        """Fraction of the peak LR at optimizer step ``t`` (1-based)."""
        kw = dict(
            total_num_steps=self.total_num_steps,
            warmup_num_steps=self.warmup_num_steps,
            warmup_min_ratio=self.warmup_min_ratio,
        )
        if self.kind == "cosine":
            return lr_ratio(t, cos_min_ratio=self.min_ratio, **kw)
        if self.cooldown_step and t > self.cooldown_step:
            span = max(1, self.total_num_steps - self.cooldown_step)
            p = min(1.0, (t - self.cooldown_step) / span)
            m = self.min_ratio
            return m + (self.cooldown_ratio - m) * _decay(self.decay_shape, p)
        if self.cooldown_step:  # the parent's steps (never run here), drawn as warmup, peak
            warm, r0 = self.warmup_num_steps, self.warmup_min_ratio
            if warm and t <= warm and t < self.cooldown_step:
                return r0 + (1.0 - r0) * t / warm
            return self.cooldown_ratio if t == self.cooldown_step else 1.0
        return wsd_ratio(
            t,
            min_ratio=self.min_ratio,
            decay_share=self.decay_share,
            decay_shape=self.decay_shape,
            **kw,
        )

    @property
    def decay_start(self) -> int:
        """The last step at the peak: the end of the warmup (cosine) or of the stable phase."""
        if self.kind == "cosine":
            return self.warmup_num_steps
        if self.cooldown_step:
            return self.cooldown_step
        return self.total_num_steps - decay_num_steps(
            total_num_steps=self.total_num_steps,
            warmup_num_steps=self.warmup_num_steps,
            decay_share=self.decay_share,
        )

    def describe(self) -> str:
        """One line: the phases with their steps."""
        warm, end, floor = self.warmup_num_steps, self.total_num_steps, self.min_ratio
        if self.kind == "cosine":
            return f"warmup {warm} steps, cosine to {floor:g} x peak at step {end}"
        if self.cooldown_step:
            return (
                f"cooldown branch: from {self.cooldown_ratio:.4g} x peak after step "
                f"{self.cooldown_step}, {self.decay_shape} decay to {floor:g} x peak at step {end}"
            )
        return (
            f"warmup {warm} steps, peak to step {self.decay_start}, {self.decay_shape} decay to "
            f"{floor:g} x peak at step {end}"
        )

    def change_on_resume(self, saved: Schedule, step: int) -> str | None:
        """What resuming at ``step`` under this schedule changes, against the one the checkpoint
        was saved with: None when the LR of the next step is the same under both (an extended
        WSD run in its stable phase), else a sentence with the jump and the new end."""
        if saved == self:
            return None
        before, after = saved.ratio(step + 1), self.ratio(step + 1)
        if math.isclose(before, after, rel_tol=1e-9, abs_tol=1e-12):
            return None
        return (
            f"resuming at step {step} with a changed schedule: the LR of step {step + 1} jumps "
            f"from {before:.4g} to {after:.4g} x peak ({after / before if before else math.inf:.3g}"
            f"x). The schedule was: {saved.describe()}; it is now: {self.describe()}."
        )


class WarmupDecay:
    """LR scheduler with DeepSpeed's scheduler protocol (step / get_lr / state_dict), applying
    a ``Schedule``. Its state records the schedule, so a resume can say what changed."""

    def __init__(self, optimizer, schedule: Schedule):
        self.optimizer = optimizer
        self.schedule = schedule
        self.saved_schedule: Schedule | None = None
        """The schedule in the checkpoint loaded last (None before a load, or from a checkpoint
        written before schedules were recorded)."""
        self.peak_lrs = [g["lr"] for g in optimizer.param_groups]
        self.steps_done = 0
        self.apply()

    def apply(self) -> None:
        """Set every group's LR to its peak x the schedule's ratio at the next step. Called
        again after a checkpoint load: DeepSpeed restores ZeRO's optimizer state, which holds
        the LR it was saved with, after the scheduler's state."""
        ratio = self.schedule.ratio(self.steps_done + 1)
        for group, peak in zip(self.optimizer.param_groups, self.peak_lrs, strict=True):
            group["lr"] = peak * ratio

    def step(self, **_: object) -> None:
        self.steps_done += 1
        self.apply()

    def scale_peak(self, factor: float) -> None:
        """Multiply the peak LRs by ``factor`` from the current step on (a guard rewind)."""
        self.peak_lrs = [lr * factor for lr in self.peak_lrs]
        self.apply()

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    get_last_lr = get_lr

    def state_dict(self) -> dict:
        return {
            "steps_done": self.steps_done,
            "peak_lrs": self.peak_lrs,
            "schedule": dataclasses.asdict(self.schedule),
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps_done = state["steps_done"]
        self.peak_lrs = state["peak_lrs"]
        saved = state.get("schedule")
        self.saved_schedule = Schedule(**saved) if saved else None
        self.apply()

    def change_on_resume(self) -> str | None:
        """``Schedule.change_on_resume`` for the checkpoint loaded last (None without one)."""
        if self.saved_schedule is None:
            return None
        return self.schedule.change_on_resume(self.saved_schedule, self.steps_done)
