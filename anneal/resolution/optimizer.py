"""The optimizer a launch runs: ``optim.optimizer`` (adamw | muon) written into the ds_config's
``optimizer`` section, Muon's values resolved, and what Muon cannot run with refused before
launch (issue 42; docs/training.md, "Muon").

Under ``muon`` the section becomes DeepSpeed's ``{"type": "Muon", "params": {...}}``
(``MuonWithAuxAdam``): ``muon_lr`` and ``adam_lr`` filled where the file says ``"auto"`` or
leaves them out (the Muon half's from ``optim.muon_lr``, else ``optim.lr``; the Adam half's
from the resolved ``lr``), ``momentum`` (0.95) and ``ns_method`` ("gram") written out, and at
ZeRO-3 ``zero_optimization.reduce_scatter`` set false, which DeepSpeed's Muon needs ("Muon and
reduce scatter cannot be used together"): the user never has to write it. The LR each Muon
matrix takes and which parameters take Muon are ``anneal.model.muon``'s.

``gradient_clipping`` is written 0 (off) under Muon with ZeRO. DeepSpeed 0.19.8 runs
Newton-Schulz before it takes the global norm at ZeRO-1, 2 and 3 (without ZeRO, inside the
optimizer's step, after the clip of the gradients, which is kept there), so the norm it
clips by is that of Muon's orthogonalized updates beside the Adam half's gradients, set by the
matrices' sizes whatever the gradients: 62.7 to 67 in the sweep of bench/bench_muon.py, where
AdamW's gradient norm was 0.55 to 2.7. A threshold of 1 would divide every step, the Adam
half's too, by that norm (docs/training.md, "Muon beside AdamW"). A Muon update's size is
fixed by its orthogonalization and its LR, which is what clipping guards for AdamW. The train
row's ``grad_norm`` is still DeepSpeed's norm, over those updates.

Refused, each with one paragraph: a file that says Muon beside ``optim.optimizer=adamw`` (two
answers to one question), Muon's keys under AdamW, Muon with ZeRO offload, with tensor
parallelism (AutoTP shards a matrix and DeepSpeed runs Newton-Schulz on each shard alone:
another update; ``bench/repro/muon_autotp.py`` measures it) and with Ulysses (at ZeRO-3 it
needs ``reduce_scatter``, which Muon refuses).
A Muon LR of 0, a momentum outside [0, 1) and an unknown ``ns_method`` are refused by the
schema's ranges (``anneal.config.ds_schema.RANGES``). A resume that would change the optimizer,
or move a Muon run to another layout (through DeepSpeed's universal checkpoint, which does not
convert Muon's state), is refused by ``check_muon_resume``.
"""

from __future__ import annotations

from pathlib import Path

from anneal import rundir
from anneal.config.ds_schema import degrees, value_or_auto
from anneal.config.run import AUTO, OptimConfig
from anneal.errors import UserError
from anneal.resilience.manifest import moves_stage, saved_zero_stage
from anneal.resolution import parallel

MUON_ONLY_KEYS = ("muon_lr", "adam_lr", "momentum", "ns_method")
"""``optimizer.params`` keys that only DeepSpeed's Muon takes."""
MUON_DEFAULTS = {"momentum": 0.95, "ns_method": "gram"}
"""DeepSpeed's own defaults (``MuonWithAuxAdam``), written out so that config.json shows them."""


def resolve_optimizer(cfg: dict, notes: dict[str, str], *, optim: OptimConfig, source: str):
    """Write ``optim.optimizer`` into the resolved ds_config ``cfg`` (in place; its
    ``optimizer.params.lr`` already resolved), with a note per value filled in."""
    section = cfg["optimizer"]
    params = section.setdefault("params", {})
    file_muon = section["type"].lower() == "muon"
    if optim.optimizer == "adamw":
        if file_muon:
            raise UserError(
                f'{source}: optimizer.type is "Muon" but the run\'s optim.optimizer is adamw: '
                f"two answers to one question. Pick Muon with --set optim.optimizer=muon (a "
                f'file of type "AdamW" serves both), or write "type": "AdamW" in the file.'
            )
        extra = [k for k in MUON_ONLY_KEYS if k in params]
        if extra:
            raise UserError(
                f"{source}: optimizer.params.{extra[0]} is Muon's, and this run's optimizer is "
                f"AdamW, which would refuse it at engine start. Drop the key, or run Muon: "
                f"--set optim.optimizer=muon."
            )
        return
    _check_runs_with_muon(cfg, source)
    section["type"] = "Muon"
    notes["optimizer.type"] = "Muon (optim.optimizer=muon; anneal/model/muon.py splits the params)"
    muon_lr = optim.muon_lr if optim.muon_lr is not None else optim.lr
    muon_from = "muon_lr" if optim.muon_lr is not None else "lr"
    for key, value, how in (
        ("muon_lr", muon_lr, f"optim.{muon_from}, {optim.muon_scale} scale"),
        ("adam_lr", params["lr"], "optimizer.params.lr"),
    ):
        if value_or_auto(params, (key,)) == AUTO:
            params[key] = value
            notes[f"optimizer.params.{key}"] = f"{value:g} ({how})"
        else:
            notes[f"optimizer.params.{key}"] = f"{params[key]:g} (ds_config)"
    for key, value in MUON_DEFAULTS.items():
        params.setdefault(key, value)
    if cfg.get("gradient_clipping", 0) and cfg.get("zero_optimization", {}).get("stage", 0):
        notes["gradient_clipping"] = (
            f"0 (the file's {cfg['gradient_clipping']:g} is off under Muon: DeepSpeed 0.19.8 "
            f"takes the clipping norm over Muon's orthogonalized updates, not the gradients)"
        )
        cfg["gradient_clipping"] = 0.0
    zero = cfg.get("zero_optimization", {})
    if zero.get("stage", 0) == 3:
        zero["reduce_scatter"] = False
        notes["zero_optimization.reduce_scatter"] = "false (DeepSpeed's Muon at ZeRO-3 needs it)"


def _check_runs_with_muon(cfg: dict, source: str) -> None:
    """Refuse the layouts Muon does not run with here (the module's docstring says why)."""
    zero = cfg.get("zero_optimization", {})
    offload = [
        key
        for key in ("offload_optimizer", "offload_param")
        if isinstance(zero.get(key), dict) and zero[key].get("device", "none") != "none"
    ]
    d = degrees(cfg)
    why = None
    if offload:
        why = (
            f"zero_optimization.{offload[0]} moves the optimizer's work to the "
            f"{zero[offload[0]]['device']}, where DeepSpeed 0.19.8 runs Muon's Newton-Schulz on "
            f"the host and Anneal has not tested it. Use a ds_config without offload "
            f"(zero3_bf16.json)"
        )
    elif d.tp > 1:
        why = (
            f"tensor_parallel.autotp_size is {d.tp}: AutoTP shards each matrix and DeepSpeed "
            f"runs Newton-Schulz on each shard alone, which is another update than the whole "
            f"matrix's (bench/repro/muon_autotp.py: a small Llama's losses at TP=2 left TP=1's "
            f"by 3.0e-4 relative after 10 steps, growing each step, where AdamW's stayed within "
            f"1.6e-7). Use data parallelism with ZeRO (--set ds.tensor_parallel.autotp_size=1)"
        )
    elif d.sp > 1:
        why = (
            f"sequence_parallel_size is {d.sp}: Ulysses at ZeRO-3 needs reduce_scatter, which "
            f"DeepSpeed's Muon refuses, and Anneal has not tested it at ZeRO-2. Use --set "
            f"ds.sequence_parallel_size=1"
        )
    if why:
        raise UserError(
            f"{source}: optim.optimizer=muon cannot run with this layout: {why}, or keep this "
            f"layout with --set optim.optimizer=adamw."
        )


def check_muon_resume(tag_dir: Path, manifest: dict, launch_ds: dict, here, stage: int) -> None:
    """A resume with Muon on either side: the same optimizer on both (the state of one does
    not load into the other), and with Muon at the layout it was saved at. Another number of
    ranks, expert- or tensor-parallel degree, or a move between ZeRO-1/2 and ZeRO-3 goes
    through DeepSpeed's universal checkpoint, whose converter reads AdamW's moments from every
    group and stops on Muon's (bench/repro/muon_universal.py)."""
    saved_ds = rundir.record_or_empty(rundir.of_checkpoint(tag_dir)).ds_config
    saved_type = saved_ds.get("optimizer", {}).get("type")
    here_type = launch_ds["optimizer"]["type"]
    if not saved_type or "muon" not in (saved_type.lower(), here_type.lower()):
        return
    if saved_type.lower() != here_type.lower():
        raise UserError(
            f"--resume {tag_dir}: saved with optimizer {saved_type} and this launch runs "
            f"{here_type}: the optimizer state of one does not load into the other. Resume "
            f"with --set optim.optimizer={'muon' if saved_type.lower() == 'muon' else 'adamw'}, "
            f"or export the model and start a new run from it with --init-from (a fresh "
            f"optimizer)."
        )
    saved = parallel.saved_layout(manifest, here)
    saved_stage = saved_zero_stage(manifest)
    if parallel.converts(saved, here) or moves_stage(saved_stage, stage):
        raise UserError(
            f"--resume {tag_dir}: a Muon run saved on {saved.describe()} at ZeRO-"
            f"{saved_stage}, and this launch is {here.describe()} at ZeRO-{stage}. That change "
            f"goes through DeepSpeed's universal checkpoint, whose converter in DeepSpeed "
            f"0.19.8 reads AdamW's exp_avg and exp_avg_sq from every parameter group and stops "
            f"with a KeyError on Muon's, which hold one momentum_buffer (tried: bench/repro/"
            f"muon_universal.py). Resume on {saved.world_size} ranks at ZeRO-{saved_stage} with "
            f"the saved layout, or export the model and start a new run from it with "
            f"--init-from (a fresh optimizer)."
        )
