"""Float8 training (``train.float8``; docs/throughput.md): torchao's ``Float8Linear`` swapped in
for the Linear layers ``anneal.model.float8_rule`` picks, on the Hugging Face model before
``deepspeed.initialize``, as accelerate does for DeepSpeed. DeepSpeed sees ordinary modules
with ordinary parameters (a ``Float8Linear`` keeps its weight in the run's precision and casts
it, and its input, to float8 in each forward), so ZeRO-1/2/3 partition, reduce, save and load
them as before, under the same names: a checkpoint and its export hold plain Linear weights.
ZeRO-3 gathers the weights in the run's precision (torchao's float8 all-gather is FSDP2's)."""

from __future__ import annotations

import logging
import sys

from torch import nn

from anneal.model.float8_rule import Float8Choice, LinearShape, choose_float8

log = logging.getLogger(__name__)


def linear_shapes(model: nn.Module) -> list[LinearShape]:
    """Every ``nn.Linear`` of ``model`` in module order, with its shape from ``in_features`` and
    ``out_features`` (under ZeRO-3 the weight itself is a 1-D shard)."""
    return [
        LinearShape(name, m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]


def import_torchao() -> None:
    """Make torchao importable in this process: ``import anneal`` hides it (a None in
    ``sys.modules``) from every process that does not train in float8 (anneal/__init__.py)."""
    if "torchao" in sys.modules and sys.modules["torchao"] is None:
        del sys.modules["torchao"]


def convert_float8(model: nn.Module, *, recipe: str, layers: str) -> Float8Choice:
    """Swap the chosen Linear layers of ``model`` for torchao's ``Float8Linear`` with
    ``recipe``'s scaling (tensorwise | rowwise), in place; the choice, which the caller logs."""
    import_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    choice = choose_float8(linear_shapes(model), recipe=recipe, layers=layers)
    chosen = set(choice.converted)
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda _module, name: name in chosen,
    )
    return choice


def float8_layer_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s modules that compute in float8 (``Float8Linear``)."""
    import_torchao()
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
