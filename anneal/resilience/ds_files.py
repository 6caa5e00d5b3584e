"""DeepSpeed's checkpoint files: the one module that knows how DeepSpeed 0.19.8 names and lays
out the files of a checkpoint tag directory, as torchtitan's checkpointer alone knows DCP's.

- Model states: ``mp_rank_TT_model_states.pt`` (no ZeRO and ZeRO-1/2: one per tensor-parallel
  rank), ``zero_pp_rank_D_mp_rank_TT_model_states.pt`` (ZeRO-3: one per rank).
- Optimizer states: ``zero_pp_rank_D_mp_rank_TT_optim_states.pt`` (ZeRO-1/2/3, one per rank),
  ``expp_rank_E_mp_rank_TT_optim_states.pt`` (an AutoEP run without ZeRO).
- AutoEP's experts at ZeRO-0/1/2: ``layer_L_expert_X_mp_rank_TT_model_states.pt``, one file an
  expert (at ZeRO-3 they live in the ranks' partitions, ``ZERO3_FORMAT``).

A file's name says which rank wrote it (data-parallel rank ``D``, tensor-parallel rank ``TT``);
the names present say the ZeRO stage (``stage_of_names``) where a manifest does not record it,
and the optimizer state says it where one is read (``stage_of_optimizer``). Everything else of
Anneal (the manifest, the safe loader, the universal conversion, the export, evaluation) asks
here instead of spelling a name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

MODEL_STATES = "model_states"
"""The word DeepSpeed ends every model-states file's name with (before ``.pt``)."""
OPTIM_STATES = "optim_states"
"""The word DeepSpeed ends every optimizer-states file's name with (before ``.pt``)."""
MODEL_STATES_PATTERN = f"*mp_rank_XX_{MODEL_STATES}.pt"
"""A tensor-parallel rank's model states, as a message names them."""
ZERO3_MODEL_STATES = "zero_pp_rank_R"
"""ZeRO-3's model states of one rank, as a message names them."""

ZERO3_FORMAT = "zero3_partitioned"
"""AutoEP's ``checkpoint_format`` at ZeRO-3: the experts live in the ranks' partitions."""
PER_EXPERT_FILES = "per_expert_files"
"""AutoEP's ``checkpoint_format`` at ZeRO-0/1/2: one file an expert (``expert_file_name``)."""

_DP_RANK = re.compile(r"zero_pp_rank_(\d+)_")
_TP_RANK = re.compile(r"mp_rank_(\d+)_")
_EXPERT_FILE = re.compile(rf"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_{MODEL_STATES}\.pt")
_EXPERT_OPTIM_FILE = re.compile(rf"expp_rank_\d+_mp_rank_\d+_{OPTIM_STATES}\.pt")
_UNIVERSAL_MODEL_STATES = {"mp_rank_": "zero_pp_rank_0_mp_rank_"}
"""The model-states names of ZeRO-1/2's and ZeRO-3's universal load, by how they begin."""


class LayoutError(Exception):
    """A checkpoint's files, or the index of one, are not laid out as DeepSpeed writes them."""


def writer_ranks(name: str) -> tuple[int, int]:
    """(data-parallel rank, tensor-parallel rank) that wrote the file ``name`` (a path relative
    to the tag directory may be given): DeepSpeed names a file by the writer's data-parallel
    rank (``zero_pp_rank_D_``, else 0) and tensor-parallel rank (``mp_rank_TT_``, else 0)."""
    dp, tp = _DP_RANK.search(name), _TP_RANK.search(name)
    return (int(dp[1]) if dp else 0), (int(tp[1]) if tp else 0)


def names_a_tensor_parallel_rank(name: str) -> bool:
    """Whether ``name`` is one tensor-parallel rank's file (``mp_rank_TT_``)."""
    return _TP_RANK.search(name) is not None


def stage_of_names(names: Iterable[str]) -> int | None:
    """The ZeRO stage the files ``names`` were saved at, read off their names: ZeRO-3 writes
    each rank's model states under its data-parallel rank, ZeRO-1/2 one model states per
    tensor-parallel rank beside each rank's optimizer states, no ZeRO only the former. 3, 2
    (for 1 or 2, whose files are the same), 0, or None when it cannot tell."""
    names = [Path(n).name for n in names]
    model = f"_{MODEL_STATES}.pt"
    if any(n.startswith("zero_pp_rank_") and n.endswith(model) for n in names):
        return 3
    if any(n.endswith(f"_{OPTIM_STATES}.pt") for n in names):
        return 2
    if any(n.startswith("mp_rank_") and n.endswith(model) for n in names):
        return 0
    return None


def stage_of_optimizer(optims: list[dict]) -> int:
    """The ZeRO stage that the ranks' ``optimizer_state_dict`` records (0 without one)."""
    return int(optims[0].get("zero_stage", 0)) if optims else 0


def _rank_optim_file(mp_rank: int) -> re.Pattern:
    """The optimizer file of each data-parallel rank that holds tensor-parallel rank
    ``mp_rank``'s slices (00 without tensor parallelism)."""
    return re.compile(rf"zero_pp_rank_(\d+)_mp_rank_{mp_rank:02d}_{OPTIM_STATES}\.pt$")


def checkpoint_files(tag_dir: Path, mp_rank: int = 0) -> tuple[list[Path], list[Path]]:
    """The files that hold the weights: the model states (one per rank under ZeRO-3) and the
    optimizer states of each rank, in rank order; with tensor parallelism, those of the ranks
    that hold tensor-parallel rank ``mp_rank``'s slices (a ZeRO checkpoint of its own over the
    data-parallel ranks)."""
    rank_file = _rank_optim_file(mp_rank)
    model_files = sorted(
        f
        for f in Path(tag_dir).glob(f"*mp_rank_{mp_rank:02d}_{MODEL_STATES}.pt")
        if not is_expert_file(f.name)
    )
    optim_files = sorted(
        (f for f in Path(tag_dir).glob(f"*_{OPTIM_STATES}.pt") if rank_file.search(f.name)),
        key=lambda f: int(rank_file.search(f.name).group(1)),
    )
    return model_files, optim_files


def zero3_rank_files(tag_dir: Path) -> list[Path]:
    """Every rank's model states (ZeRO-3 writes one a rank), in rank order. LayoutError where
    they are not one such file a rank."""
    files, _ = checkpoint_files(tag_dir)
    ranked = [(_DP_RANK.match(f.name), f) for f in files]
    if not ranked or not all(m for m, _ in ranked):
        raise LayoutError(f"its model states are not one {ZERO3_MODEL_STATES} file a rank")
    return [f for _, f in sorted(ranked, key=lambda mf: int(mf[0][1]))]


def is_expert_file(name: str) -> bool:
    """Whether ``name`` is the file of one expert of one sparse layer that DeepSpeed's AutoEP
    writes beside the model states (a flat dict of tensors; not a model-states file)."""
    return _EXPERT_FILE.fullmatch(name) is not None


def expert_file_name(layer_id: int, expert: int, mp_rank: int = 0) -> str:
    """DeepSpeed's name of one expert's file (``DeepSpeedEngine._get_expert_ckpt_name``)."""
    return f"layer_{layer_id}_expert_{expert}_mp_rank_{mp_rank:02d}_{MODEL_STATES}.pt"


def expert_files(tag_dir: Path, mp_rank: int = 0) -> list[Path]:
    """The per-expert files of an AutoEP checkpoint (tensor-parallel rank ``mp_rank``'s),
    sorted by layer and expert; none for a dense model."""
    found = [(_EXPERT_FILE.fullmatch(f.name), f) for f in Path(tag_dir).glob("layer_*_expert_*")]
    found = [(m, f) for m, f in found if m and int(m[3]) == mp_rank]
    return [f for m, f in sorted(found, key=lambda mf: (int(mf[0][1]), int(mf[0][2])))]


def files_holding_weights(tag_dir: Path, tp: int) -> list[Path]:
    """Every file a reader of the weights opens, of all ``tp`` tensor-parallel ranks: model
    states, optimizer states and expert files."""
    read = []
    for r in range(tp):
        model_files, optim_files = checkpoint_files(tag_dir, r)
        read += model_files + optim_files + expert_files(tag_dir, r)
    return read


def states_key(name: str) -> str | None:
    """The key that DeepSpeed's own file ``name`` always holds at its top (``module`` in model
    states, ``optimizer_state_dict`` in ZeRO's optimizer states, ``optimizer`` in an AutoEP
    run's expert-parallel optimizer states without ZeRO); None for another file."""
    if _EXPERT_OPTIM_FILE.fullmatch(name):
        return "optimizer"
    if name.endswith(f"{MODEL_STATES}.pt"):
        return "module"
    if name.endswith(f"{OPTIM_STATES}.pt"):
        return "optimizer_state_dict"
    return None


def universal_model_files(directory: Path) -> list[Path]:
    """The model-states files directly in ``directory`` (a universal checkpoint's), sorted."""
    return sorted(Path(directory).glob(f"*{MODEL_STATES}.pt"))


def universal_twin(name: str) -> str | None:
    """The name the other ZeRO stage's universal load looks for, of the model-states file
    ``name``: ZeRO-1/2 looks for ``mp_rank_XX_...``, ZeRO-3 for ``zero_pp_rank_0_mp_rank_XX_...``;
    None for a name of neither."""
    for z12, z3 in _UNIVERSAL_MODEL_STATES.items():
        if name.startswith(z3):
            return name.replace(z3, z12, 1)
        if name.startswith(z12):
            return name.replace(z12, z3, 1)
    return None
