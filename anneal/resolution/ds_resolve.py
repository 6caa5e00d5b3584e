"""The run's values in the DeepSpeed config: the batch arithmetic and resolving ``"auto"``.

A ds_config describes a cluster; a few of its values belong to the run instead. Where the file
says ``"auto"`` (or leaves the key out), ``resolve_ds_config`` fills them from the run:

==================================  =============================================================
key                                 ``"auto"`` becomes
==================================  =============================================================
``optimizer.params.lr``             the run config's ``optim.lr`` (the recipe's peak LR)
``train_batch_size``                ``optim.global_batch_tokens / seq_len`` samples
``gradient_accumulation_steps``     ``train_batch_size / (micro-batch x data-parallel size)``
``scheduler.params.total_num_steps`` ``--max-steps``
``scheduler.params.warmup_num_steps`` the warmup rule, ``warmup_steps`` below (on a resume: the
                                    warmup the run was resolved with, so a longer run keeps it)
``scheduler.params.cos_min_ratio``  the floor: ``optim.min_lr_ratio``, else the schedule's
                                    default (cosine 0.1, wsd 0.0)
==================================  =============================================================

An explicit number in the file is the cluster owner's choice and is kept; ``--set`` beats both.
Two exceptions: a global batch from the recipe (``optim.global_batch_tokens``) that does not
divide across micro-batch x data-parallel size is rounded up to the next multiple, saying so,
so that a recipe resolves at any number of ranks; and under ``optim.schedule = "wsd"`` the
file's ``cos_min_ratio`` (the cosine's floor) gives way to the WSD floor. ``resolve_ds_config``
returns the resolved dict and, per filled key, where its value came from, which the run prints
at start and writes to ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math

from anneal.config.ds_schema import value_or_auto
from anneal.config.run import AUTO, OptimConfig
from anneal.config.schedule import DEFAULT_FLOOR
from anneal.errors import UserError
from anneal.resolution.optimizer import resolve_optimizer


class Notes(dict):
    """For each run-dependent key, where its value came from (``config.json``'s
    ``resolved_from``); ``messages``: one-line messages that the ranks log at start."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []


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


def warmup_steps(*, optim: OptimConfig, tokens_per_step: int, max_steps: int) -> int:
    """The ``"auto"`` warmup: the recipe's warmup in tokens, as optimizer steps, capped at
    ``optim.warmup_max_share`` of the run so that a short run (a smoke test) always fits.

    ``min(ceil(warmup_tokens / tokens_per_step), floor(warmup_max_share * max_steps))``
    """
    wanted = math.ceil(optim.warmup_tokens / tokens_per_step)
    return min(wanted, math.floor(optim.warmup_max_share * max_steps))


@dataclasses.dataclass(frozen=True)
class _Run:
    """The run's side of a resolution: its optimizer config, the ``optim.*`` keys given with
    ``--set``, and the file's name for messages."""

    source: str
    optim: OptimConfig
    optim_set: frozenset[str]

    def origin(self, field: str) -> str:
        """Where the run's ``optim.<field>`` came from, for the notes."""
        return f"--set optim.{field}" if field in self.optim_set else "recipe"

    def explicit(self, key: str, field: str) -> None:
        """The file gives ``key`` as a number: a ``--set optim.<field>`` would have no effect,
        which is an error rather than a surprise."""
        if field in self.optim_set:
            raise UserError(
                f"{self.source}: {key} is set explicitly in the file, so --set optim.{field} "
                f'would have no effect. Write "auto" for {key} in the file (the run config fills '
                f"it in), or override the file's value with --set ds.{key}=VALUE."
            )


def _resolve_batch(
    cfg: dict, notes: Notes, run: _Run, *, data_parallel_size: int, seq_len: int
) -> Batch:
    """``train_batch_size`` and ``gradient_accumulation_steps``, from the file or the run's
    ``optim.global_batch_tokens`` when both are ``"auto"``."""
    micro = cfg["train_micro_batch_size_per_gpu"]
    accum = value_or_auto(cfg, ("gradient_accumulation_steps",))
    total = value_or_auto(cfg, ("train_batch_size",))
    tokens = run.optim.global_batch_tokens
    if accum == AUTO and total == AUTO:
        wanted = max(1, round(tokens / seq_len))
        per_step = micro * data_parallel_size
        samples = -(-wanted // per_step) * per_step  # rounded up to a multiple of per_step
        total_from = f"{run.origin('global_batch_tokens')}: {tokens:,} tokens / seq_len {seq_len}"
        if samples != wanted:
            total_from += (
                f" = {wanted} samples, rounded up to a multiple of micro {micro} x "
                f"{data_parallel_size} ranks"
            )
            notes.messages.append(
                f"global batch rounded up from {wanted} to {samples} samples "
                f"({samples * seq_len:,} tokens per step): a multiple of micro-batch {micro} x "
                f"{data_parallel_size} data-parallel ranks (optim.global_batch_tokens sets it)"
            )
    else:
        if accum != AUTO:
            run.explicit("gradient_accumulation_steps", "global_batch_tokens")
        if total != AUTO:
            run.explicit("train_batch_size", "global_batch_tokens")
        samples = None if total == AUTO else total
        total_from = "ds_config"
    batch = batch_arithmetic(
        micro_batch_per_gpu=micro,
        data_parallel_size=data_parallel_size,
        grad_accum_steps=None if accum == AUTO else accum,
        train_batch_size=samples,
        source=f"{run.source} ({total_from})" if total_from != "ds_config" else run.source,
    )
    cfg["train_batch_size"] = batch.train_batch_size
    cfg["gradient_accumulation_steps"] = batch.grad_accum_steps
    notes["train_batch_size"] = (
        f"{batch.train_batch_size} samples x {seq_len} = "
        f"{batch.train_batch_size * seq_len:,} tokens ({total_from})"
    )
    notes["gradient_accumulation_steps"] = (
        f"{batch.grad_accum_steps} ({'ds_config' if accum != AUTO else 'auto'}: "
        f"{batch.train_batch_size} / (micro {micro} x {data_parallel_size} ranks))"
    )
    return batch


def _resolve_lr(cfg: dict, notes: dict[str, str], run: _Run) -> None:
    """``optimizer.params.lr``: the file's number, else the run's peak LR."""
    params = cfg["optimizer"].setdefault("params", {})
    if params.get("lr", AUTO) == AUTO:
        params["lr"] = run.optim.lr
        notes["optimizer.params.lr"] = f"{run.optim.lr:g} ({run.origin('lr')})"
    else:
        run.explicit("optimizer.params.lr", "lr")
        notes["optimizer.params.lr"] = f"{params['lr']:g} (ds_config)"


def _resolve_floor(sched: dict, notes: dict[str, str], run: _Run) -> None:
    """``scheduler.params.cos_min_ratio``, the floor of either schedule: ``optim.min_lr_ratio``
    when given, else the file's number under cosine, else the schedule's default. A file number
    and an ``optim.min_lr_ratio`` that differ under cosine are two floors: an error."""
    key, optim = "scheduler.params.cos_min_ratio", run.optim
    given = sched.get("cos_min_ratio", AUTO)
    cosine = optim.schedule == "cosine"
    if optim.min_lr_ratio is not None:
        if cosine and given != AUTO and given != optim.min_lr_ratio:
            raise UserError(
                f"{run.source}: {key} is {given:g} but optim.min_lr_ratio is "
                f"{optim.min_lr_ratio:g} ({run.origin('min_lr_ratio')}): two floors for the "
                f'cosine schedule. Keep one: write "auto" for {key} in the file (the run config '
                f"fills it in), or --set optim.min_lr_ratio=auto to keep the file's."
            )
        floor, how = optim.min_lr_ratio, f"optim.min_lr_ratio, {run.origin('min_lr_ratio')}"
    elif cosine and given != AUTO:
        floor, how = given, "ds_config"
    else:
        floor, how = DEFAULT_FLOOR[optim.schedule], f"the {optim.schedule} schedule's default"
    if not cosine and given != AUTO and given != floor:
        how += f"; the file's {given:g} is the cosine schedule's floor"
    sched["cos_min_ratio"] = floor
    notes[key] = f"{floor:g} ({how})"


def _resolve_schedule(
    cfg: dict,
    notes: dict[str, str],
    run: _Run,
    *,
    max_steps: int,
    tokens_per_step: int,
    resumed_warmup: int | None,
) -> None:
    """``scheduler.params``: the run length from ``--max-steps`` (a different number in the file
    is an error) and the warmup from the file, the resumed run or ``warmup_steps``."""
    source, optim = run.source, run.optim
    sched = cfg["scheduler"].setdefault("params", {})
    given_total = sched.get("total_num_steps", AUTO)
    if given_total != AUTO and given_total != max_steps:
        raise UserError(
            f"{source}: scheduler.params.total_num_steps is {given_total} but the run has "
            f'--max-steps {max_steps}. Set it to "auto" (Anneal fills it in from --max-steps).'
        )
    sched["total_num_steps"] = max_steps
    notes["scheduler.params.total_num_steps"] = f"{max_steps} (--max-steps)"
    if sched.get("warmup_num_steps", AUTO) == AUTO:
        warm = warmup_steps(optim=optim, tokens_per_step=tokens_per_step, max_steps=max_steps)
        if resumed_warmup is not None and resumed_warmup != warm:
            # The "auto" warmup depends on --max-steps; the steps taken so far used this one.
            # (The same value keeps the same note, so a plain relaunch finds no difference.)
            sched["warmup_num_steps"] = min(resumed_warmup, max_steps)
            notes["scheduler.params.warmup_num_steps"] = (
                f"{sched['warmup_num_steps']} (auto, kept from the run being resumed; --set "
                f"ds.scheduler.params.warmup_num_steps=N changes it)"
            )
            return
        sched["warmup_num_steps"] = warm
        notes["scheduler.params.warmup_num_steps"] = (
            f"{sched['warmup_num_steps']} (auto: min(ceil({optim.warmup_tokens:,} warmup tokens "
            f"/ {tokens_per_step:,} per step), {optim.warmup_max_share:g} x {max_steps} steps))"
        )
        return
    for field in ("warmup_tokens", "warmup_max_share"):
        run.explicit("scheduler.params.warmup_num_steps", field)
    warm = sched["warmup_num_steps"]
    if warm > max_steps:
        raise UserError(
            f"{source}: scheduler.params.warmup_num_steps ({warm}) exceeds --max-steps "
            f"({max_steps}), so the run would end before the LR reaches its peak. Set "
            f'warmup_num_steps to "auto" (the recipe\'s warmup, capped at '
            f"{optim.warmup_max_share:g} of the run), lower it with --set "
            f"ds.scheduler.params.warmup_num_steps=N, or raise --max-steps."
        )
    notes["scheduler.params.warmup_num_steps"] = f"{warm} (ds_config)"


def resolve_ds_config(
    cfg: dict,
    *,
    source: str,
    data_parallel_size: int,
    max_steps: int,
    seq_len: int,
    optim: OptimConfig,
    optim_set: frozenset[str] = frozenset(),
    resumed_warmup: int | None = None,
) -> tuple[dict, Notes]:
    """Fill the ``"auto"`` values from the run and check the batch arithmetic.

    ``optim_set`` names the ``optim.*`` keys given with ``--set``: such a key beside an explicit
    number in the file would have no effect, which is an error rather than a surprise.
    ``resumed_warmup``: the resolved warmup of the run this launch resumes, kept for an
    ``"auto"`` warmup. Returns the resolved copy and, for each run-dependent key, a note saying
    where its value came from (``Notes``, with the messages to log at start).
    """
    cfg = json.loads(json.dumps(cfg))
    notes = Notes()
    run = _Run(source=source, optim=optim, optim_set=frozenset(optim_set))
    batch = _resolve_batch(cfg, notes, run, data_parallel_size=data_parallel_size, seq_len=seq_len)
    _resolve_lr(cfg, notes, run)
    resolve_optimizer(cfg, notes, optim=optim, source=source)
    _resolve_schedule(
        cfg,
        notes,
        run,
        max_steps=max_steps,
        tokens_per_step=batch.train_batch_size * seq_len,
        resumed_warmup=resumed_warmup,
    )
    _resolve_floor(cfg["scheduler"]["params"], notes, run)
    return cfg, notes
