"""The launch's check of its parallel layout: ``anneal.model.layout_rules``' verdict on the
resolved ds_config, worded for whoever launches (the key, its value, where it came from, and
the ``--set ds....`` that works instead). ``anneal estimate`` words the same verdicts with its
own flags (``anneal.planning.memory_layout``).
"""

from __future__ import annotations

from anneal.errors import UserError
from anneal.model import ModelPreset
from anneal.model import layout_rules as rules


def check_layout(ds: dict, preset: ModelPreset, *, world_size: int, source: str) -> None:
    """UserError, with its reason and what works instead, for a layout of ``ds`` on
    ``world_size`` ranks that Anneal does not run (``layout_rules``)."""
    setup = rules.Setup.from_ds_config(ds, world_size=world_size, seq_len=preset.seq_len)
    found = rules.refusal(preset, setup)
    if found is None:
        return
    if found.rule == rules.DEGREE_BELOW_ONE:
        why = f"the {_DEGREE_KEYS[found.degree]} must be at least 1."
    elif found.degree == "ep" or found.rule == rules.EXPERTS_WITH_TP_SP:
        why = _expert_key_words(found, setup, preset, source)
    elif found.rule in (rules.TP_GROUPS, rules.TP_HEADS):
        why = _tensor_key_words(found, setup, source)
    else:
        why = _sequence_key_words(found, setup, preset, source)
    raise UserError(f"{source}: {why}")


_DEGREE_KEYS = {
    "tp": "tensor_parallel.autotp_size",
    "sp": "sequence_parallel_size",
    "ep": "expert_parallel.autoep_size",
}


def _tensor_key_words(found: rules.Refusal, setup: rules.Setup, source: str) -> str:
    tp, n = setup.degrees.tp, setup.world_size
    fix = f"Set ds.tensor_parallel.autotp_size (now {tp}, from {source} or --set)"
    if found.rule == rules.TP_GROUPS:
        return (
            f"tensor_parallel.autotp_size is {tp} but the launch has {n} rank(s), which do not "
            f"split into tensor-parallel groups of {tp}. {fix} to a divisor of {n}, or launch "
            f"a multiple of {tp} ranks."
        )
    return (
        f"tensor_parallel.autotp_size {tp} does not divide the model's "
        f"{', '.join(found.uneven)}: AutoTP deals whole heads to the {tp} ranks of a group, so "
        f"some would do more attention work than others (or none, past the key-value head "
        f"count) while all wait for the slowest. {fix} to a divisor of the head counts, or "
        f"change them (--set model.num_attention_heads=...)."
    )


def _sequence_key_words(
    found: rules.Refusal, setup: rules.Setup, preset: ModelPreset, source: str
) -> str:
    sp, tp, n = setup.degrees.sp, setup.degrees.tp, setup.world_size
    stage, seq = setup.zero_stage, setup.seq_len
    fix = f"Set ds.sequence_parallel_size (now {sp}, from {source} or --set)"
    return {
        rules.TP_WITH_SP: (
            f"tensor_parallel.autotp_size {tp} together with sequence_parallel_size {sp}: "
            f"DeepSpeed 0.19.8 builds their process groups apart (AutoTP's mesh, Ulysses' own "
            f"sequence groups) and does not test them together, nor does Anneal run them "
            f"together. Use one: --set ds.tensor_parallel.autotp_size=1, or "
            f"--set ds.sequence_parallel_size=1."
        ),
        rules.SP_STAGE: (
            f"sequence_parallel_size {sp} with ZeRO stage {stage}: Anneal runs Ulysses "
            f"sequence parallelism with ZeRO-2 and ZeRO-3, as DeepSpeed tests it, and checks "
            f"it against the run without it only there. Use --set ds.zero_optimization.stage=2 "
            f"(or 3)."
        ),
        rules.SP_REDUCE_SCATTER: (
            f"sequence_parallel_size {sp} with ZeRO-3 and zero_optimization.reduce_scatter "
            f"false: DeepSpeed 0.19.8's ZeRO-3 then reduces some gradient buckets summed over "
            f"each sequence-parallel group and others averaged, so no one loss scaling gives "
            f"the gradients of the run without it (anneal/train/sequence.py). Drop the key, "
            f"or set it to true."
        ),
        rules.SP_EAGER: (
            f"sequence_parallel_size {sp} with eager attention: DeepSpeed's Ulysses runs SDPA "
            f"or flash attention, never eager. {fix} to 1."
        ),
        rules.SP_GROUPS: (
            f"sequence_parallel_size is {sp} but the launch has {n} rank(s), which do not "
            f"split into sequence-parallel groups of {sp}. {fix} to a divisor of {n}, or "
            f"launch a multiple of {sp} ranks."
        ),
        rules.SP_SEQUENCE: (
            f"sequence_parallel_size {sp} does not divide the sequence length {seq}: each rank "
            f"of a group takes an equal slice of every sequence. {fix} to a divisor of {seq}, "
            f"or change --set model.seq_len."
        ),
        rules.SP_HEADS: (
            f"sequence_parallel_size {sp} does not divide the model's "
            f"{', '.join(found.uneven)}: Ulysses' all-to-all gives each rank of a group the "
            f"whole sequence for 1/{sp} of the heads, query and key-value alike. {fix} to a "
            f"divisor of the head counts, or change them (--set model.num_attention_heads=...)."
        ),
        rules.SP_WINDOW: (
            f"sequence_parallel_size {sp} on a model that attends through a sliding window of "
            f"{found.window} tokens (its config.json): DeepSpeed's Ulysses attention drops the "
            f"attention mask and attends causally over the whole sequence, so this model would "
            f"train on another attention than its own. Train it with "
            f"--set ds.sequence_parallel_size=1, or with a sequence no longer than the window."
        ),
    }[found.rule]


def _expert_key_words(
    found: rules.Refusal, setup: rules.Setup, preset: ModelPreset, source: str
) -> str:
    d, n = setup.degrees, setup.world_size
    experts = preset.moe.num_experts if preset.moe else 0
    fix = f"Set ds.expert_parallel.autoep_size (now {d.ep}, from {source} or --set)"
    what = f"tensor_parallel.autotp_size {d.tp}" if d.tp > 1 else f"sequence_parallel_size {d.sp}"
    return {
        rules.EXPERTS_ON_DENSE: (
            f"expert_parallel.autoep_size is {d.ep}, but the model ({preset.name}) is dense: "
            f"it has no experts to share out. Drop the key (or --set "
            f"ds.expert_parallel.autoep_size=1), or train a sparse preset (--set "
            f"model.preset=tiny-moe, olmoe-1b-7b or qwen3-30b-a3b; recipes/pretrain_moe_*.py)."
        ),
        rules.EXPERTS_UNEVEN: (
            f"expert_parallel.autoep_size {d.ep} does not divide the model's {experts} experts "
            f"per layer: each rank of an expert group holds an equal share of them. {fix} to "
            f"one of {list(found.fits)}."
        ),
        rules.EXPERT_GROUPS: (
            f"expert_parallel.autoep_size is {d.ep} but the launch has {n} rank(s), which do "
            f"not split into expert groups of {d.ep}. {fix} to a divisor of {n} that divides "
            f"{experts}, or launch a multiple of {d.ep} ranks."
        ),
        rules.EXPERTS_WITH_TP_SP: (
            f"a sparse model with {what}: DeepSpeed 0.19.8's AutoEP folds expert parallelism "
            f"into AutoTP's groups only for some presets and layouts, and refuses sequence "
            f"parallelism under ZeRO-3; Anneal has run neither with experts and does not offer "
            f"them. Scale a sparse model with expert and data parallelism: drop {what.split()[0]} "
            f"and use --set ds.expert_parallel.autoep_size=N."
        ),
        rules.EXPERTS_WITH_OFFLOAD: (
            "a sparse model with ZeRO offload: DeepSpeed 0.19.8's AutoEP checks offload only "
            "under its own constraints and Anneal has not run it. Drop "
            "zero_optimization.offload_optimizer / offload_param, and share the experts out "
            "with --set ds.expert_parallel.autoep_size=N instead."
        ),
    }[found.rule]
