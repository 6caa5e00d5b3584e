"""Anneal: LLM pretraining on DeepSpeed.

Importing it does two things and nothing else. It makes the interpreter's exit cheap: at exit
every object still alive is frozen (``gc.freeze``, an ``atexit`` call), so the
interpreter's final collections no longer walk the millions of objects torch, transformers and
DeepSpeed keep. That walk cost 2-4 s of CPU in every process that imported them (a rank, the
report, each ``anneal`` command): a 1-rank run of 2 steps took 27.7, 16.6 and 14.6 s of CPU
without the freeze and 19.2, 12.3 and 10.9 s with it, pairs run back to back on a loaded machine
(docs/benchmarks.md, "The test suite"). Objects are still freed as their last reference goes;
only garbage in reference cycles is left to the operating system, as ``os._exit`` would, and
every file Anneal writes is closed (and flushed) by the code that opened it.

It keeps torchao (installed for ``train.float8``) from being imported by a process that does
not train in float8: transformers imports torchao with any model wherever it is installed
(``quantizers/auto.py``), which cost 0.3-0.55 s of CPU in every process that imports
transformers (``perf stat`` of ``from transformers import LlamaForCausalLM; import deepspeed``:
6.07-6.10 s without torchao installed, 6.39-6.64 s with it, 2026-12-07), and four warnings.
``sys.modules["torchao"]`` is set to None here, so that ``importlib.util.find_spec``
(transformers' test) finds nothing and transformers' own torchao integration stays off;
``anneal.train.float8.import_torchao`` clears it before Anneal's float8 path imports torchao.
A process that imported torchao before Anneal keeps it.

And it quiets some messages of the libraries below it that say nothing an Anneal run can act
on (each matched by its exact text, so any other warning of theirs still shows;
docs/observability.md, "What else it prints"):

- DeepSpeed's "Setting accelerator to CPU" warning, logged once by every process that imports
  DeepSpeed on a machine without a GPU. Anneal says which device a run trains on, once (the
  recipe's "no GPU found" line and the launch's "on cpu"). A filter on DeepSpeed's logger,
  installed here because DeepSpeed logs it while it is being imported.
- torch's FutureWarnings that ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are
  deprecated: DeepSpeed's ZeRO calls them (attributed to ``torch.distributed.c10d_logger``, the
  wrapper in between), Anneal does not.
- DeepSpeed AutoEP's two notices on a sparse model (``DEEPSPEED_AUTOEP_NOTICES``): that
  ``autoep_size=1`` keeps every expert on every rank, and that without Triton a CPU loops over
  the experts. Anneal's own layout line says both.
- torchao's import noise in a float8 run: on a CPU, or a torch built without its CUDA
  version, its compiled GPU kernels (``torchao/_C*.so``) fail to load with a warning each, and
  torch warns that two of its enums need no ``register_constant`` any more
  (``TORCHAO_IMPORT_NOTICES``). Neither touches float8 training, whose matrix multiply is
  torch's ``_scaled_mm``.
- lm-evaluation-harness's INFO lines (its loggers under ``lm_eval``: "Building contexts",
  "Running loglikelihood requests", ...): Anneal prints each scoring's own lines; lm-eval's
  warnings and errors still show.
- tqdm's progress bars where stderr is not a terminal (a log file, a pipe, Slurm's output):
  there a bar is a stream of carriage returns (lm-eval draws one per task and request type).
  ``TQDM_DISABLE=1`` is set for this process and its children, unless already set; Anneal's
  own bars, drawn only on a terminal, say ``disable=False`` and are not affected.
"""

import atexit
import gc
import logging
import os
import re
import sys
import warnings

DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU."
DEEPSPEED_AUTOEP_NOTICES = {
    "DeepSpeed": "autoep_size=1 means every rank owns all experts with no AllToAll.",
    "deepspeed.moe.ep_kernels": "Triton not available; using pure-PyTorch CPU fallback for ",
}
"""A sparse model's two notices from DeepSpeed's AutoEP, by logger: the degree 1 that Anneal
chose and says in its layout line, and the loop over experts a CPU runs (docs/moe.md)."""
TORCHAO_IMPORT_NOTICES = {
    "torchao": "Failed to load ",
    "torch.utils._pytree": "%s is an Enum subclass and is now natively supported by torch.",
}
"""torchao's import notices, by logger: a compiled GPU kernel of its wheel that this torch
cannot load, and torch's notice on two of torchao's enums (only when the enum is torchao's)."""
TORCH_DEPRECATIONS = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
)


def _not_the_cpu_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(DEEPSPEED_CPU_NOTICE)


def _not_an_autoep_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(DEEPSPEED_AUTOEP_NOTICES.get(record.name, "\0"))


def _not_a_torchao_notice(record: logging.LogRecord) -> bool:
    if not str(record.msg).startswith(TORCHAO_IMPORT_NOTICES.get(record.name, "\0")):
        return True
    if record.name == "torchao":  # the wheel's own compiled libraries, nothing else
        return "/torchao/_C" not in str(record.msg)
    args = record.args if isinstance(record.args, tuple) else ()
    return not (args and str(getattr(args[0], "__module__", "")).startswith("torchao."))


if _not_the_cpu_notice not in logging.getLogger("DeepSpeed").filters:
    logging.getLogger("DeepSpeed").addFilter(_not_the_cpu_notice)
for _name in DEEPSPEED_AUTOEP_NOTICES:
    if _not_an_autoep_notice not in logging.getLogger(_name).filters:
        logging.getLogger(_name).addFilter(_not_an_autoep_notice)
for _name in TORCHAO_IMPORT_NOTICES:
    if _not_a_torchao_notice not in logging.getLogger(_name).filters:
        logging.getLogger(_name).addFilter(_not_a_torchao_notice)
warnings.filterwarnings(
    "ignore",
    message=TORCH_DEPRECATIONS,
    category=FutureWarning,
    module=re.escape("torch.distributed.c10d_logger") + r"\Z",
)
logging.getLogger("lm_eval").setLevel(logging.WARNING)
if not (sys.stderr is not None and sys.stderr.isatty()):
    os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm when it is imported
atexit.register(gc.freeze)  # the exit's own collection skipped: see the docstring
if "torchao" not in sys.modules:
    sys.modules["torchao"] = None  # out of transformers' sight: see the docstring
