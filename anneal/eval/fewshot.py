"""The few-shot guard: Anneal never shows an item among its own demonstrations (lm-eval #4145).

Why lm-eval 0.4.13 leaks: ``ConfigurableTask.fewshot_context`` passes the evaluated document to
its sampler (which then drops it from the draw) only when ``fewshot_split == test_split``. The
demonstrations can come from the evaluated split in two other ways, and then the sampler is
given no document to drop:

- no ``fewshot_split``: ``fewshot_docs()`` falls back to the training, then the validation, then
  the test split, so a task that has only the split it evaluates draws from it;
- ``fewshot_split`` equal to ``validation_split`` on a task without a test split (it evaluates
  the validation split).

The sampler also drops the evaluated document by dict equality, which misses the same item
decoded twice when a field is NaN (NaN != NaN).

:func:`guard` acts on a task whose demonstrations come from the split it evaluates (resolved as
lm-eval resolves both): it wraps ``fewshot_context`` so that the sampler always knows the
evaluated document, and replaces the sampler by :class:`OwnItemExcluded`, which leaves out every
pool item equal to it or shown as the same demonstration (the same rendered question and
answer). For lm-eval's default sampler it draws exactly as lm-eval does when lm-eval is given
the document (``n + 1`` items, the evaluated one dropped), so where lm-eval was right the
prompts are unchanged; ``first_n`` keeps the first ``n`` others; any other sampler is given the
document, and a demonstration that is still the evaluated item fails the task instead of
leaking. A task whose demonstrations come from another split (or a fixed list) is left as is.
"""

from __future__ import annotations

from lm_eval.api.samplers import ContextSampler, FirstNSampler

from anneal.errors import UserError


def evaluated_split(config) -> str | None:
    """The split lm-eval evaluates: the test split, else the validation split."""
    return config.test_split or config.validation_split


def pool_split(task) -> str | None:
    """The split the task's demonstrations come from (``ConfigurableTask.fewshot_docs``): its
    ``fewshot_split``, else none for a fixed list of samples, else training > validation >
    test."""
    fewshot_cfg, config = task.fewshot_cfg, task.config
    if fewshot_cfg.split is not None:
        return fewshot_cfg.split
    if config.fewshot_config is not None and fewshot_cfg.samples is not None:
        return None
    return config.training_split or config.validation_split or config.test_split


def guard(task) -> bool:
    """Make ``task`` never show the evaluated item among its demonstrations. True when the
    guard was needed (the demonstrations come from the evaluated split) and installed."""
    sampler = getattr(task, "sampler", None)
    split = pool_split(task)
    if sampler is None or split is None or split != evaluated_split(task.config):
        return False
    if isinstance(sampler, OwnItemExcluded):
        return True
    guarded = OwnItemExcluded(task, sampler)
    task.sampler = guarded
    plain = task.fewshot_context

    def fewshot_context(doc, num_fewshot, *args, **kwargs):
        guarded.evaluated = doc
        try:
            return plain(doc, num_fewshot, *args, **kwargs)
        finally:
            guarded.evaluated = None

    task.fewshot_context = fewshot_context
    return True


class OwnItemExcluded(ContextSampler):
    """A sampler over the evaluated split that never returns the evaluated document, nor an
    item shown as the same demonstration."""

    def __init__(self, task, inner: ContextSampler):
        super().__init__(inner.df, rnd=None, fewshot_indices=inner.fewshot_indices)
        self.rnd = inner.rnd
        self._loaded = inner._loaded
        self.task = task
        self.inner = inner
        self.evaluated = None
        """The document whose prompt is being built (set by the guarded fewshot_context)."""
        self._shown: list | None = None  # the demonstration each pool item is shown as

    def set_rnd(self, rnd: int | None):
        self.inner.set_rnd(rnd)
        return super().set_rnd(rnd)

    def replace_df(self, df):
        self._shown = None
        self.inner.replace_df(df)
        return super().replace_df(df)

    def sample(self, n: int, eval_doc=None, df=None, **kwargs):
        doc = eval_doc if eval_doc is not None else self.evaluated
        if df:
            self.replace_df(df)
        if n == 0 or doc is None:
            return self.inner.sample(n, eval_doc=eval_doc, df=df, **kwargs)
        pool = self.fewshot_docs()
        shown = self._shown_pool(pool)
        own_shown = self._shown_as(doc, fewshot=False)

        def own(i: int) -> bool:
            return pool[i] == doc or (own_shown is not None and shown[i] == own_shown)

        if type(self.inner) is ContextSampler:
            drawn = self.rnd.sample(range(len(pool)), min(n + 1, len(pool)))
            keep = [i for i in drawn if not own(i)][:n]
            if len(keep) < n:  # duplicates of the item were drawn: draw from the others
                others = [i for i in range(len(pool)) if not own(i)]
                _enough(n, len(others))
                keep = self.rnd.sample(others, n)
            return [pool[i] for i in keep]
        if isinstance(self.inner, FirstNSampler):
            others = [i for i in range(len(pool)) if not own(i)]
            _enough(n, len(others))
            return [pool[i] for i in others[:n]]
        chosen = list(self.inner.sample(n, eval_doc=doc, **kwargs))
        if any(x == doc or self._shown_as(x, fewshot=True) == own_shown for x in chosen):
            raise RuntimeError(
                f"few-shot sampler {type(self.inner).__name__} of task "
                f"{self.task.config.task} showed the evaluated item among its own "
                f"demonstrations; Anneal refuses the task rather than score a leak"
            )
        return chosen

    def _shown_pool(self, pool: list) -> list:
        if self._shown is None or len(self._shown) != len(pool):
            self._shown = [self._shown_as(x, fewshot=True) for x in pool]
        return self._shown

    def _shown_as(self, doc, *, fewshot: bool):
        """(question, answer) as a demonstration of ``doc`` shows them (with the few-shot
        templates) or as the evaluated prompt asks and the gold answer reads (``fewshot``
        False); None when the templates cannot render it."""
        task, cfg = self.task, self.task.fewshot_cfg
        try:
            text = task.doc_to_text(doc, cfg.doc_to_text) if fewshot else task.doc_to_text(doc)
            to_choice = cfg.doc_to_choice if fewshot else task.config.doc_to_choice
            choices = None
            if to_choice is not None:
                choices = task.doc_to_choice(doc, to_choice) if fewshot else task.doc_to_choice(doc)
            target = (
                task.doc_to_target(doc, cfg.doc_to_target) if fewshot else task.doc_to_target(doc)
            )
        except Exception:
            return None
        if task.multiple_input and choices is not None and isinstance(text, int):
            text = choices[text]
        elif isinstance(target, int) and choices is not None and 0 <= target < len(choices):
            target = choices[target]
        return repr((text, target))


def _enough(n: int, available: int) -> None:
    if available < n:
        raise UserError(  # inside one task's prompts: recorded in its `failed`
            f"{n} few-shot demonstrations requested, but the pool holds only {available} "
            f"items besides the evaluated one; lower num_fewshot"
        )
