"""Anneal's engine as an lm-evaluation-harness model: ``EngineLM``, scoring as lm-eval's ``HFLM``
scores the exported model, on every rank in lockstep.

What lm-eval sees: one model on rank 0 of a world of 1. Every rank of the job builds the same
request list (the same tasks, documents and prompts), so every rank holds the same batches in
the same order. What happens under it: each batch holds ``batch_size`` rows per data-parallel
replica; replica ``r`` of ``n`` runs rows ``r, r + n, r + 2n, ...`` of it (rows sorted by length,
so each replica's share is about as long as the others'), the ranks of one tensor-parallel group
(one replica) run the same rows, and a replica left without a row in the last batch runs a
one-token row and drops its result. Every rank therefore calls the engine's forward once per
batch, the same number of times, which ZeRO-3 (its parameter gathers) and AutoTP (its
all-reduces) need: lm-eval's own multi-rank mode evens out requests, not forward calls, and
hangs there. The answers are all-gathered once per request list, so every rank returns them all.

Tokens, truncation and the scored slice are ``HFLM``'s (lm_eval/models/huggingface.py, 0.4.13):
the tokenizer is the Hugging Face one that every prepared directory and every export carries,
loaded from its files (no remote code); ``tok_encode`` passes ``add_special_tokens`` as HFLM
does (the tokenizer's own default; Anneal's tokenizers add no BOS), the prefix of an empty
context is BOS, or EOS where the tokenizer has no BOS (Anneal's); a row is
``(context + continuation)[-(max_length + 1):][:-1]``, right-padded, its continuation's
log-probabilities summed and ``is_greedy`` whether each continuation token is the argmax.
Requests that share ``context + continuation[:-1]`` share one forward row, as HFLM's
``logits_cache`` does (a multiple-choice question with one-token answers costs one row); each
request's log-probability is read from the last positions of that row, which predict its
continuation. HFLM 0.4.13 reads the first ones, which differs where a group's continuations
differ in length (two rolling windows whose tokens agree); there EngineLM gives what HFLM gives
with ``logits_cache=False`` (tests/eval/test_eval_lm.py). Log-softmax is taken in fp32 whatever the
engine computes in (HFLM takes it in the model's dtype).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, has_bos_prefix

from anneal.dist import rank
from anneal.errors import UserError


def unsupported_layout(tensor_parallel: int, sequence_parallel: int) -> str | None:
    """Why downstream evaluation cannot run on this parallel layout (one paragraph), or None.
    Tensor parallelism is supported (the ranks of a group run the same rows); Ulysses sequence
    parallelism is not."""
    del tensor_parallel  # every tensor-parallel degree works
    if sequence_parallel <= 1:
        return None
    return (
        f"downstream evaluation does not run under sequence parallelism "
        f"(ds.sequence_parallel_size={sequence_parallel}): DeepSpeed's Ulysses attention is "
        f"registered for one fixed batch shape (micro-batch x seq_len, every rank holding "
        f"1/{sequence_parallel} of each sequence), while lm-eval's requests come in rows of "
        f"every length, which would have to be padded to the full context and split across "
        f"the group. Train with sequence parallelism and no train.eval_tasks, then evaluate "
        f"its checkpoints with `anneal eval RUN --tasks ...` (or `--watch` beside the run), "
        f"which loads them at ds.sequence_parallel_size=1."
    )


def load_tokenizer(tokenizer_dir: Path):
    """The Hugging Face tokenizer in ``tokenizer_dir`` (tokenizer.json and its config, as every
    prepared directory and export holds), as HFLM loads it from the export: AutoTokenizer,
    never running the directory's own code (a class named only in its ``auto_map`` is a
    UserError)."""
    from transformers import AutoTokenizer

    from anneal.data.tokenizer_hf import remote_code_refused

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise UserError(
            f"{tokenizer_dir}: no tokenizer.json, which downstream evaluation reads to tokenize "
            f"as lm-eval's HFLM does. A directory prepared by `anneal data prepare` or written "
            f"by `anneal export` has one; prepare the data again with this Anneal."
        )
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    except (ValueError, OSError) as e:  # a class only in auto_map: one paragraph, nothing run
        refused = remote_code_refused(str(tokenizer_dir), e)
        if refused is None:
            raise
        raise refused from None


class EngineLM(TemplateLM):
    """A DeepSpeed engine (a causal LM whose forward returns ``.logits``) as an lm-eval model.

    ``replica``: (this rank's data-parallel replica index, the number of replicas), as
    ``anneal.train.engine.data_replica`` gives it; ``batch_size``: rows per forward call per
    replica; ``max_length``: the longest row (the model's context). ``tokens_scored`` counts
    the real (unpadded) tokens of every replica's forward rows, ``forward_s`` this rank's
    seconds in forward calls, ``forward_calls`` this rank's calls (equal on every rank)."""

    def __init__(
        self,
        engine,
        tokenizer_dir: Path,
        *,
        replica: tuple[int, int],
        batch_size: int,
        max_length: int,
    ) -> None:
        super().__init__()
        # a caller refuses it before launch (unsupported_layout); this is the last guard
        if why := unsupported_layout(1, getattr(engine, "sequence_parallel_size", 1)):
            raise UserError(why)
        if batch_size < 1 or max_length < 2:
            raise UserError(
                f"batch size {batch_size} and context {max_length}: downstream evaluation needs "
                f"at least 1 row per forward call and a context of 2 tokens; give --batch-size "
                f"1 or more (or train.eval_tasks on a micro-batch of at least 1)."
            )
        self.engine = engine
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.replica = replica
        self.batch_size = batch_size
        self.max_length = max_length
        self.tokens_scored = 0
        self.forward_s = 0.0
        self.forward_calls = 0

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """HFLM's: BOS, or EOS where the tokenizer has none."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        """HFLM's ``tok_encode``: the tokenizer's default special tokens unless told, none
        where the string already starts with the prefix token."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode(self.prefix_token_id)
        ):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM's (tokenize each pair as HFLM does, then ``_loglikelihood_tokens``), its
        "Tokenizing inputs" bar on the job's first rank only, and not where ``TQDM_DISABLE`` is
        set (``anneal/__init__`` sets it where stderr is not a terminal): lm-eval passes
        ``disable=`` to that bar itself, which tqdm's default from the environment does not
        override, so in a log it was a line of carriage returns."""
        quiet = disable_tqdm or rank() != 0 or bool(os.environ.get("TQDM_DISABLE"))
        return super().loglikelihood(requests, disable_tqdm=quiet)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's total log-likelihood over HFLM's disjoint rolling windows of
        ``max_length`` tokens (the first predicted from the prefix token)."""
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for window in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            ):
                windows.append((None, *lm_utils.make_disjoint_window(window)))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError(
            "Anneal's evaluation scores loglikelihood tasks only (multiple choice, cloze, "
            "rolling perplexity); generation tasks (generate_until) are out of scope."
        )

    def _loglikelihood_tokens(
        self, requests: list, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether it is the greedy one) for each
        ``(strings, context_ids, continuation_ids)``, in request order, on every rank."""
        order = Collator(
            requests,
            sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
            group_by="contexts",
            group_fn=lambda r: r[-2] + r[-1][:-1],
        )
        dp_rank, dp_size = self.replica
        mine: dict[int, list[tuple[float, bool]]] = {}  # global row index -> its answers
        pending: dict[int, list[torch.Tensor]] = {}  # this batch's, still on the device
        counts: list[int] = []  # answers per row, every row in order
        training = _module(self.engine).training  # DeepSpeed's eval() sets only its module's
        self.engine.eval()
        try:
            for batch in order.get_batched(n=self.batch_size * dp_size):
                first = len(counts)
                rows = [self._row(ctx, cont) for _, ctx, cont in batch]
                self.tokens_scored += sum(map(len, rows))
                # this replica's rows of the batch: r, r + n, ... (n replicas)
                own = {j: (rows[j], len(batch[j][2])) for j in range(dp_rank, len(batch), dp_size)}
                scored = self._forward(own)
                for j, (strings, ctx, cont) in enumerate(batch):
                    # this row's requests: the group that shares its context (HFLM's cache)
                    logprobs = scored.get(j)
                    group = order.get_cache(
                        req_str=strings, cxt_toks=ctx, cont_toks=cont, logits=_EMPTY
                    )
                    conts = [c for _, c, _ in group]
                    counts.append(len(conts))
                    if logprobs is not None:
                        pending[first + j] = [_answer(logprobs, c) for c in conts]
                mine |= _on_host(pending)  # one device-to-host copy per batch
                pending.clear()
        finally:
            self.engine.train(training)
        every = _gather(mine)
        answers = order.get_original([a for i in range(len(counts)) for a in every[i]])
        for (strings, _, _), answer in zip(requests, answers, strict=True):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return answers

    def _row(self, context: list[int], continuation: list[int]) -> list[int]:
        """HFLM's causal row: left-truncated to ``max_length + 1`` tokens, the last dropped."""
        if not continuation or len(continuation) > self.max_length:
            raise UserError(  # inside one task's scoring: recorded in its `failed`
                f"a request's continuation of {len(continuation)} tokens: nothing to score, or "
                f"more than the model's context of {self.max_length} (HFLM refuses it too); "
                f"fix the task's doc_to_target/doc_to_choice"
            )
        return (context + continuation)[-(self.max_length + 1) :][:-1]

    def _forward(self, rows: dict[int, tuple[list[int], int]]) -> dict[int, torch.Tensor]:
        """One forward call over right-padded rows ``{key: (ids, n)}``: {key: the fp32
        log-probabilities (n, V) of the row's last n positions}. No rows: one one-token row,
        whose result is dropped (the call keeps the ranks in step)."""
        batch = list(rows.values()) or [([self.prefix_token_id], 1)]
        width = max(len(ids) for ids, _ in batch)
        x = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long)
        for i, (ids, _) in enumerate(batch):
            x[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        start = time.perf_counter()
        with torch.no_grad():
            logits = self.engine(input_ids=x.to(self.engine.device)).logits  # (B, T, V)
            out = {
                key: F.log_softmax(logits[i, len(ids) - n : len(ids)].float(), dim=-1)
                for i, (key, (ids, n)) in enumerate(rows.items())
            }
        self.forward_s += time.perf_counter() - start
        self.forward_calls += 1
        return out


_EMPTY = torch.empty(1, 0, 0)
"""What ``Collator.get_cache`` is given for logits: it only repeats them per request of a group,
and the answers are computed from the row's own log-probabilities."""


def _module(engine):
    """The model a DeepSpeed engine wraps (whose ``training`` flag ``eval()`` and ``train()``
    set), or the model itself."""
    return getattr(engine, "module", engine)


def _answer(logprobs: torch.Tensor, continuation: list[int]) -> torch.Tensor:
    """(summed log-probability, 1.0 if greedy else 0.0) of ``continuation``, on the device, from
    the (L, V) log-probabilities of a row's last L positions, L >= len(continuation) (the
    longest continuation of the row's group): its last ``len(continuation)`` positions predict
    it (HFLM's greedy check reads these; its log-probability, the first ones, the same where
    the group's continuations have one length, as a multiple-choice question's do)."""
    scored = logprobs[-len(continuation) :]
    target = torch.tensor(continuation, dtype=torch.long, device=scored.device)
    # max's indices are argmax's (the first of tied maxima) and take half its time on CPU
    greedy = (scored.max(dim=-1).indices == target).all()
    return torch.stack([scored.gather(1, target[:, None]).sum(), greedy.float()])


def _on_host(pending: dict[int, list[torch.Tensor]]) -> dict[int, list[tuple[float, bool]]]:
    """``_answer``'s tensors as (log-probability, greedy) pairs, read in one copy."""
    if not pending:
        return {}
    values = torch.stack([a for answers in pending.values() for a in answers]).tolist()
    out, at = {}, 0
    for row, answers in pending.items():
        out[row] = [(lp, greedy > 0) for lp, greedy in values[at : at + len(answers)]]
        at += len(answers)
    return out


def _gather(mine: dict[int, list]) -> dict[int, list]:
    """Every replica's answers by global row index, on every rank (one all-gather of
    objects); the ranks of a tensor-parallel group hold the same rows and agree."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    every: dict[int, list] = {}
    for part in parts:
        every.update(part)
    return every
