"""The next-token loss without the full logits (docs/training.md, "The loss").

A (B, T, V) logits tensor and the fp32 log-softmax that cross-entropy keeps for backward are the
largest activations of a small-vocabulary model's step: 8.79 GiB per GPU for the 7b recipe at
micro-batch 4 x 4096 (``anneal estimate``). ``train.loss = "chunked"`` (the default) computes the
output projection and the cross-entropy ``chunk_tokens`` rows at a time, and the gradients of
both with them, inside the forward pass, as Liger's fused linear cross-entropy and torch's
``linear_cross_entropy`` do: at most one chunk's logits exist at any time, in the forward pass
and in the backward pass, and nothing is recomputed (checkpointed chunks, torchtitan's way, run
the head's forward matmul twice). On the CPU benchmark it holds 8x less than the plain loss and
its step takes 0.74x of plain's (docs/benchmarks.md). ``"plain"`` keeps the model's own
(B, T, V) logits.

Why the engine and not a wrapper: DeepSpeed's backward prologue (accumulation boundary, ZeRO's
reduction state) runs when the gradient reaches the engine's output, so every parameter's
gradient, the head's included, must flow through that output: the loss is computed inside the
model's forward.

How it reaches the head: ``install`` gives the model's output projection (an ``nn.Linear``
without bias, e.g. a Llama, Mistral or Qwen2 ``lm_head``, tied to the embedding or not) a
forward that, while ``targets(model, y)`` is open, returns the loss in place of the logits.
The step still calls the engine (so DeepSpeed's forward and backward hooks see the loss as the
model's output) and the model still calls its own ``lm_head`` module, so ZeRO-3 gathers the
partitioned head weight through its module hooks, once for the forward pass and once for the
backward pass, as it does for the plain head. A head this cannot read as a plain ``nn.Linear``
(AutoTP's vocabulary-sharded ``lm_head``, a biased head, Gemma's soft-capped logits) is left
alone, and the step falls back to the plain loss over the logits it returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
"""Targets equal to this carry no loss (``F.cross_entropy``'s default); Anneal's packed windows
have none, but a Hugging Face caller's labels may."""


@dataclasses.dataclass
class HeadLoss:
    """What an installed head computes on its next call: set by ``targets`` for one forward."""

    chunk_tokens: int
    targets: torch.Tensor | None = None
    per_token: bool = False


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, ``chunk`` rows at a time,
    with both gradients computed in forward. hidden (N, H), weight (V, H), targets (N,).

    Backward runs once (DeepSpeed's ``engine.backward`` does not retain the graph): it scales
    the gradients it kept in place."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        valid = targets != IGNORE_INDEX
        counted = valid.sum().to(torch.float32)  # the mean is over counted tokens
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if want_h else None
        # The head's gradient is summed over chunks in fp32, whatever the weight's precision.
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.size(0), chunk):
            h, t, ok = hidden[s : s + chunk], targets[s : s + chunk], valid[s : s + chunk]
            # (c, V): log-softmax and nll as F.cross_entropy computes them, so that one chunk
            # gives its loss to the bit; the fp32 logits are freed once it is taken.
            logp = F.linear(h, weight).float().log_softmax(-1)
            total += F.nll_loss(logp, t, reduction="sum", ignore_index=IGNORE_INDEX)
            if not (want_h or want_w):
                continue
            # d(mean nats)/d(logits) = (softmax - onehot) / counted, written over logp.
            probs = logp.exp_()
            probs[torch.arange(t.numel(), device=t.device), t.clamp_min(0)] -= 1.0
            g = probs.mul_((ok / counted)[:, None]).to(weight.dtype)
            if want_h:
                grad_h[s : s + chunk] = g @ weight
            if want_w and g.dtype == torch.float32:
                grad_w.addmm_(g.t(), h)
            elif want_w:  # a 16-bit product per chunk, summed in fp32
                grad_w.add_(g.t() @ h)
        ctx.grads, ctx.weight_dtype = (grad_h, grad_w), weight.dtype
        return total / counted

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.grads
        ctx.grads = None  # released; a ``del`` would break torch.compile's graph here
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss.float()).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None


def chunked_nats(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Per-token nats (N,) of ``hidden @ weight.T`` against ``targets`` (0 where ignored),
    ``chunk`` rows at a time, without gradients: validation's loss."""
    out = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
    for s in range(0, hidden.size(0), chunk):
        logits = F.linear(hidden[s : s + chunk], weight).float()
        out[s : s + chunk] = F.cross_entropy(logits, targets[s : s + chunk], reduction="none")
    return out


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int
) -> torch.Tensor:
    """Mean next-token cross-entropy of hidden states (..., H) through a head weight (V, H)
    against targets (...), never holding more than ``chunk_tokens`` rows of logits; equal to
    ``F.cross_entropy(F.linear(hidden, weight).float().view(-1, V), targets.view(-1))``."""
    h, t = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, t, chunk_tokens)
    return chunked_nats(h, weight, t, chunk_tokens).sum() / (t != IGNORE_INDEX).sum()


def _head_forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """An installed head's forward: the logits, or, while ``targets`` is open, the loss (mean,
    0-d) or the per-token nats (B, T). ``self.weight`` is whole here, also under ZeRO-3."""
    job: HeadLoss = self.anneal_loss
    if job.targets is None:
        return F.linear(hidden, self.weight)
    if job.per_token:
        h, t = hidden.reshape(-1, hidden.size(-1)), job.targets.reshape(-1)
        return chunked_nats(h, self.weight, t, job.chunk_tokens).view(job.targets.shape)
    return linear_cross_entropy(hidden, self.weight, job.targets, chunk_tokens=job.chunk_tokens)


def install(model: nn.Module, *, chunk_tokens: int) -> bool:
    """Give ``model``'s output projection the chunked loss (see the module docstring). Returns
    False, leaving the model as it was, when the head is not a plain bias-free ``nn.Linear``
    or the model post-processes its logits (soft-capping)."""
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    if (
        type(head) is not nn.Linear
        or head.bias is not None
        or getattr(config, "final_logit_softcapping", None)
    ):
        return False
    head.anneal_loss = HeadLoss(chunk_tokens=chunk_tokens)
    head.forward = types.MethodType(_head_forward, head)
    return True


@contextlib.contextmanager
def targets(model: nn.Module, y: torch.Tensor, *, per_token: bool = False):
    """While open, an installed head returns the loss of ``y`` (per token: (B, T) nats) from
    the model's forward in place of the logits; a model without one is untouched."""
    job: HeadLoss | None = getattr(model.get_output_embeddings(), "anneal_loss", None)
    if job is None:
        yield
        return
    job.targets, job.per_token = y, per_token
    try:
        yield
    finally:
        job.targets, job.per_token = None, False


def next_token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32 from the model's output: the (B, T, V) logits of a plain head,
    or the mean an installed head already computed (0-d)."""
    if out.dim() == 0:
        return out
    return F.cross_entropy(out.float().reshape(-1, out.size(-1)), y.reshape(-1))


def token_nats(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, T) nats in fp32 from the model's output under ``targets(..., per_token=True)``: the
    nats an installed head computed, or cross-entropy over a plain head's (B, T, V) logits."""
    if out.dim() == y.dim():
        return out.float()
    return F.cross_entropy(out.float().transpose(1, 2), y, reduction="none")
