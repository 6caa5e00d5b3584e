"""The estimate's check of a parallel layout: ``anneal.model.layout_rules``' verdict, the one the
launch gives (``anneal.resolution.layout_check``), worded with ``anneal estimate``'s flags
(``--tp``, ``--sp``, ``--ep``, ``--nodes x --gpus-per-node``, ``--seq``). ``memory.estimate``
checks first, so the estimate refuses what the launch refuses and accepts what it accepts
(tests/model/test_layout_rules.py).
"""

from __future__ import annotations

from anneal.config.ds_schema import Degrees
from anneal.errors import UserError
from anneal.model import ModelPreset
from anneal.model import layout_rules as rules


def setup(zero, work) -> rules.Setup:
    """What the rules read of ``zero`` (a ``memory.ZeroSetup``) and ``work`` (a
    ``memory.Workload``)."""
    return rules.Setup(
        degrees=Degrees(tp=work.tp, sp=work.sp, ep=work.ep),
        world_size=work.n_gpus,
        seq_len=work.seq_len,
        zero_stage=zero.stage,
        reduce_scatter=zero.reduce_scatter,
        offload=zero.offload_section or zero.offload_optimizer or zero.offload_param,
        eager_attention=work.eager_attention,
    )


def refused_by(preset: ModelPreset, zero, work) -> str | None:
    """The rule (``layout_rules.RULES``) that refuses ``work``'s layout; None: Anneal runs it."""
    found = rules.refusal(preset, setup(zero, work))
    return found and found.rule


def accepts(preset: ModelPreset, zero, work) -> bool:
    """Whether Anneal runs ``work``'s layout (the levers' test of a degree they suggest)."""
    return refused_by(preset, zero, work) is None


def check(preset: ModelPreset, zero, work) -> None:
    """One UserError, naming the flag to change, where the launch would refuse this layout."""
    s = setup(zero, work)
    found = rules.refusal(preset, s)
    if found is None:
        return
    d = s.degrees
    if found.rule == rules.DEGREE_BELOW_ONE:
        value, kind = {
            "tp": (d.tp, "tensor"),
            "sp": (d.sp, "sequence"),
            "ep": (d.ep, "expert"),
        }[found.degree]
        raise UserError(f"--{found.degree} {value}: the {kind}-parallel degree must be at least 1.")
    if found.degree == "ep" or found.rule == rules.EXPERTS_WITH_TP_SP:
        why = _ep_flag_words(found, s, preset)
        raise UserError(f"--ep {d.ep} (expert_parallel.autoep_size) {why.rstrip('.')}.")
    if found.rule == rules.TP_GROUPS:
        raise UserError(
            f"--tp {d.tp} (tensor_parallel.autotp_size) with {s.world_size} GPUs (--nodes x "
            f"--gpus-per-node): the GPUs do not split into tensor-parallel groups of {d.tp}. "
            f"Choose a --tp that divides {s.world_size}, or a GPU count that is a multiple of "
            f"{d.tp}."
        )
    if found.rule == rules.TP_HEADS:
        raise UserError(
            f"--tp {d.tp} (tensor_parallel.autotp_size) does not divide the model's "
            f"{', '.join(found.uneven)}: AutoTP deals whole heads to the ranks of a group. "
            f"Choose a --tp that divides the head counts."
        )
    raise UserError(f"--sp {d.sp} (sequence_parallel_size) {_sp_flag_words(found, s)}.")


def _sp_flag_words(found: rules.Refusal, s: rules.Setup) -> str:
    return {
        rules.TP_WITH_SP: (
            f"with --tp {s.degrees.tp}: Anneal runs tensor and sequence parallelism apart "
            f"(DeepSpeed 0.19.8 tests neither with the other). Choose one of them"
        ),
        rules.SP_STAGE: (
            f"with ZeRO stage {s.zero_stage}: Anneal runs Ulysses with ZeRO-2 and 3. Use either"
        ),
        rules.SP_REDUCE_SCATTER: (
            "with ZeRO-3 and zero_optimization.reduce_scatter false: DeepSpeed 0.19.8 then "
            "reduces some gradient buckets summed over each group and others averaged. Give a "
            "ds_config without the key, or with it true"
        ),
        rules.SP_EAGER: (
            "with --eager-attention: Ulysses runs SDPA or flash attention, never eager. Drop it"
        ),
        rules.SP_GROUPS: (
            f"with {s.world_size} GPUs, which do not split into groups of {s.degrees.sp}. "
            f"Choose a divisor"
        ),
        rules.SP_SEQUENCE: (
            f"does not divide the sequence of {s.seq_len} tokens. Choose a divisor of {s.seq_len}"
        ),
        rules.SP_HEADS: (
            f"does not divide the model's {', '.join(found.uneven)}: the all-to-all deals "
            f"whole heads. Choose a divisor of the head counts"
        ),
        rules.SP_WINDOW: (
            f"on a model that attends through a sliding window of {found.window} tokens: "
            f"Ulysses attends over the whole sequence. Drop --sp, or give a --seq no longer "
            f"than the window"
        ),
    }[found.rule]


def _ep_flag_words(found: rules.Refusal, s: rules.Setup, preset: ModelPreset) -> str:
    d = s.degrees
    choose = f"Choose an --ep that divides both: {', '.join(map(str, found.fits))}."
    flag = f"--tp {d.tp}" if d.tp > 1 else f"--sp {d.sp}"
    experts = preset.moe.num_experts if preset.moe else 0
    return {
        rules.EXPERTS_ON_DENSE: (
            f"with {preset.name}, a dense model: expert parallelism shares out the experts of "
            f"a sparse one. Drop --ep, or give a sparse model (tiny-moe, olmoe-1b-7b, "
            f"qwen3-30b-a3b or its config.json)."
        ),
        rules.EXPERTS_UNEVEN: (
            f"does not divide the {experts} experts of each layer of {preset.name}: each rank "
            f"of an expert group holds an equal share of them. {choose}"
        ),
        rules.EXPERT_GROUPS: (
            f"with {s.world_size} GPUs (--nodes x --gpus-per-node): the GPUs do not split into "
            f"expert groups of {d.ep}. {choose}"
        ),
        rules.EXPERTS_WITH_TP_SP: (
            f"with {flag}: Anneal runs a sparse model with expert and data parallelism only "
            f"(DeepSpeed 0.19.8's AutoEP folds into AutoTP only for some layouts and refuses "
            f"Ulysses under ZeRO-3, and Anneal has run neither with experts). Drop "
            f"{flag.split()[0]}"
        ),
        rules.EXPERTS_WITH_OFFLOAD: (
            "with ZeRO offload: Anneal has not run AutoEP with offload. Give a ds_config "
            "without offload_optimizer / offload_param, and a larger --ep"
        ),
    }[found.rule]
