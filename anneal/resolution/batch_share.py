"""The global batch against the train split: a step that is a large share of the data.

A recipe's batch is sized for its cluster and a corpus of billions of tokens (the
continued-pretraining recipe: 4M tokens a step). On a small corpus of one's own the same batch
passes over the whole data in a few steps, or several times in one, and on CPU one such step
takes minutes, without a word. So, once the launch is resolved (its batch, its data):

- one step more than the whole train split is refused: each step would see every token more
  than once, which no schedule means;
- one step more than ``WARN_SHARE`` of it (a pass over the data every 10 steps or fewer) is a
  line in the launch's notes, with the numbers;

each with the ``--set`` that gives a batch of about a hundredth of the split
(``suggested_tokens``): ``optim.global_batch_tokens`` where the recipe's batch came from it,
``ds.gradient_accumulation_steps`` where the ds_config fixed the batch.
"""

from __future__ import annotations

from pathlib import Path

from anneal.errors import UserError

WARN_SHARE = 0.1
"""A step above this share of the train split (a pass every 10 steps or fewer) is announced."""
SUGGESTED_SHARE = 0.01
"""The batch the fix suggests: about this share of the split, a pass every 100 steps."""


def check_batch_share(launch) -> None:
    """UserError when one optimizer step of ``launch`` (``anneal.resolution.resolve.Launch``)
    holds more tokens than its train split; a note in ``launch.notes`` when it holds more
    than ``WARN_SHARE`` of it. Pure: the launcher's pre-flight and every rank run it alike."""
    split = int(launch.meta["splits"]["train"]["tokens"])
    step = launch.tokens_per_step
    if split <= 0 or step * 1.0 <= WARN_SHARE * split:
        return
    data = Path(launch.cfg.data.path)
    ds = launch.ds_config
    shape = (
        f"{ds['train_batch_size']:,} sequences of {launch.seq_len} tokens: micro-batch "
        f"{launch.micro_batch} x {launch.grad_accum} accumulation steps x "
        f"{launch.layout.data_parallel} data-parallel ranks"
    )
    fix = _fix(launch, split)
    if step > split:
        raise UserError(
            f"--data {data}: one optimizer step is {step:,} tokens ({shape}), more than the whole "
            f"train split ({split:,} tokens), so every step would pass over the data "
            f"{step / split:.1f} times. {fix}, or prepare more data.",
            every_rank=True,
        )
    steps = launch.cfg.train.max_steps
    launch.notes.append(
        f"one optimizer step is {step:,} tokens ({shape}), {step / split:.0%} of the train split "
        f"of --data {data} ({split:,} tokens): a pass over the data every {split / step:.1f} "
        f"steps, {steps * step / split:,.1f} passes in {steps} steps. {fix} if that is not meant."
    )


def suggested_tokens(split_tokens: int, *, least: int) -> int:
    """The power of two nearest below ``SUGGESTED_SHARE`` of the split, at least ``least``
    (one sequence on every data-parallel rank)."""
    want = max(1, int(split_tokens * SUGGESTED_SHARE))
    return max(least, 1 << (want.bit_length() - 1))


def _fix(launch, split: int) -> str:
    """The ``--set`` that gives a batch of about ``SUGGESTED_SHARE`` of the split."""
    per_micro = launch.micro_batch * launch.layout.data_parallel * launch.seq_len
    tokens = suggested_tokens(split, least=per_micro)
    # ds_resolve._resolve_batch: "... tokens / seq_len S" when the batch came from the run's
    # optim.global_batch_tokens, "ds_config" when the file fixed it
    if "/ seq_len" in str(launch.resolved_from.get("train_batch_size", "")):
        return (
            f"For about {tokens / split:.0%} of the split a step, give --set "
            f"optim.global_batch_tokens={tokens}"
        )
    accum = max(1, tokens // per_micro)
    fix = f"For a smaller batch, give --set ds.gradient_accumulation_steps={accum}"
    if accum == 1 and per_micro > WARN_SHARE * split:
        fix += " and a smaller ds.train_micro_batch_size_per_gpu"
    return fix
