"""The typed run config: one small frozen dataclass per concern, and which of its keys may
change between launches of one run.

What a model size wants (preset, peak LR, warmup, global batch, run length) lives here, with
the recipe's defaults; what a cluster wants lives in the DeepSpeed JSON (``anneal.resolution.ds``).
``--set section.key=value`` overrides go through these types and the range of every numeric key
is checked (``anneal.config.run_checks``). User mistakes raise ``anneal.errors.UserError`` with
one paragraph naming the flag or key and how to fix it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
AUTO = "auto"
log = logging.getLogger(__name__)

RENAMED_KEYS = {
    "train.eval_every": "train.val_every",
    "train.eval_samples": "train.val_samples",
    "train.branch_from": "train.cooldown_from",
}
"""Config keys renamed (issue 40: validation is ``val``, downstream tasks ``eval``; a cooldown's
parent is ``cooldown_from``), old -> new.
The old names still read: in ``--set``, as a recipe's ``TrainConfig`` keyword and in the
``config.json`` of an older run; each says its new name once per process (``warn_renamed``)."""
_warned: set[str] = set()


def warn_renamed(old: str, new: str) -> None:
    """One warning per old name and process: ``old`` still works, ``new`` is its name now."""
    if old not in _warned:
        _warned.add(old)
        log.warning("%s is renamed %s; the old name still works for now: use %s", old, new, new)


# ---------------------------------------------------------------------------------------------
# Run config: one small frozen dataclass per concern.


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    preset: str = "tiny"
    """Name in anneal.model.PRESETS."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (HF gradient checkpointing)."""
    seq_len: int = 0
    """Context length in tokens; 0 takes the preset's."""
    hidden_size: int = 0
    """Shape overrides of the preset (0 keeps the preset's), for sweeps of custom sizes."""
    intermediate_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    rope_theta: float = 0.0
    """RoPE base frequency; 0 keeps the preset's (10,000). Long contexts train with a larger
    one: Llama 3 used 500,000 for up to 32K tokens, Code Llama 1,000,000."""
    num_experts: int = 0
    """Sparse presets: experts per layer; 0 keeps the preset's (as do the next two)."""
    experts_per_token: int = 0
    """Sparse presets: experts each token is routed to (top-k)."""
    expert_intermediate_size: int = 0
    """Sparse presets: the width of one expert's SwiGLU."""
    moe_aux_loss_coef: float | None = None
    """Sparse presets: weight of the router's load-balancing loss in the objective; None
    ("auto") keeps the preset's (0.01 for tiny-moe and OLMoE's shape, 0.001 for Qwen3's)."""
    moe_z_loss_coef: float | None = None
    """Sparse presets: weight of the router z-loss; None ("auto") keeps the preset's."""
    init_from: str = ""
    """A Hugging Face model directory to continue pretraining from (``--init-from``): its
    config.json gives the architecture (the preset's shape is not used; seq_len 0 keeps its
    max_position_embeddings) and its weights the start. Empty: the preset, initialised."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    path: str = "data/stdlib"
    """Prepared data directory (``anneal data prepare``)."""
    prefetch_batches: int = 4
    """Micro-batches read ahead of the model by a background thread."""
    document_mask: bool = False
    """Attention stays inside each document of a packed window: position ids restart after
    every end-of-text token and no token attends across one (training and validation alike;
    docs/training.md, "Documents in a packed window"). Off: every token attends to the whole
    window before it, as Anneal always trained (an older run resumes unchanged)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """What a model size wants from the optimizer and schedule; recipes set these from
    published tables. Each fills the matching ds_config value when the file says ``"auto"``."""

    lr: float = 3e-4
    """Peak learning rate (``optimizer.params.lr``); the schedule decays to ``min_lr_ratio`` x
    this."""
    global_batch_tokens: int = 524_288
    """Tokens per optimizer step over all ranks (``train_batch_size`` x seq_len); the
    accumulation steps follow from the ds_config's micro-batch and the data-parallel size."""
    warmup_tokens: int = 375_000_000
    """Linear warmup length in tokens (GPT-3 warmed up over 375M tokens at every size)."""
    warmup_max_share: float = 0.1
    """Cap of the ``"auto"`` warmup as a share of the run, so a short run always fits."""
    schedule: str = "cosine"
    """cosine | wsd, after the linear warmup (docs/training.md). cosine: decay from the peak to
    the floor over the rest of the run. wsd (warmup-stable-decay; MiniCPM, Hu et al. 2024): the
    peak held, then a decay over the last ``decay_share`` of the steps, so a run resumed with a
    larger ``--max-steps`` goes on at the peak and decays from its new end."""
    decay_share: float = 0.2
    """wsd: share of the run's steps in the final decay (Haegele et al. 2024, arXiv 2405.18392:
    a 20% cooldown matches or beats cosine of the same length)."""
    decay_shape: str = "1-sqrt"
    """wsd: shape of the final decay, linear | 1-sqrt | cosine (1-sqrt, lr = floor + (peak -
    floor) x (1 - sqrt(p)), did best in Haegele et al. 2024)."""
    min_lr_ratio: float | None = None
    """Floor of the schedule as a share of the peak LR. None (``--set optim.min_lr_ratio=auto``):
    the schedule's default, 0.0 under wsd and under cosine the ds_config's
    ``scheduler.params.cos_min_ratio`` (0.1 in every shipped config; 0.1 if it says "auto")."""
    cooldown_tokens: int = 0
    """A cooldown branch (``--cooldown-from``): tokens over which the LR decays from the parent's
    at the branch step to the floor, in ``decay_shape``; the branch ends after
    ceil(cooldown_tokens / tokens per step) steps (docs/training.md, "Cooldown branches")."""
    # Muon beside AdamW (issue 42; docs/training.md, "Muon"; anneal/model/muon.py).
    optimizer: str = "adamw"
    """adamw | muon. muon: the hidden matrices step with Muon (momentum orthogonalized by
    Newton-Schulz, DeepSpeed's MuonWithAuxAdam), the rest (embeddings, output head, norms,
    biases, MoE router) with AdamW; ``anneal.model.muon`` decides which is which."""
    muon_lr: float | None = None
    """muon: the Muon half's peak LR; None ("auto"): ``lr``, which the RMS-matched update
    (``muon_scale = "rms"``) makes mean what it means for AdamW."""
    muon_scale: str = "rms"
    """muon: rms (each matrix's update scaled to RMS 0.2, an AdamW update's: Moonlight, arXiv
    2502.16982, as OLMo-core's rms_norm; AdamW's LR carries over) | deepspeed (DeepSpeed's own
    sqrt(max(1, rows/cols)), whose LRs are about 0.02)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    max_steps: int = 300
    """Optimizer steps in the whole run; the LR schedule ends here."""
    stop_at_step: int = 0
    """Exit cleanly after this step without changing the schedule (a preemption drill); 0: off."""
    val_every: int = 100
    """Validate every N optimizer steps (and after the last); 0: only after the last."""
    val_samples: int = 64
    """Windows of the val split in each validation pass: the same held-out set every time,
    whatever the number of ranks."""
    eval_tasks: tuple[str, ...] = ()
    """Downstream tasks scored in the loop (docs/evaluation.md): lm-eval task names, paths to
    task YAMLs, or ``anneal_next_line`` (the task built from the data's val split); ``--set
    train.eval_tasks=a,b``. Empty: none. A task that fails to load or score is an
    ``eval_failed`` event and a warning, never the end of the run."""
    eval_tasks_every: int = 1000
    """Score ``eval_tasks`` every N optimizer steps (and after the last); 0: only after the
    last. A run that starts from step 0 is also scored before its first step (the baseline)."""
    eval_tasks_limit: int = 0
    """Items scored per task in each pass (the first N of its evaluated split); 0: all."""
    save_every: int = 100
    """Checkpoint every N optimizer steps (and after the last); 0: only after the last."""
    keep_last: int = 3
    """Intact checkpoints kept; older ones are deleted after a new one is complete."""
    keep_every: int = 0
    """Checkpoints whose step is a multiple of this are milestones, never deleted by
    ``keep_last``; 0: none."""
    async_save: bool = False
    """Save in the background (docs/resilience.md, "Asynchronous saves"): the loop waits only
    for a host copy of the state (one more copy of each rank's checkpoint in host memory for
    the run); the files, hashes and manifest are written behind the next steps, and the
    checkpoint counts (resume, export, eval, pruning) once every rank has written it. Off by
    default: on a CPU the write competes with the training for its cores, the gain measured
    here was small, and the host copy costs memory (docs/benchmarks.md, "Asynchronous saves")."""
    log_every: int = 10
    """Console line every N steps (metrics.jsonl gets every step)."""
    memory_per_rank: bool = False
    """Also write every rank's memory to each train row (``mem_gib``, a list) and TensorBoard
    (``train/mem_gib/rank<N>``). Off: the smallest, the largest and the rank of the largest
    only, so a row has the same size at any number of ranks."""
    heartbeat_timeout_s: float = 180.0
    """A rank whose heartbeat stops for this long (or whose process is gone) is reported by
    the others, which then exit non-zero (``anneal.resilience.heartbeat``); 0: no heartbeat."""
    collective_timeout_s: float = 1800.0
    """Timeout of every collective (``deepspeed.init_distributed``): the backstop for a hang
    the heartbeat does not see. Keep it above the longest checkpoint save or validation."""
    seed: int = 1234
    export_every_save: bool = False
    """Export a verified Hugging Face model to RUN/hf after every checkpoint (rank 0)."""
    wandb: bool = False
    """Mirror metrics to Weights & Biases when wandb is installed (offline unless configured)."""
    precision: str = "auto"
    """auto | bf16 | fp32. auto keeps the ds_config's bf16 where the device has fast bf16 and
    turns it off (saying so) where it does not, as on CPUs."""
    loss: str = "chunked"
    """chunked | plain (``anneal.train.loss``). chunked: the output projection and the
    cross-entropy run ``loss_chunk_tokens`` tokens at a time, gradients included, so the
    (tokens x vocab) logits are never held (training and validation); the same loss and
    gradients within 1e-6 relative in fp32. plain: the model's full logits, then
    cross-entropy. A head chunked cannot read (tensor-parallel, biased) runs plain."""
    loss_chunk_tokens: int = 512
    """Tokens per chunk of the chunked loss: its logits take 8 bytes x this x the vocabulary
    (512: the loss's memory 8x below plain's on the CPU benchmark, docs/benchmarks.md)."""
    compile: str = "off"
    """off | torch | deepcompile (docs/throughput.md). torch: ``engine.compile()`` once per
    process (inductor); deepcompile: DeepSpeed's compiler passes, which need a CUDA GPU."""
    float8: str = "off"
    """off | tensorwise | rowwise (docs/throughput.md): torchao's float8 training on the Linear
    layers ``float8_layers`` picks, before ``deepspeed.initialize``; the rest of the model and
    the optimizer stay in the run's precision. Speed needs an H100-class GPU."""
    float8_layers: str = "auto"
    """auto: the Linear layers that gain on an H100 (torchao's size thresholds; dimensions
    divisible by 16; the first Linear and the output head kept) | all: every Linear but the head
    whose dimensions are divisible by 16, small ones too (tests at tiny shapes)."""
    cooldown_from: str = ""
    """A checkpoint of a WSD run to branch a cooldown from (``--cooldown-from``): a tag directory
    (RUN/checkpoints/stepNNNNNNNN), or a run directory (its newest intact checkpoint). The new
    run in ``out`` starts from its weights, optimizer state and data position; the parent is
    only read. Empty: not a branch."""

    def __post_init__(self):
        if isinstance(self.eval_tasks, str):  # a recipe's "a,b", as --set takes it
            object.__setattr__(self, "eval_tasks", split_specs(self.eval_tasks))
        elif isinstance(self.eval_tasks, list):
            object.__setattr__(self, "eval_tasks", tuple(self.eval_tasks))


def _takes_renamed(cls, section: str):
    """``cls(old=value)`` for each renamed key of ``section`` (``RENAMED_KEYS``): the value goes
    to the new field (a recipe written before the rename), and ``obj.old`` reads the new field
    (a script that reads it); each said once per process (``warn_renamed``). The old names are
    no fields: ``dataclasses.fields``, ``to_dict`` and ``replace`` know only the new ones."""
    renamed = {
        old.removeprefix(f"{section}."): new.removeprefix(f"{section}.")
        for old, new in RENAMED_KEYS.items()
        if old.startswith(f"{section}.")
    }
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **kwargs):
        for old, new in renamed.items():
            if old in kwargs:
                warn_renamed(f"{section}.{old}", f"{section}.{new}")
                kwargs.setdefault(new, kwargs.pop(old))  # both given: the new name's value
        init(self, **kwargs)

    def reader(old: str, new: str) -> property:
        def read(self):
            warn_renamed(f"{section}.{old}", f"{section}.{new}")
            return getattr(self, new)

        return property(read, doc=f"Renamed ``{new}``: reads it, with a warning.")

    cls.__init__ = __init__
    for old, new in renamed.items():
        setattr(cls, old, reader(old, new))


_takes_renamed(TrainConfig, "train")


def split_specs(text: str) -> tuple[str, ...]:
    """``"a, b,"`` -> ``("a", "b")``: a comma-separated list of task specs."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """The loss-spike guard (``anneal.resilience.guard``; docs/resilience.md).

    A step is a spike when its loss or global grad norm is not finite, or when its loss (mean
    over ranks) exceeds both ``median + mad_k * 1.4826 * MAD`` and ``median * (1 + min_jump)``
    of the last ``window`` good steps. A non-finite step whose update DeepSpeed skipped is
    logged and passed over; any other spike rewinds to the newest checkpoint before it and
    skips the samples in between."""

    enabled: bool = True
    """Watch every step; false: log nothing, rewind nothing."""
    window: int = 100
    """Good steps of loss history behind the running median and MAD."""
    min_history: int = 20
    """Good steps seen before a finite loss can count as a spike (the loss falls fast and
    noisily at the start)."""
    mad_k: float = 6.0
    """Spike threshold in robust standard deviations (1.4826 x MAD) above the median."""
    min_jump: float = 0.25
    """A spike is also at least this share above the median (a floor when the loss is flat and
    its MAD tiny)."""
    skip_margin_steps: int = 1
    """Steps' worth of samples after the spiking step that the rewind skips as well."""
    max_rewinds: int = 3
    """Incidents (rewinds and skipped non-finite steps) allowed within ``span_steps`` before
    the run stops with a message naming the steps and samples."""
    span_steps: int = 1000
    """The window, in steps, in which ``max_rewinds`` is counted."""
    lr_scale: float = 1.0
    """Multiply the peak LR by this on each rewind (e.g. 0.8); 1 keeps it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    out: str
    ds_config: str
    resume: str = AUTO
    """auto (newest intact checkpoint in out/, if any) | none | PATH (a checkpoint tag dir)."""
    resume_explicit: bool = False
    """True when --resume was given: only then may a launch continue a run whose config
    differs from the one in out/config.json."""
    restart: bool = False
    """--restart: start over in ``out`` although it holds a run; that run's files (config,
    checkpoints, metrics, plots, report) are first moved to ``out/previous-<time>/``."""
    force: bool = False
    """--force: train in an ``out`` that holds files but no run (refused without it); the run's
    files go beside them, and none of them is replaced (``anneal.rundir.written_by_anneal``)."""
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    guard: GuardConfig = GuardConfig()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
