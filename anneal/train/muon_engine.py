"""Muon in the engine (issue 42): DeepSpeed 0.19.8's ``use_muon`` tags replaced by the one rule
(``anneal.model.muon.takes_muon``), and its Newton-Schulz run eagerly and in fp32 on a CPU.

DeepSpeed tags each parameter in ``deepspeed.set_optimizer_flags``, which ``initialize`` calls
and the engine calls again after AutoEP swaps the experts in; its rule (2-D and up, no
``embed`` or ``lm_head`` in the name) puts a MoE router on Muon. ``muon_tags`` re-tags after
each call, so the optimizer's halves are the ones the launch printed.

DeepSpeed wraps ``muon_update`` and both Newton-Schulz iterations in ``torch.compile``. On a CPU
the first update of each shape then compiles with inductor: 9.1 s for the four shapes of a
small Llama against 0.01 s eager, and 0.052 s against 0.044 s for the next ten passes (one
process, 2026-12-07, this 2-core machine shared with other work), so every rank of every CPU
launch would pay seconds to tens of seconds for nothing. ``cpu_newton_schulz`` puts the
functions' own eager versions in their place.

DeepSpeed also runs the iteration in fp16 (``gram``) or bf16 (``standard``) wherever its
accelerator reports support (``ns_compute_dtype``), and its CPU accelerator reports both: an
fp32 run on a CPU orthogonalized in half precision, and ZeRO-1, 2 and 3, which reduce the
gradients in another order, then differed by 1.8e-4 relative in the grad norm of step 1 and
7.5e-6 in the loss of step 10 (tests/train/test_muon_layouts.py, before this). A CPU has no
fast half-precision units (``anneal.resolution.ds.precision``), so there it runs in fp32.
"""

from __future__ import annotations

import contextlib

from anneal.model import takes_muon
from anneal.model.muon import layer_shape

_COMPILED = ("muon_update", "zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz")


@contextlib.contextmanager
def muon_tags():
    """Within: ``deepspeed.set_optimizer_flags`` followed by ``takes_muon``'s tags."""
    import deepspeed

    tag_as_deepspeed = deepspeed.set_optimizer_flags

    def tag(config_class, model) -> None:
        tag_as_deepspeed(config_class, model)
        if config_class.optimizer_name == "muon":
            for name, p in model.named_parameters():
                p.use_muon = takes_muon(name, layer_shape(p))

    deepspeed.set_optimizer_flags = tag
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = tag_as_deepspeed


def cpu_newton_schulz() -> None:
    """DeepSpeed's Muon update and Newton-Schulz iterations without ``torch.compile`` and in
    fp32, for this process (a CPU rank). Its callers import ``muon_update`` when they run,
    except ``muon_optimizer`` (ZeRO off), which holds its own name for it; the iterations read
    ``ns_compute_dtype`` when they run."""
    import torch
    from deepspeed.runtime.zero.muon import muon_optimizer, original_muon

    for name in _COMPILED:
        fn = getattr(original_muon, name)
        setattr(original_muon, name, getattr(fn, "_torchdynamo_orig_callable", fn))
    muon_optimizer.muon_update = original_muon.muon_update
    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
