"""What ``train.float8`` changes in a run's memory and step time, for the estimate and the
forecast (docs/throughput.md, "In the estimate"). The layers are the ones the launch converts
(``anneal.model.float8_rule``, applied to the preset's shapes).

Memory, read off torchao 0.18's code (``torchao/float8/float8_linear.py``) and DeepSpeed
0.19.8's; not measured on a GPU:

- **Model states: unchanged.** ``Float8Linear`` keeps the ``nn.Linear``'s own weight in the
  run's precision; DeepSpeed keeps its fp32 master and the optimizer's state as for any
  parameter (torchao's float8 all-gather is FSDP2's, so ZeRO-3 gathers 16-bit weights).
- **Activations: unchanged.** Its ``matmul_with_hp_or_float8_args`` saves the high-precision
  input and the weight for backward (``ctx.save_for_backward(input_hp, weight_hp_t)``), the
  tensors a plain Linear saves; no float8 copy is kept: backward casts again.
- **Casts in flight** (``cast_buffer_bytes``): backward holds its four float8 operands until
  it returns (the output gradient twice, once per scaling axis, the weight and the input:
  ``2 T N + N K + T K`` bytes for T tokens through an (N x K) weight). Eager
  (``train.compile=off``), each cast also makes an fp32 scaled copy of the tensor and its
  clamp (``_ToFloat8ConstrFunc``, ``to_fp8_saturated``): 8 more bytes a value of the tensor
  being cast, the input last. Compiled, inductor fuses the cast: its float8 operands alone are
  counted (an upper bound). The largest converted layer sets it; one layer at a time.
- **ZeRO-3 keeps gathered weights** (``held_weight_bytes``): DeepSpeed frees a gathered weight
  after its forward by pointing the parameter at an empty tensor, and makes ``F.linear`` save
  the parameter itself (``memory_efficient_linear``); ``Float8Linear`` does not call
  ``F.linear`` and saves a view of the gathered weight, which keeps its storage until that
  layer's backward. At the start of backward every converted layer's full weight is held, in
  the run's precision, where the data-parallel group is over one rank (at one, the gathered
  weight is the rank's own partition: ``NoGatherHandle``).

Step time: a converted layer's three matmuls (forward, input gradient, weight gradient: 6 N K
FLOPs a token) run at the device's float8 peak where one is known, the rest at its bf16 peak,
at the same MFU (``step_time_factor``); an upper bound on the gain, since the casts cost time
too (torchtitan measured 1.28x over compile at 8B on 8 H100s where this count says more). MFU
stays reported against the bf16 peak, as the anchors report it.
"""

from __future__ import annotations

import dataclasses

from anneal.model.float8_rule import LinearShape, choose_float8, dense_linear_shapes
from anneal.model.shape import ModelPreset

EAGER_CAST_BYTES = 8
"""fp32 bytes a value of the tensor being cast that an eager cast adds to its float8 byte:
the scaled copy and its clamp (torchao 0.18, ``_ToFloat8ConstrFunc.forward``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8Setting:
    """``train.float8`` (off | tensorwise | rowwise), ``train.float8_layers`` and whether the
    model is compiled (``train.compile`` not off)."""

    recipe: str = "off"
    layers: str = "auto"
    compiled: bool = False

    @property
    def on(self) -> bool:
        return self.recipe != "off"


FLOAT8_OFF = Float8Setting()
"""A run without float8: the default of the estimate and the forecast."""


def converted_linears(preset: ModelPreset, setting: Float8Setting) -> list[LinearShape]:
    """The Linear layers the launch converts to float8 (none when off or for a sparse model,
    which the launch refuses)."""
    if not setting.on or preset.moe is not None:
        return []
    shapes = dense_linear_shapes(preset)
    chosen = set(choose_float8(shapes, recipe=setting.recipe, layers=setting.layers).converted)
    return [s for s in shapes if s.name in chosen]


def float8_flops_per_token(preset: ModelPreset, setting: Float8Setting) -> float:
    """Training FLOPs a token spends in the converted layers' matmuls: 6 N K each."""
    return float(
        sum(6 * s.out_features * s.in_features for s in converted_linears(preset, setting))
    )


def cast_buffer_bytes(preset: ModelPreset, setting: Float8Setting, *, tokens: int) -> int:
    """Peak bytes of float8 casts in flight, one layer at a time (module docstring): the
    largest over the converted layers of their backward's operands, each cast point's float8
    operands held so far plus, eager, ``EAGER_CAST_BYTES`` a value of the tensor it casts."""
    extra = 0 if setting.compiled else EAGER_CAST_BYTES
    peak = 0
    for s in converted_linears(preset, setting):
        n, k = s.out_features, s.in_features
        grad_out, weight, inp = tokens * n, n * k, tokens * k
        for order in ((inp, weight), (grad_out, weight, grad_out, inp)):  # forward, backward
            held = 0
            for cast in order:  # torchao's order; each float8 operand held until return
                held += cast
                peak = max(peak, held + extra * cast)
    return peak


def held_weight_bytes(
    preset: ModelPreset, setting: Float8Setting, *, stage: int, dp: int, value_bytes: int
) -> int:
    """Bytes of gathered weights that float8 layers keep from forward to backward at ZeRO-3
    over ``dp`` > 1 ranks: every converted layer's full weight (module docstring)."""
    if stage != 3 or dp <= 1:
        return 0
    return value_bytes * sum(
        s.out_features * s.in_features for s in converted_linears(preset, setting)
    )


def step_time_factor(
    preset: ModelPreset,
    setting: Float8Setting,
    *,
    flops_per_token: float,
    peak_flops: float,
    fp8_peak_flops: float | None,
) -> float:
    """A step's time with float8 over its time without: the converted layers' share of
    ``flops_per_token`` at ``fp8_peak_flops`` instead of ``peak_flops`` (bf16), the rest as
    before; 1 where no float8 peak is known (``fp8_peak_flops`` None: a CPU, an A100)."""
    if not fp8_peak_flops or not setting.on:
        return 1.0
    share = float8_flops_per_token(preset, setting) / flops_per_token
    return 1 - share + share * peak_flops / fp8_peak_flops
