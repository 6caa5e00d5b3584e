"""A universal checkpoint loadable at ZeRO-1/2 and at ZeRO-3 alike, whichever stage saved it:
``either_stage``, which the converter's child process (``python -m anneal.resilience.universal``)
runs on every folder DeepSpeed's ``ds_to_universal`` writes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from anneal.resilience import ds_files, safeload


def either_stage(out: Path) -> None:
    """Make a universal folder made by DeepSpeed 0.19.8's converter loadable at ZeRO-1/2 and at
    ZeRO-3 alike, whichever stage saved it. The two loaders differ in four things, all added
    here (nothing the saving stage's loader reads is changed):

    - the model-states file: ZeRO-1/2 and ZeRO-3 look for it under different names; each gets
      the other's name (``ds_files.universal_twin``, a hard link);
    - ``zero/optimizer_state.pt``: ZeRO-1/2 wants ``ds_version`` and ``clip_grad``, ZeRO-3 the
      Adam step and the param groups under ``optimizer_state_dict``. A ZeRO-3 source's copy of
      rank 0's whole flat optimizer state there (its weights and moments, which neither loader
      reads: they come from each parameter's folder) is dropped, a third of the conversion;
    - each parameter's ``fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``: ZeRO-1/2 reads a dict
      (``{"param": tensor, "cat_dim": 0}``), ZeRO-3 a dict or a bare tensor;
    - each parameter's ``step.pt``: ZeRO-1/2 reads the Adam step there, ZeRO-3 from the
      optimizer state.

    ``bench/repro/zero_stage_universal.py`` shows DeepSpeed's loader failing without this.
    Every file is read by torch's weights-only loader."""
    with torch.serialization.safe_globals(safeload.safe_globals()):
        _either_stage(out)


def _either_stage(out: Path) -> None:
    from deepspeed.checkpoint.constants import CAT_DIM, PARAM

    for path in ds_files.universal_model_files(out):
        name = ds_files.universal_twin(path.name)
        if name is None:
            continue
        twin = out / name
        if not twin.exists():
            try:
                os.link(path, twin)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(path, twin)
    zero = out / "zero"
    optim = _load(zero / "optimizer_state.pt")
    folders = sorted(p for p in zero.iterdir() if p.is_dir())
    steps = [_load(f / "step.pt") for f in folders if (f / "step.pt").is_file()]
    if steps:
        step = steps[0]
    else:
        step = next(iter(optim["optimizer_state_dict"]["state"].values()))["step"]
    for folder in folders:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            path = folder / f"{key}.pt"
            if path.is_file():
                value = _load(path)
                if torch.is_tensor(value):
                    torch.save({PARAM: value, CAT_DIM: 0}, path)
        if not (folder / "step.pt").is_file():
            torch.save(step, folder / "step.pt")
    model = _load(next(iter(ds_files.universal_model_files(out))))
    optim.pop("fp32_flat_groups", None)
    optim.setdefault("ds_version", model["ds_version"])
    optim.setdefault("clip_grad", float(model["ds_config"].get("gradient_clipping", 0.0)))
    inner = optim.setdefault("optimizer_state_dict", {"param_groups": optim["param_groups"]})
    inner["state"] = {
        k: {"step": v["step"]} for k, v in inner.get("state", {0: {"step": step}}).items()
    }
    torch.save(optim, zero / "optimizer_state.pt")


def _load(path: Path):
    return torch.load(path, weights_only=True)
