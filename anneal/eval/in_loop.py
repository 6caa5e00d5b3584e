"""Downstream tasks scored inside the training loop (``train.eval_tasks``): refused before
launch where they cannot run, loaded once at the start, scored when due.

Every rank loads the same tasks and scores them in lockstep (``anneal.eval.lm.EngineLM``), so
the set of tasks must be the same on every rank: one that loaded on some ranks only is dropped
everywhere. A task that fails to load or to score is never fatal: it becomes an
``eval_failed`` event (``task``, ``error``) through the run's observers and a warning, and
training goes on. Scoring changes no weight, no optimizer state, no RNG stream and no data
position (``anneal.eval.score.score`` restores the RNG states it found and the engine's mode).
"""

from __future__ import annotations

from pathlib import Path

from anneal import rundir
from anneal.dist import all_gather, barrier, print0, rank
from anneal.errors import UserError
from anneal.files import real_dir

TOKENS_PER_ITEM = 213
"""Forward tokens per task item in the forecast, all its choices together: the issue's 0-shot
core set (HellaSwag, ARC-Easy, PIQA, Winogrande, LAMBADA) is about 4.4M tokens over its
20,676 items (the datasets' published sizes). Coarse: items differ in length."""
ITEMS_PER_TASK = 4_135
"""Items of one task without ``train.eval_tasks_limit``, for the forecast: the core set's
20,676 items over its 5 tasks."""


def check_launch(launch) -> None:
    """Before anything starts (the launcher's pre-flight and every rank): ``train.eval_tasks``
    on a layout the evaluator cannot run in lockstep, and task specs that cannot load
    (``anneal.eval.tasks.check_specs``), are one paragraph each (UserError); each task YAML
    that runs Python is said (rank 0)."""
    specs = launch.cfg.train.eval_tasks
    if not specs:
        return
    from anneal.eval.lm import unsupported_layout

    layout = launch.layout
    why = unsupported_layout(layout.tensor_parallel, layout.sequence_parallel)
    if why is not None:
        raise UserError(
            f"train.eval_tasks ({', '.join(specs)}) on {layout.describe()}: {why}",
            every_rank=True,
        )
    from anneal.eval.tasks import check_specs

    try:
        notes = check_specs(specs)
    except UserError as e:  # the same on every rank, so said once
        raise UserError(f"train.eval_tasks: {e}", every_rank=True) from None
    for note in notes:  # a task YAML that runs Python
        print0(f"train.eval_tasks: {note}")


def passes(*, start_step: int, max_steps: int, every: int) -> int:
    """Scorings in the loop from ``start_step`` up to ``max_steps``: the baseline before the
    first step of a run from step 0, then each multiple of ``every`` (0: none) after
    ``start_step`` and the last step."""
    if max_steps <= start_step:
        return 0
    multiples = max_steps // every - start_step // every if every > 0 else 0
    return (start_step == 0) + multiples + (every <= 0 or max_steps % every != 0)


def forecast_tokens(train, *, start_step: int) -> int:
    """Forward tokens of all the scorings left in the run (``train``: its TrainConfig), at
    ``TOKENS_PER_ITEM`` per item; 0 without tasks."""
    if not train.eval_tasks:
        return 0
    items = train.eval_tasks_limit or ITEMS_PER_TASK
    n = passes(start_step=start_step, max_steps=train.max_steps, every=train.eval_tasks_every)
    return n * len(train.eval_tasks) * items * TOKENS_PER_ITEM


class InLoop:
    """The model as lm-eval sees it and the loaded tasks, held for the whole run; ``score``
    scores them all at one step and returns the results document
    (``anneal.eval.results``)."""

    def __init__(self, lm, loaded, *, limit: int | None, events):
        self.lm, self.loaded, self.limit, self.events = lm, loaded, limit, events

    @classmethod
    def open(cls, launch, engine, *, replica: tuple[int, int], step: int, events) -> InLoop:
        """Build the adapter once and load the tasks once (rank 0 first: the shipped task is
        built under ``RUN/evals/tasks``, which the others then read); a task that did not load
        on every rank is an ``eval_failed`` event at ``step``."""
        from anneal.eval.lm import EngineLM
        from anneal.eval.score import rng_restored
        from anneal.eval.tasks import load_tasks

        train = launch.cfg.train
        lm = EngineLM(
            engine,
            Path(launch.cfg.data.path),
            replica=replica,
            batch_size=launch.micro_batch,
            max_length=launch.seq_len,
        )

        def load():  # lm-eval's TaskManager draws from python's generator: put it back
            with rng_restored():
                return load_tasks(
                    train.eval_tasks,
                    data_dir=Path(launch.cfg.data.path),
                    work_dir=real_dir(launch.out, rundir.EVALS, "tasks"),  # never a link
                    num_fewshot=None,
                    limit=train.eval_tasks_limit or None,
                )

        loaded = load() if rank() == 0 else None
        barrier()
        loaded = loaded if rank() == 0 else load()
        _agree(loaded)
        self = cls(lm, loaded, limit=train.eval_tasks_limit or None, events=events)
        self._failed(step, loaded.failed)
        return self

    def score(self, *, step: int, tokens: int) -> dict:
        """Every task scored at ``step`` (on every rank, in lockstep); a task that raised is in
        the document's ``failed`` (with those that did not load) and told as an
        ``eval_failed`` event."""
        from anneal.eval.score import score

        doc = score(
            self.lm,
            self.loaded,
            step=step,
            tokens=tokens,
            limit=self.limit,
            num_fewshot=None,
            source="loop",
        )
        new = {t: e for t, e in doc.get("failed", {}).items() if t not in self.loaded.failed}
        self._failed(step, new)
        doc["failed"] = {**self.loaded.failed, **new}  # the document says what did not score
        return doc

    def _failed(self, step: int, failed: dict[str, str]) -> None:
        """Each failure an ``eval_failed`` event (``load_tasks`` and ``score`` log the warning)."""
        for task, error in sorted(failed.items()):
            self.events.on_event(step, "eval_failed", task=task, error=error)


def _agree(loaded) -> None:
    """Keep the tasks that loaded on every rank (lockstep needs the same request lists); the
    others go to ``loaded.failed``."""
    names = all_gather(sorted(loaded.tasks))
    everywhere = set.intersection(*map(set, names))
    for task in sorted(set(loaded.tasks) - everywhere):
        missing = [r for r, have in enumerate(names) if task not in have]
        loaded.tasks.pop(task)
        loaded.failed[task] = f"did not load on rank(s) {missing}, so no rank scores it"
