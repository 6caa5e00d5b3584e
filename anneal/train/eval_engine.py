"""An engine that scores a model's weights, built for the live world: ``anneal eval``'s.

The weights come from a run's checkpoint or a Hugging Face directory, read by the caller's
``load_weights(model, gather)`` (``anneal.cli.evaluate``: the exporter's verified readers, or
``anneal.hf.load_weights``) straight into the model before ``deepspeed.initialize``, as
``model.init_from`` is: so a checkpoint saved by any number of ranks, at any ZeRO stage or
tensor-parallel degree, scores on 1..N ranks at any ZeRO stage and tensor-parallel degree.
The engine has no optimizer (nothing is trained) and no scheduler.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping

import torch

from anneal.config.ds_schema import degrees
from anneal.dist import world_size
from anneal.errors import UserError
from anneal.eval.lm import unsupported_layout
from anneal.model import ModelPreset
from anneal.resolution import ds as ds_config
from anneal.resolution import parallel
from anneal.train.engine import build_scoring_engine

log = logging.getLogger(__name__)

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def scoring_ds_config(
    ds: dict, *, preset: ModelPreset, world: int, source: str, fast_bf16: bool
) -> tuple[dict, parallel.Layout]:
    """``ds`` (a run's resolved ds_config, or a file's with its ``--set`` overrides) made to
    score on ``world`` ranks: no optimizer and no scheduler (their ``"auto"`` values go with
    them), a batch of one sample per data-parallel replica (DeepSpeed checks the product; the
    scorer feeds its own batches), bf16 only where the device has fast bf16; and its layout,
    checked as a launch's (``anneal.resolution.parallel.layout``). ZeRO-1 and -2 partition only
    the optimizer's state and the gradients, neither of which scoring has (DeepSpeed refuses
    them without an optimizer): every rank holds the whole weights as at stage 0, which is
    what they score at. Sequence parallelism is refused (``anneal.eval.lm.unsupported_layout``
    says why); a run trained with it scores at ``sequence_parallel_size`` 1
    (``anneal.cli.eval_target``)."""
    ds = {
        k: v for k, v in json.loads(json.dumps(ds)).items() if k not in ("optimizer", "scheduler")
    }
    why = unsupported_layout(degrees(ds).tp, degrees(ds).sp)
    if why is not None:
        raise UserError(f"{source}: {why}", every_rank=True)
    layout = parallel.layout(ds, preset, world_size=world, source=source)
    zero = ds.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("stage") in (1, 2):
        ds["zero_optimization"] = {**zero, "stage": 0}
    ds.update(dict.fromkeys(_BATCH_KEYS, 1), train_batch_size=layout.data_parallel)
    if ds_config.bf16_enabled(ds) and not fast_bf16:
        log.info("%s: no fast bf16 on this device: scoring in fp32", source)
        ds = ds_config.set_bf16(ds, False)
    return ds, layout


def copy_weights_(
    model: torch.nn.Module, tensors: Mapping[str, Callable[[], torch.Tensor]], *, gather=None
) -> int:
    """Copy each parameter's tensor (``tensors[name]()``, whole, any float dtype) into
    ``model``, one module at a time, as ``--init-from`` copies a Hugging Face directory's
    (``anneal.hf.load_weights.copy_into_``, ``gather`` as there). Returns the tensors copied.
    The caller has checked the names and shapes (``anneal.hf.source.check_shapes``)."""
    from anneal.hf.load_weights import copy_into_

    return copy_into_(model, lambda name: tensors[name](), gather=gather)["tensors"]


def scoring_engine(
    preset: ModelPreset,
    ds: dict,
    *,
    source: str,
    load_weights: Callable[[torch.nn.Module, object], object],
):
    """The scoring engine of ``preset`` on this process's world (``scoring_ds_config``), its
    weights filled by ``load_weights``. Collective: every rank calls it."""
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    fast_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    ds, layout = scoring_ds_config(
        ds, preset=preset, world=world_size(), source=source, fast_bf16=fast_bf16
    )
    log.info("scoring on %s", layout.describe())
    return build_scoring_engine(
        preset, ds, tensor_parallel=layout.tensor_parallel, load_weights=load_weights
    )
