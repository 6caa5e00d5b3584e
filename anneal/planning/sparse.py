"""A sparse model in the plan: how ``anneal plan --model`` reads Chinchilla for a Mixture of
Experts.

Chinchilla's law (``anneal.planning.law``) was fitted to dense models, whose tokens run through
all of their parameters. A sparse model's token runs through its *active* parameters only
(``top_k`` of each layer's experts), so its training compute is ``6 N_active D``, the same
count as its FLOPs per token and MFU (``anneal.model.flops_per_token``). Anneal plans it that
way: N is the active count, the tokens are read against it (tokens per parameter, the rule's
``D = R N``), and FLOPs, steps and GPU-hours follow. The loss the law then prints is that of a
*dense* model of N_active parameters on the same tokens and compute: a dense baseline, not a
prediction for the sparse model. Anneal carries no law for sparse models and invents none; the
studies that fit one add terms for the experts and report the sparse model ahead of the dense:

- Clark et al. 2022, "Unified Scaling Laws for Routed Language Models" (arXiv 2202.01169),
  abstract: "parameter count and computational requirement form two independent axes along
  which an increase leads to better performance".
- Krajewski et al. 2024, "Scaling Laws for Fine-Grained Mixture of Experts" (arXiv
  2402.07871), abstract: "MoE models consistently outperform dense Transformers".
- Ludziejewski et al. 2025, "Joint MoE Scaling Laws" (arXiv 2502.05172), abstract: "joint
  scaling laws for dense and MoE models, incorporating key factors such as the number of
  active parameters, dataset size, and the number of experts".

Memory is another matter: every expert is held somewhere, so ``anneal estimate`` counts a
sparse model's total parameters (docs/planning.md).
"""

from __future__ import annotations

import dataclasses

from anneal.errors import UserError

NOTE = (
    "  note           a sparse model: N, tokens per parameter, FLOPs (6 N D) and GPU-hours "
    "count its active\n"
    "                 parameters, as its FLOPs per token and MFU do. The predicted loss is the "
    "dense law's\n"
    "                 at N = active parameters: a dense baseline of equal compute, not the "
    "sparse model's\n"
    "                 (Anneal has no sparse law; Clark et al. 2022, arXiv 2202.01169, and "
    "Krajewski et al.\n"
    "                 2024, arXiv 2402.07871, fit ones with terms for the experts). Memory "
    "counts all its\n"
    "                 parameters: `anneal estimate --model {name} --ep N`."
)
"""What ``anneal plan`` prints under a sparse model's plan (the module docstring says why)."""


@dataclasses.dataclass(frozen=True)
class PlannedModel:
    name: str
    params: int
    """N of the plan: the active parameters (all of a dense model's)."""
    total: int
    """All parameters, what memory holds."""


def planned_model(name: str) -> PlannedModel:
    """The preset ``anneal plan --model NAME`` plans: N is its active parameters, embeddings
    included, as Hoffmann et al. count N (a dense preset's active parameters are all of them)."""
    from anneal.model import PRESETS, active_params, count_params

    if name not in PRESETS:
        raise UserError(f"--model {name}: not a preset; give one of {', '.join(PRESETS)}.")
    preset = PRESETS[name]
    return PlannedModel(name=name, params=active_params(preset), total=count_params(preset))
