"""Which Linear layers train in float8 (``train.float8``; docs/throughput.md): the rule alone,
on names and shapes, so that the engine build (``anneal.train.float8``) applies it to the
model's modules and a test applies it to a preset's shape, and both agree.

A float8 matrix multiply pays for scaling its inputs (an amax, a cast) before it gains from
the faster units: small matrices lose. ``auto`` takes torchao's own thresholds (its
``_auto_filter_for_recipe``, measured on H100s: torchao/float8/README.md), keeps the first
Linear in high precision (accelerate's float8 DeepSpeed benchmark skips the first and the
last), and never converts the output head: the chunked loss (``anneal.train.loss``) reads the
head's weight itself, so a float8 head would not run in float8 anyway. ``all`` drops the size
thresholds and the first-layer rule, for tests at tiny shapes. The hardware needs both
dimensions divisible by 16, always."""

from __future__ import annotations

import dataclasses

from anneal.model.shape import ModelPreset

RECIPES = ("tensorwise", "rowwise")
LAYER_CHOICES = ("auto", "all")
OUTPUT_HEAD = "lm_head"
"""The output head's name in transformers' causal LMs (Llama, Qwen3-MoE)."""


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """One ``nn.Linear`` of the model, in module order: its qualified name and its
    ``(out_features, in_features)`` (the weight's shape; N x K in torchao's words)."""

    name: str
    out_features: int
    in_features: int


@dataclasses.dataclass(frozen=True)
class Float8Choice:
    """The rule's answer: the names converted, and each kept one with why."""

    converted: tuple[str, ...]
    kept: dict[str, str]

    def describe(self, recipe: str) -> str:
        """One line for the launch's log: how many went float8, which stayed and why."""
        why: dict[str, list[str]] = {}
        for name, reason in self.kept.items():
            why.setdefault(reason, []).append(name)
        kept = "; ".join(
            f"{reason}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for reason, names in why.items()
        )
        total = len(self.converted) + len(self.kept)
        return (
            f"float8 ({recipe}): {len(self.converted)} of {total} Linear layers in float8"
            + (f", e.g. {self.converted[0]}" if self.converted else "")
            + (f"; kept in high precision, {kept}" if kept else "")
        )


def sparse_refusal(preset: ModelPreset) -> str | None:
    """Why float8 does not train ``preset``, or None: a sparse model's experts are not Linear
    layers. The launch (``anneal.resolution.throughput``) and ``anneal estimate`` each put
    their own flag before it."""
    if not preset.is_moe:
        return None
    return (
        "its experts are fused tensors that AutoEP replaces, not Linear layers, so float8 would "
        "reach only the attention and the router, and a router in float8 is untested"
    )


def gains(shape: LinearShape, recipe: str) -> bool:
    """Whether a float8 matrix multiply of this shape is faster than bf16 on an H100, by
    torchao 0.18's thresholds for ``recipe`` (``_auto_filter_for_tensorwise`` /
    ``_auto_filter_for_rowwise``)."""
    n, k = shape.out_features, shape.in_features
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    if recipe == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")


def choose_float8(linears: list[LinearShape], *, recipe: str, layers: str) -> Float8Choice:
    """Which of ``linears`` (in module order) train in float8 under ``recipe`` with
    ``train.float8_layers`` = ``layers``."""
    if layers not in LAYER_CHOICES:
        raise ValueError(f"layers must be one of {LAYER_CHOICES}, got {layers!r}")
    converted, kept = [], {}
    first = linears[0].name if linears else None
    for shape in linears:
        if shape.name.split(".")[-1] == OUTPUT_HEAD:
            kept[shape.name] = "the output head"
        elif shape.out_features % 16 or shape.in_features % 16:
            kept[shape.name] = "a dimension not divisible by 16"
        elif layers == "auto" and shape.name == first:
            kept[shape.name] = "the first Linear"
        elif layers == "auto" and not gains(shape, recipe):
            kept[shape.name] = "too small to gain (train.float8_layers=all converts it)"
        else:
            converted.append(shape.name)
    return Float8Choice(tuple(converted), kept)


def dense_linear_shapes(preset: ModelPreset) -> list[LinearShape]:
    """The ``nn.Linear`` layers of a dense preset's LlamaForCausalLM, in module order (as
    ``named_modules`` lists them), from its shape alone: the launch names the float8 layers
    before any model exists."""
    hidden, inter = preset.hidden_size, preset.intermediate_size
    q, kv = (
        preset.num_attention_heads * preset.head_dim,
        preset.num_key_value_heads * preset.head_dim,
    )
    per_layer = [
        ("self_attn.q_proj", q, hidden),
        ("self_attn.k_proj", kv, hidden),
        ("self_attn.v_proj", kv, hidden),
        ("self_attn.o_proj", hidden, q),
        ("mlp.gate_proj", inter, hidden),
        ("mlp.up_proj", inter, hidden),
        ("mlp.down_proj", hidden, inter),
    ]
    shapes = [
        LinearShape(f"model.layers.{i}.{name}", n, k)
        for i in range(preset.num_hidden_layers)
        for name, n, k in per_layer
    ]
    return [*shapes, LinearShape(OUTPUT_HEAD, preset.vocab_size, hidden)]
