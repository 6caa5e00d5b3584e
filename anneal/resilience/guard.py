"""The loss-spike guard: detect a bad step, then pass over it or rewind and skip its samples.

After every optimizer step the loop hands the guard the step's loss (mean over ranks, the same
number on every rank) and global grad norm, so every rank takes the same decision:

- non-finite loss or grad norm, update skipped: DeepSpeed's ZeRO optimizers skip a step whose
  global grad norm is inf/NaN (``engine.was_step_applied()`` is then False, and the LR schedule
  does not advance). The guard logs it and training goes on; the step's samples are consumed.
- non-finite and the update was applied anyway (an optimizer without that check): rewind, so
  that a non-finite step never stays in the weights.
- a finite loss above ``median + mad_k * 1.4826 * MAD`` and above ``median * (1 + min_jump)``
  of the last ``window`` good steps (once ``min_history`` are known): rewind.

A rewind reloads the newest intact checkpoint older than the spike, skips the global samples
from that checkpoint's data position to the end of the spiking step plus
``skip_margin_steps`` steps, optionally scales the peak LR by ``lr_scale``, and continues.
More than ``max_rewinds`` incidents within ``span_steps`` steps stop the run with a message
naming the steps and samples. A run whose loss has not been finite once stops sooner, with a
message of its own: after ``NEVER_FINITE_STEPS`` steps, at its last step, or when
``max_rewinds`` would stop it, whichever comes first. Every decision is an event to the run's
observers (``on_event``: a row of metrics.jsonl, ``anneal.train.observers``) and a console
line. The skipped ranges and the LR scale are kept in each checkpoint's client state and in
``<run>/guard.json`` (written at once), so a resume from a checkpoint older than the rewind skips
them too.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from pathlib import Path

from anneal import rundir
from anneal.config.run import GuardConfig
from anneal.dist import is_main_process, print0
from anneal.errors import UserError
from anneal.files import write_atomic
from anneal.resilience import checkpoint
from anneal.resilience.manifest import saved_step

log = logging.getLogger(__name__)

MAD_TO_SIGMA = 1.4826  # MAD x this estimates the standard deviation of normal noise
NEVER_FINITE_STEPS = 3
"""Steps without one finite loss since the run began after which the run stops: each step read
other samples and the weights did not change (its update was skipped) or are already NaN, so
a fourth step would fail as the first three did. It is below ``max_rewinds``' default (3
incidents allowed), so that this message comes first."""


class Guard:
    """Loss history and the record of incidents, skipped samples and LR scale of one run."""

    def __init__(self, cfg: GuardConfig, *, run_dir: Path, resuming: bool):
        self.cfg = cfg
        self.path = rundir.guard_path(run_dir)
        self.history: list[tuple[int, float]] = []
        """(step, loss) of the last ``window`` good steps."""
        self.incidents: list[dict] = []
        self.skipped: list[tuple[int, int]] = []
        """Global sample ranges [start, end) never to be trained on."""
        self.lr_scale = 1.0
        self.never_finite: list[int] | None = []
        """The steps of this process so far, while no loss of the run has been finite; None
        once one has been (or the restored history holds one)."""
        if resuming and self.path.is_file():
            self._merge_log(json.loads(self.path.read_text()))

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "history": self.history,
            "incidents": self.incidents,
            "skipped": self.skipped,
            "lr_scale": self.lr_scale,
        }

    def _merge_log(self, state: dict) -> None:
        """Take the incidents, skips and LR scale of ``state`` where they are newer."""
        seen = {(i["step"], i["reason"], tuple(i["samples"])) for i in self.incidents}
        for i in state.get("incidents", []):
            if (i["step"], i["reason"], tuple(i["samples"])) not in seen:
                self.incidents.append(i)
        for a, b in state.get("skipped", []):
            if (a, b) not in self.skipped:
                self.skipped.append((a, b))
        self.skipped.sort()
        self.lr_scale = min(self.lr_scale, state.get("lr_scale", 1.0))

    def restore(self, engine, client: dict, position: int) -> int:
        """After a checkpoint load: its loss history, the union of the incident logs, the LR
        scale re-applied, and the data position moved past any skipped range."""
        saved = client.get("guard", {})
        self.history = [tuple(h) for h in saved.get("history", [])]
        if self.history:
            self.never_finite = None
        self._merge_log(saved)
        if self.lr_scale != saved.get("lr_scale", 1.0):
            _scale_peak_lr(engine, self.lr_scale / saved.get("lr_scale", 1.0))
        return self.skip_past(position)

    def skip_past(self, position: int) -> int:
        """``position``, moved to the end of every skipped range it falls in."""
        for a, b in sorted(self.skipped):
            if a <= position < b:
                position = b
        return position

    def _save_log(self) -> None:
        if is_main_process():
            write_atomic(self.path, json.dumps(self.state_dict(), indent=1) + "\n")

    # -- detection ---------------------------------------------------------------------------

    def threshold(self) -> float | None:
        """The loss above which a step is a spike; None until ``min_history`` good steps."""
        if len(self.history) < max(self.cfg.min_history, 2):
            return None
        losses = [loss for _, loss in self.history]
        median = statistics.median(losses)
        mad = statistics.median(abs(x - median) for x in losses)
        return max(median + self.cfg.mad_k * MAD_TO_SIGMA * mad, median * (1 + self.cfg.min_jump))

    def check(
        self, row: dict, engine, *, samples: tuple[int, int], events, last: bool = False
    ) -> str:
        """``ok``, ``skipped`` (non-finite, update skipped by the optimizer) or ``rewind``.

        ``events``: the run's observers (``anneal.train.observers.Observer``), told each
        decision through ``on_event``. ``row``: the step's train row (its loss is the mean
        over ranks); ``engine`` says whether the update was applied and the global grad norm
        (None where the engine does not compute one, as without ZeRO: then only the loss is
        checked); ``last``: the run's last step (a run that never had a finite loss stops
        there at the latest)."""
        if not self.cfg.enabled:
            return "ok"
        step, loss = row["step"], row["loss"]
        if math.isfinite(loss):
            self.never_finite = None
        step_applied = engine.was_step_applied()
        grad_norm = engine.get_global_grad_norm()
        grad_norm = None if grad_norm is None else float(grad_norm)
        if not (math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))):
            reason = "nonfinite"
            verdict = "rewind" if step_applied else "skipped"
            threshold = None
        else:
            threshold = self.threshold()
            if threshold is None or loss <= threshold:
                self.history = [*self.history, (step, loss)][-self.cfg.window :]
                return "ok"
            reason, verdict = "loss", "rewind"
        events.on_event(
            step,
            "spike",
            reason=reason,
            loss=loss,
            grad_norm=grad_norm,
            threshold=threshold,
            samples=list(samples),
            update_applied=step_applied,
            action=verdict,
        )
        print0(
            f"guard: step {step} spike ({reason}): loss {loss:.4f}"
            + (f" > threshold {threshold:.4f}" if threshold is not None else "")
            + (f", grad norm {grad_norm:.4g}" if grad_norm is not None else "")
            + f", samples [{samples[0]}, {samples[1]}) -> {verdict}"
        )
        self.incidents.append(
            {"step": step, "reason": reason, "samples": list(samples), "action": verdict}
        )
        self._stop_if_never_finite(step, last=last)
        self._stop_if_too_many(step)
        if verdict == "skipped":  # consumed without an update; a replay consumes them again
            self._save_log()
            events.on_event(step, "skip", samples=list(samples), reason="update skipped")
        return verdict

    def _stop_if_never_finite(self, step: int, *, last: bool) -> None:
        """UserError once ``NEVER_FINITE_STEPS`` steps, the run's last step or the incidents
        ``max_rewinds`` allows have passed without one finite loss since the run began."""
        if self.never_finite is None:
            return
        self.never_finite.append(step)
        steps = self.never_finite
        if len(steps) < min(NEVER_FINITE_STEPS, self.cfg.max_rewinds + 1) and not last:
            return
        self._save_log()
        span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]} to {steps[-1]}"
        raise UserError(
            f"guard: the loss has never been finite in this run: NaN or inf at every step so "
            f"far ({span}), so no update was ever trained, and more steps would go the same "
            f"way. Not a spike: the first step's loss comes before any update, so the cause is "
            f"what the model starts from, not the LR: its initial weights (--init-from's, or "
            f"the checkpoint resumed) or the precision (train.precision). Fix them, then "
            f"start again with --restart.",
            every_rank=True,
        )

    def _stop_if_too_many(self, step: int) -> None:
        recent = [i for i in self.incidents if i["step"] > step - self.cfg.span_steps]
        if len(recent) > self.cfg.max_rewinds:
            self._save_log()
            lines = "; ".join(
                f"step {i['step']} ({i['reason']}, samples [{i['samples'][0]}, "
                f"{i['samples'][1]}), {i['action']})"
                for i in recent
            )
            raise UserError(
                f"guard: {len(recent)} loss spikes within {self.cfg.span_steps} steps, more "
                f"than guard.max_rewinds={self.cfg.max_rewinds}: {lines}. Stopping; the "
                f"checkpoints before them are intact. Lower the peak LR (--set optim.lr=... or "
                f"guard.lr_scale=0.5), inspect those samples, or raise guard.max_rewinds; "
                f"docs/resilience.md says how to rewind by hand.",
                every_rank=True,
            )

    # -- rewind ------------------------------------------------------------------------------

    def load_before_spike(
        self,
        engine,
        ckpt_dir: Path,
        *,
        spike_step: int,
        spike_end: int,
        samples_per_step: int,
        expert_parallel: int = 1,
        tensor_parallel: int = 1,
        zero_stage: int | None = None,
    ) -> tuple[dict, Path]:
        """Collective. Reload the newest intact checkpoint older than ``spike_step``, and record
        the skip of the samples from its position to ``spike_end`` plus the margin, and the
        lower LR. Returns its client state, for the caller to restore from as from any
        checkpoint (``anneal.train.Trainer.load_state_dict``, which calls ``restore``), and
        where it was; then ``rewound`` logs it. The Trainer's ``rewind`` calls the three.
        ``expert_parallel``, ``tensor_parallel``, ``zero_stage``: this job's, for
        ``checkpoint.load`` (the checkpoint may be the one this run resumed from, saved at
        another layout)."""
        older = [p for p in checkpoint.intact_checkpoints(ckpt_dir) if saved_step(p) < spike_step]
        tag_dir = checkpoint.verified_resume(older[-1], fallback=True) if older else None
        if tag_dir is None:
            raise UserError(
                f"guard: loss spike at step {spike_step} and no intact checkpoint before it in "
                f"{ckpt_dir} to rewind to. Save more often (--save-every), or turn the guard "
                f"off for the first steps (guard.min_history).",
                every_rank=True,
            )
        client = checkpoint.load(
            engine,
            tag_dir,
            ckpt_dir=ckpt_dir,
            expert_parallel=expert_parallel,
            tensor_parallel=tensor_parallel,
            zero_stage=zero_stage,
        )
        start = client["data"]["position"]
        end = spike_end + self.cfg.skip_margin_steps * samples_per_step
        self.skipped.append((start, end))
        self.lr_scale *= self.cfg.lr_scale
        self._rewound_skip = (start, end)
        return client, tag_dir

    def rewound(self, spike_step: int, client: dict, tag_dir: Path, events) -> None:
        """After ``load_before_spike`` and the restore: the log file, the events (to
        ``events.on_event``, as in ``check``) and the console line."""
        self._save_log()
        start, end = self._rewound_skip
        events.on_event(
            spike_step,
            "rewind",
            to_step=client["step"],
            checkpoint=str(tag_dir),
            lr_scale=self.lr_scale,
        )
        events.on_event(spike_step, "skip", samples=[start, end], reason="rewind")
        print0(
            f"guard: rewound to {tag_dir.name} (step {client['step']}); skipping samples "
            f"[{start}, {end}); peak LR x{self.lr_scale:g}"
        )


def _scale_peak_lr(engine, factor: float) -> None:
    """Multiply the schedule's peak LRs (``anneal.config.schedule.WarmupDecay``) by ``factor``."""
    engine.lr_scheduler.scale_peak(factor)
