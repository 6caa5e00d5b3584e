"""The rules of a parallel layout, once: which tensor- (AutoTP), sequence- (Ulysses) and
expert-parallel (AutoEP) degrees Anneal runs a model at, on how many ranks and with which ZeRO
settings, and which rule refuses the others.

Pure: a model's shape, the degrees and a few facts of the ds_config in, a ``Refusal`` (which
rule, which degree to change) or None out; no disk, no DeepSpeed. Two callers word a refusal
for their own users: the launch (``anneal.resolution.layout_check``, which names ``--set
ds....``) and ``anneal estimate`` (``anneal.planning.memory_layout``, which names ``--tp``,
``--sp`` and ``--ep``), so the estimate refuses exactly what the launch refuses
(tests/model/test_layout_rules.py feeds both the same layouts). The reasons, with what
DeepSpeed 0.19.8 does in each case, are in the launch's words and docs/parallelism.md.

The rules, in the order they are checked (the first that applies is the refusal):

- every degree at least 1;
- experts: no expert-parallel degree above 1 on a dense model; on a sparse one the degree
  divides the experts of a layer and the ranks, and goes without tensor or sequence
  parallelism and without ZeRO offload (either section, whatever its device: DeepSpeed's
  AutoEP takes either as offload);
- tensor and sequence parallelism not together;
- tensor parallelism: the degree divides the ranks and the query and key-value head counts;
- Ulysses: at ZeRO-2 or 3, at ZeRO-3 with ``reduce_scatter`` on, with SDPA attention (the
  estimate's ``--eager-attention``), on a degree that divides the ranks, the sequence and the
  head counts, and on a model without a sliding attention window shorter than the sequence.
"""

from __future__ import annotations

import dataclasses

from anneal.config.ds_schema import Degrees, degrees
from anneal.model.shape import ModelPreset

DEGREE_BELOW_ONE = "degree below one"
EXPERTS_ON_DENSE = "experts on a dense model"
EXPERTS_UNEVEN = "experts do not divide"
EXPERT_GROUPS = "ranks do not split into expert groups"
EXPERTS_WITH_TP_SP = "experts with tensor or sequence parallelism"
EXPERTS_WITH_OFFLOAD = "experts with offload"
TP_WITH_SP = "tensor and sequence parallelism together"
TP_GROUPS = "ranks do not split into tensor-parallel groups"
TP_HEADS = "heads do not divide by the tensor-parallel degree"
SP_STAGE = "Ulysses below ZeRO-2"
SP_REDUCE_SCATTER = "Ulysses at ZeRO-3 without reduce_scatter"
SP_EAGER = "Ulysses with eager attention"
SP_GROUPS = "ranks do not split into sequence-parallel groups"
SP_SEQUENCE = "the sequence does not divide"
SP_HEADS = "heads do not divide by the sequence-parallel degree"
SP_WINDOW = "Ulysses on a sliding attention window"
RULES = (
    DEGREE_BELOW_ONE,
    EXPERTS_ON_DENSE,
    EXPERTS_UNEVEN,
    EXPERT_GROUPS,
    EXPERTS_WITH_TP_SP,
    EXPERTS_WITH_OFFLOAD,
    TP_WITH_SP,
    TP_GROUPS,
    TP_HEADS,
    SP_STAGE,
    SP_REDUCE_SCATTER,
    SP_EAGER,
    SP_GROUPS,
    SP_SEQUENCE,
    SP_HEADS,
    SP_WINDOW,
)
"""Every rule, in the order ``refusal`` checks them; each caller words each of them."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """What the rules read besides the model's shape."""

    degrees: Degrees
    world_size: int
    """Ranks of the launch (GPUs of the estimate: nodes x GPUs per node)."""
    seq_len: int
    """Tokens per sequence."""
    zero_stage: int = 0
    reduce_scatter: bool = True
    """``zero_optimization.reduce_scatter`` (DeepSpeed's default: on)."""
    offload: bool = False
    """An ``offload_optimizer`` or ``offload_param`` section, whatever its device
    (``offloads``)."""
    eager_attention: bool = False
    """Attention that keeps its scores (the estimate's ``--eager-attention``; Anneal's models
    run SDPA)."""

    @classmethod
    def from_ds_config(cls, ds: dict, *, world_size: int, seq_len: int) -> Setup:
        """The setup of a launch from its resolved ds_config."""
        zero = ds.get("zero_optimization", {})
        return cls(
            degrees=degrees(ds),
            world_size=world_size,
            seq_len=seq_len,
            zero_stage=zero.get("stage", 0),
            reduce_scatter=bool(zero.get("reduce_scatter", True)),
            offload=offloads(ds),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Refusal:
    """The rule a layout breaks (one of ``RULES``) and the degree to change: "tp", "sp" or
    "ep", named by each caller in its own words."""

    rule: str
    degree: str
    uneven: tuple[str, ...] = ()
    """The head counts that do not divide, as "name count" (``TP_HEADS``, ``SP_HEADS``)."""
    fits: tuple[int, ...] = ()
    """The expert-parallel degrees that divide both the experts and the ranks
    (``EXPERTS_UNEVEN``, ``EXPERT_GROUPS``)."""
    window: int | None = None
    """The sliding attention window (``SP_WINDOW``)."""


def offloads(ds: dict) -> bool:
    """Whether a ds_config has ZeRO offload as DeepSpeed's AutoEP counts it: an
    ``offload_optimizer`` or ``offload_param`` section, whatever its device."""
    zero = ds.get("zero_optimization", {})
    return "offload_optimizer" in zero or "offload_param" in zero


def sliding_window(preset: ModelPreset, seq_len: int) -> int | None:
    """The sliding attention window of a Hugging Face model (Mistral's ``sliding_window``,
    Qwen2's when ``use_sliding_window``) shorter than ``seq_len``; None without one."""
    doc = preset.hf_config or {}
    window = doc.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window >= seq_len:
        return None
    if doc.get("model_type") == "qwen2" and not doc.get("use_sliding_window"):
        return None
    return window


def expert_degrees(preset: ModelPreset, world_size: int) -> list[int]:
    """The expert-parallel degrees AutoEP accepts for ``preset`` on ``world_size`` ranks:
    divisors of both the experts of a layer and the ranks ([1] for a dense model)."""
    if preset.moe is None:
        return [1]
    experts = preset.moe.num_experts
    top = min(experts, world_size)
    return [d for d in range(1, top + 1) if experts % d == 0 and world_size % d == 0]


def refusal(preset: ModelPreset, setup: Setup) -> Refusal | None:
    """The first rule (``RULES``' order) that ``setup`` breaks for ``preset``; None: Anneal
    runs it."""
    d = setup.degrees
    for name, value in (("tp", d.tp), ("sp", d.sp), ("ep", d.ep)):
        if value < 1:
            return Refusal(rule=DEGREE_BELOW_ONE, degree=name)
    return _experts(preset, setup) or _tensor(preset, setup) or _sequence(preset, setup)


def _experts(preset: ModelPreset, setup: Setup) -> Refusal | None:
    d, n = setup.degrees, setup.world_size
    if preset.moe is None:
        return Refusal(rule=EXPERTS_ON_DENSE, degree="ep") if d.ep > 1 else None
    fits = tuple(expert_degrees(preset, n))
    if preset.moe.num_experts % d.ep:
        return Refusal(rule=EXPERTS_UNEVEN, degree="ep", fits=fits)
    if n % d.ep:
        return Refusal(rule=EXPERT_GROUPS, degree="ep", fits=fits)
    if d.tp > 1 or d.sp > 1:
        return Refusal(rule=EXPERTS_WITH_TP_SP, degree="tp" if d.tp > 1 else "sp")
    if setup.offload:
        return Refusal(rule=EXPERTS_WITH_OFFLOAD, degree="ep")
    return None


def _tensor(preset: ModelPreset, setup: Setup) -> Refusal | None:
    tp = setup.degrees.tp
    if tp > 1 and setup.degrees.sp > 1:
        return Refusal(rule=TP_WITH_SP, degree="sp")
    if tp == 1:
        return None
    if setup.world_size % tp:
        return Refusal(rule=TP_GROUPS, degree="tp")
    if uneven := preset.heads_not_dividing(tp):
        return Refusal(rule=TP_HEADS, degree="tp", uneven=tuple(uneven))
    return None


def _sequence(preset: ModelPreset, setup: Setup) -> Refusal | None:
    sp = setup.degrees.sp
    if sp == 1:
        return None
    rule = None
    if setup.zero_stage not in (2, 3):
        rule = SP_STAGE
    elif setup.zero_stage == 3 and not setup.reduce_scatter:
        rule = SP_REDUCE_SCATTER
    elif setup.eager_attention:
        rule = SP_EAGER
    elif setup.world_size % sp:
        rule = SP_GROUPS
    elif setup.seq_len % sp:
        rule = SP_SEQUENCE
    elif uneven := preset.heads_not_dividing(sp):
        return Refusal(rule=SP_HEADS, degree="sp", uneven=tuple(uneven))
    elif window := sliding_window(preset, setup.seq_len):
        return Refusal(rule=SP_WINDOW, degree="sp", window=window)
    return rule and Refusal(rule=rule, degree="sp")
