"""Sparse models in the loop: DeepSpeed's AutoEP at engine start, the router's two losses, and
the balance of each step (docs/training.md, "Mixture of Experts").

The objective of a micro-batch is the language-model loss plus ``aux_loss_coef`` x the router's
load-balancing loss (transformers' Qwen3-MoE ``load_balancing_loss_func`` over all layers: Switch
Transformer's ``E * sum_i f_i * P_i``, which is top-k when the routing is uniform) plus
``z_loss_coef`` x the router z-loss (ST-MoE: the mean over layers and tokens of the squared
log-sum-exp of the router logits). The train row's ``loss`` stays the language-model loss, so the
console, the plots and the spike guard read what they read for a dense model; the two router
losses and the balance ride beside it (``RouterStats.row``).

The load is counted by AutoEP itself: each ``AutoEPMoELayer`` adds the tokens its router sent to
each expert to a ``tokens_per_expert`` buffer on every forward. The buffers are read after each
training forward and zeroed before the next, so validation, downstream scoring and the
recomputation of activation checkpointing never count.
"""

from __future__ import annotations

import contextlib
import math

import torch

LAYER_CLASS = "AutoEPMoELayer"


@contextlib.contextmanager
def autoep_registry_fix():
    """Run ``deepspeed.initialize`` of an AutoEP engine against transformers 5.24.

    DeepSpeed 0.19.8's AutoEP retargets transformers' ``router_logits`` recorder to its own
    layer through ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY``, treating it as
    the plain dict it was: ``registry.get(class_key, default)`` and ``registry[class_key] =
    entry``, with the key a class name string. In transformers 5.24 the registry is a
    ``_CanRecordRegistry`` whose ``get(model)`` takes one argument and whose ``__setitem__`` keys
    by ``str(model.__class__)``, so AutoEP fails with "get() takes 2 positional arguments but 3
    were given" (bench/autoep_registry_repro.py reproduces it). For the length of the call,
    a string key reads and writes the dict as a dict; a model, as transformers does."""
    from transformers.utils import output_capturing

    cls = output_capturing._CanRecordRegistry
    get, setitem = cls.get, cls.__setitem__

    def get_by_key(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else get(self, key)

    def set_by_key(self, key, value):
        return (
            dict.__setitem__(self, key, value)
            if isinstance(key, str)
            else setitem(self, key, value)
        )

    cls.get, cls.__setitem__ = get_by_key, set_by_key
    try:
        yield
    finally:
        cls.get, cls.__setitem__ = get, setitem


def expert_layers(module) -> list:
    """The AutoEP layers of an engine's module, in layer order (empty for a dense model)."""
    return [m for m in module.modules() if type(m).__name__ == LAYER_CLASS]


class RouterStats:
    """What the router did over one optimizer step on this rank, kept on the device until the
    step's one collective: sums of the aux loss, the z-loss and each layer's router entropy over
    the micro-batches, and each layer's token counts per expert."""

    def __init__(self, layers: list, *, aux_coef: float, z_coef: float):
        self.layers, self.aux_coef, self.z_coef = layers, aux_coef, z_coef
        device = layers[0].tokens_per_expert.device
        n_layers, n_experts = len(layers), layers[0].tokens_per_expert.numel()
        self.sums = torch.zeros(2 + n_layers, dtype=torch.float64, device=device)
        self.counts = torch.zeros(n_layers, n_experts, dtype=torch.float64, device=device)
        self.micro = 0

    @classmethod
    def of(cls, engine, moe) -> RouterStats | None:
        """The statistics of ``engine``'s step for the sparse shape ``moe``; None for a dense
        model."""
        layers = expert_layers(engine.module)
        if moe is None or not layers:
            return None
        return cls(layers, aux_coef=moe.aux_loss_coef, z_coef=moe.z_loss_coef)

    def before_forward(self) -> None:
        for layer in self.layers:
            layer.tokens_per_expert.zero_()

    def objective(self, output, lm_loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's objective from the model's output (its ``aux_loss`` and
        ``router_logits``, one (tokens, experts) tensor per layer) and the language-model
        loss; records the router's losses, entropy and counts."""
        logits = [g.float() for g in output.router_logits]
        aux = output.aux_loss
        z = torch.stack([torch.logsumexp(g, dim=-1).square().mean() for g in logits]).mean()
        with torch.no_grad():
            entropy = [_entropy(g) for g in logits]
            self.sums += torch.stack([aux.detach().double(), z.detach().double(), *entropy])
            self.counts += torch.stack([layer.tokens_per_expert for layer in self.layers]).double()
        self.micro += 1
        return lm_loss + self.aux_coef * aux + self.z_coef * z

    def vector(self) -> torch.Tensor:
        """This rank's sums and counts, flat, for the step's collective (summed over ranks)."""
        return torch.cat([self.sums, self.counts.flatten()])

    def row(self, summed: list[float], ranks: int) -> dict:
        """The train row's router fields from ``vector()`` summed over ``ranks`` ranks."""
        n_layers, n_experts = self.counts.shape
        means = [v / (ranks * self.micro) for v in summed[: 2 + n_layers]]
        flat = summed[2 + n_layers :]
        counts = [
            [round(c) for c in flat[i * n_experts : (i + 1) * n_experts]] for i in range(n_layers)
        ]
        return {
            "aux_loss": means[0],
            "z_loss": means[1],
            "moe_max_mean": [_max_over_mean(c) for c in counts],
            "moe_entropy": means[2:],
            "moe_counts": counts,
        }


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the entropy (nats) of the router's softmax over all experts."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1).mean().double()


def _max_over_mean(counts: list[int]) -> float:
    """The busiest expert's load over the mean load (1.0: uniform; E: one expert takes all)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else math.nan
