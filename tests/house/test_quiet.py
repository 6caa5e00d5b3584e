"""A run prints what the user needs, once (issue 33, item 10). A real 2-rank run through
DeepSpeed's runner (the session's shared ``two_ranks`` run) shows none of torch's deprecation
FutureWarnings that DeepSpeed's ZeRO calls trigger and none of its ranks says "Setting
accelerator to CPU"; the filters that do it are narrow (another FutureWarning of the same
module, the same text from another module and any other DeepSpeed warning still show); the
launch's notes are logged by rank 0 only; ``python -m launcher run`` tells DeepSpeed's own
processes the accelerator only where they would find none themselves."""

from __future__ import annotations

import importlib.util
import logging
import re
import subprocess
import sys

from anneal.dist import accelerator_env
from anneal.train.entry import log_notes
from tests.conftest import ROOT, env

CPU_NOTICE = "Setting accelerator to CPU"


def test_a_two_rank_run_prints_no_third_party_noise(shared_runs):
    """The 2-rank run's whole output: no FutureWarning at all (there were 8: torch's
    ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` deprecations through DeepSpeed,
    and transformers' ``is_gradient_checkpointing``, Anneal's own call), and DeepSpeed's CPU
    notice only from the two processes DeepSpeed's ``deepspeed`` command starts before any rank
    (its runner and its per-node launcher; 4 before: each rank logged it too)."""
    done = shared_runs["two_ranks"][1]
    out = done.stdout + done.stderr
    assert "FutureWarning" not in out, out
    assert out.count(CPU_NOTICE) == 2, out
    assert not re.search(r"\[rank[1-9][0-9]*\] WARNING anneal\.train", out), out


FILTERS = r"""
import logging, sys, warnings
# What a plain run shows (once per place), set before anneal's filters as -W would be:
warnings.simplefilter("default")
import anneal
for i, name in enumerate(sys.argv[1:]):
    module, text = name.split(":", 1)
    warnings.warn_explicit(text, FutureWarning, "f.py", i + 1, module=module)
logging.basicConfig()
ds = logging.getLogger("DeepSpeed")
ds.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable")
ds.warning("another DeepSpeed warning")
"""


def test_the_filters_hide_only_the_known_messages():
    """In a fresh interpreter that imports ``anneal``: torch's two deprecation warnings from
    ``torch.distributed.c10d_logger`` (where DeepSpeed's calls surface) and DeepSpeed's CPU
    notice are hidden; another FutureWarning of that module, the same text from another module
    and another DeepSpeed warning are shown."""
    hidden = [
        "torch.distributed.c10d_logger:`torch.distributed.all_gather_into_tensor` is deprecated.",
        "torch.distributed.c10d_logger:`torch.distributed.reduce_scatter_tensor` is deprecated.",
    ]
    shown = [
        "torch.distributed.c10d_logger:`torch.distributed.all_reduce_coalesced` is deprecated.",
        "mine.module:`torch.distributed.all_gather_into_tensor` is deprecated.",
    ]
    done = subprocess.run(
        [sys.executable, "-c", FILTERS, *hidden, *shown],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env(),
        check=True,
    )
    err = done.stderr
    assert "f.py:3: FutureWarning" in err and "f.py:4: FutureWarning" in err, err
    assert "f.py:1:" not in err and "f.py:2:" not in err, err
    assert CPU_NOTICE not in err and "another DeepSpeed warning" in err, err


def test_launch_notes_are_logged_by_rank_0_only(caplog):
    """Every rank resolves the same launch; its notes (a batch rounded up, fp32 on a CPU, a
    cooldown branch) are logged once, by rank 0, as warnings; a resume at another layout, the
    routine path of docs/resilience.md, as INFO (issue 46, point 8)."""
    notes = ["global batch rounded up", "cooldown branch of runs/p", "resume: step4 was saved on"]
    with caplog.at_level(logging.INFO, logger="anneal.train.entry"):
        log_notes(notes, rank=1)
        assert caplog.records == []
        log_notes(notes, rank=0)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", notes[0]),
        ("WARNING", notes[1]),
        ("INFO", notes[2]),
    ]


def test_the_launcher_names_the_accelerator_only_where_deepspeed_finds_none(monkeypatch):
    """``accelerator_env``: DS_ACCELERATOR=cpu exactly where DeepSpeed's detection on this host
    gives the CPU; nothing where the environment names an accelerator already."""
    import deepspeed

    found = deepspeed.get_accelerator().device_name()
    assert accelerator_env({}) == ({"DS_ACCELERATOR": "cpu"} if found == "cpu" else {})
    assert accelerator_env({"DS_ACCELERATOR": "cuda"}) == {}


NOISE = r"""
import logging, sys
import anneal
from tqdm import tqdm
logging.basicConfig(level=logging.INFO)
list(tqdm(range(3), desc="Building contexts"))
logging.getLogger("lm_eval.evaluator").info("Running loglikelihood requests")
logging.getLogger("lm_eval.api.task").warning("an lm-eval warning")
"""


def test_lm_evals_info_lines_and_tqdm_bars_stay_out_of_a_log():
    """Issue 46, point 7: in a process whose stderr is a file (a log, Slurm's output), a tqdm
    bar (lm-eval draws one per task and request type) draws nothing, and lm-eval's INFO lines
    are left out; its warnings still show."""
    e = {k: v for k, v in env().items() if k != "TQDM_DISABLE"}
    done = subprocess.run(
        [sys.executable, "-c", NOISE], capture_output=True, text=True, cwd=ROOT, env=e, check=True
    )
    assert "Building contexts" not in done.stderr and "\r" not in done.stderr, done.stderr
    assert "Running loglikelihood requests" not in done.stderr
    assert "an lm-eval warning" in done.stderr


def test_activation_checkpointing_is_turned_on_without_transformers_deprecation():
    """Issue 46, point 7: every run with activation checkpointing (the continued-pretraining
    recipe's default) printed transformers' FutureWarning that ``gradient_checkpointing_enable``
    is deprecated; Anneal calls its current name, non-reentrant, and it is on."""
    import warnings

    import transformers

    from anneal.train.engine import checkpoint_activations

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint_activations(model)
    assert [str(w.message) for w in caught if w.category is FutureWarning] == []
    assert model.is_activation_checkpointing


AUTOEP = r"""
import logging
import anneal
from deepspeed.utils import logger
logging.basicConfig(level=logging.INFO)
logger.warning("autoep_size=1 means every rank owns all experts with no AllToAll. AutoEP ...")
logger.warning("another DeepSpeed warning")
kernels = logging.getLogger("deepspeed.moe.ep_kernels")
kernels.info("Triton not available; using pure-PyTorch CPU fallback for permutation ...")
kernels.info("another ep_kernels line")
"""


def test_a_sparse_runs_autoep_notices_are_left_out():
    """Issue 46, point 7 (the tiny MoE journey): DeepSpeed AutoEP's notice that autoep_size=1
    keeps every expert on every rank, and its kernels' that a CPU has no Triton, each by its
    exact text and logger; the same loggers' other lines still show."""
    done = subprocess.run(
        [sys.executable, "-c", AUTOEP], capture_output=True, text=True, cwd=ROOT, env=env()
    )
    out = done.stdout + done.stderr  # DeepSpeed's logger writes to stdout
    assert done.returncode == 0, out
    assert "autoep_size=1" not in out and "Triton not available" not in out
    assert "another DeepSpeed warning" in out and "another ep_kernels line" in out


def test_lm_evals_tokenizing_bar_stays_out_of_a_log(monkeypatch, capsys):
    """Issue 46, point 7 (the downstream journey, rerun): lm-eval's "Tokenizing inputs" bar,
    whose ``disable=`` lm-eval passes itself (so ``TQDM_DISABLE`` does not reach it), is off in
    Anneal's adapter where ``TQDM_DISABLE`` is set. Anneal's ``loglikelihood`` and lm-eval's
    own tokenizing loop, on two requests; the model's part answers without a model."""
    from lm_eval.api.instance import Instance

    from anneal.eval.lm import EngineLM

    class Probe(EngineLM):
        prefix_token_id = 0

        def __init__(self):  # no engine: only the tokenizing loop runs
            pass

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return [1] * len(string)

        def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
            return [(0.0, True)] * len(requests)

    monkeypatch.setenv("TQDM_DISABLE", "1")
    requests = [
        Instance("loglikelihood", {}, ("Question: which?\nAnswer:", f" {a}"), 0) for a in "ab"
    ]
    assert Probe().loglikelihood(requests) == [(0.0, True)] * 2
    err = capsys.readouterr().err
    assert "Tokenizing inputs" not in err and "\r" not in err, err


def test_torchaos_import_notices_are_hidden_and_nothing_else_of_theirs():
    """Where torchao is installed (float8 training), transformers imports it with any model:
    its warning that a compiled GPU kernel of its own (``torchao/_C*.so``) does not load, and
    torch's notice on an enum of torchao's, are hidden; the same words about another file or
    another module's enum, and any other warning of those loggers, still show."""
    import enum

    import anneal  # noqa: F401 (installs the filters)

    class TorchaoEnum(enum.Enum):
        A = 1

    class OtherEnum(enum.Enum):
        A = 1

    TorchaoEnum.__module__ = "torchao.quantization.quantize_"

    def shown(name: str, msg: str, *args) -> bool:
        record = logging.LogRecord(name, logging.WARNING, "f.py", 1, msg, args, None)
        return logging.getLogger(name).filter(record)

    lib = "/venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    assert not shown("torchao", f"Failed to load {lib}: Could not load this library: {lib}")
    assert shown("torchao", "Failed to load /elsewhere/mine.so: no such file")
    assert shown("torchao", "Skipping import of cpp extensions")
    notice = (
        "%s is an Enum subclass and is now natively supported by torch.compile as an opaque "
        "value type. Calling register_constant() on Enum subclasses is deprecated"
    )
    assert not shown("torch.utils._pytree", notice, TorchaoEnum)
    assert shown("torch.utils._pytree", notice, OtherEnum)
    assert shown("torch.utils._pytree", "another pytree warning")


def test_a_process_that_imports_anneal_does_not_import_torchao():
    """transformers imports torchao, where installed, with any model (0.3-0.55 s of CPU a
    process, and its notices), if ``importlib.util.find_spec`` finds it; after ``import anneal``
    it finds none (a process of its own: this one's float8 tests import torchao), and Anneal's
    float8 path makes it importable again (anneal/__init__.py)."""
    from anneal.train.float8 import import_torchao

    code = "import importlib.util, anneal; print(importlib.util.find_spec('torchao'))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert (done.returncode, done.stdout.split()) == (0, ["None"]), done.stderr[-2000:]
    import_torchao()
    assert importlib.util.find_spec("torchao") is not None  # installed (requirements.txt)
