"""The training loop on the DeepSpeed engine.

One optimizer step (docs/training.md, "One optimizer step"): zero grads (DeepSpeed sets them to None
after each step) -> forward (bf16 when the ds_config enables it) -> cross-entropy on next tokens
-> backward (DeepSpeed divides the loss by the accumulation steps and reduces gradients only at
the boundary) -> global L2 clip to ``gradient_clipping`` -> AdamW with decoupled decay on 2-D+
weights -> warmup-cosine LR step. ``deepspeed.initialize`` is called in exactly one place:
``build_engine``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from anneal import checkpoint, faults, forecast, heartbeat, rundir
from anneal import model as modellib
from anneal import progress as live
from anneal.config import RunConfig, check_ranges
from anneal.data.stream import PackedSplit, TokenStream, validation_windows
from anneal.dist import (
    init_distributed,
    is_main_process,
    print0,
    rank,
    setup_logging,
    world_size,
)
from anneal.errors import UserError
from anneal.guard import Guard
from anneal.hardware import device_peak_flops
from anneal.metrics import MetricsLogger
from anneal.plan import Plan, resolve_plan
from anneal.preempt import Preemption
from anneal.rundir import RunDir
from anneal.schedule import WarmupCosine

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainState:
    """Everything that advances during training besides the engine's own state."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan_run(cfg: RunConfig, overrides: list[str] = ()) -> Plan:
    """Resolve this launch for the live world and device (see ``anneal.plan``)."""
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    return resolve_plan(
        cfg,
        overrides,
        world_size=world_size(),
        device_type="cuda" if device.type == "cuda" else "cpu",
        fast_bf16=device.type == "cuda" and torch.cuda.is_bf16_supported(),
    )


def build_engine(plan: Plan):
    """Model (partitioned at construction under ZeRO-3) -> the DeepSpeed engine."""
    import deepspeed

    ds = plan.ds_config
    zero3 = ds.get("zero_optimization", {}).get("stage", 0) == 3
    preset = plan.preset
    if zero3:
        # Import transformers' model code (and torch._dynamo with it) before zero.Init patches
        # tensor construction; importing it inside fails with a dynamo signature mismatch.
        import transformers.models.llama.modeling_llama  # noqa: F401

        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = modellib.build_model(preset)
        gather = lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=0)  # noqa: E731
    else:
        model = modellib.build_model(preset)
        gather = None
    modellib.init_weights_(
        model, std=preset.initializer_range, seed=plan.cfg.train.seed, gather=gather
    )
    if plan.cfg.model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt_params = ds["optimizer"]["params"]
    sched = ds["scheduler"]["params"]
    engine_config = {k: v for k, v in ds.items() if k != "scheduler"}
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=modellib.param_groups(model, weight_decay=opt_params["weight_decay"]),
        config=engine_config,
        lr_scheduler=lambda opt: WarmupCosine(opt, **sched),
    )
    if ds.get("zero_optimization", {}).get("stage", 0) == 0 and not plan.bf16:
        _keep_fp32_clip_norm(engine)
    return engine


def _keep_fp32_clip_norm(engine) -> None:
    """Without ZeRO in fp32, DeepSpeed clips through ``clip_fp32_gradients`` and drops the norm
    it computed (``get_global_grad_norm()`` stays None); keep it, as its other paths do."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip() -> None:
        engine._global_grad_norm = clip_grad_norm_(
            parameters=engine.module.parameters(),
            max_norm=engine.gradient_clipping(),
            mpu=engine.mpu,
        )

    engine.clip_fp32_gradients = clip


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, V) logits against (B, T) next tokens, in fp32."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def _step_collective(
    loss: torch.Tensor,
    device: torch.device,
    preemption: Preemption | None,
    *,
    memory_per_rank: bool = False,
) -> tuple[float, dict, bool]:
    """The one collective (and the one host sync) of a step, on every rank: this rank's mean
    loss, its memory and whether it got a preemption signal, gathered from all ranks. Returns
    the mean loss over ranks, the memory fields of the row, and whether any rank was signalled.
    """
    flag = float(preemption is not None and preemption.signalled)
    mem = float(live.local_memory_bytes(device))
    mine = torch.stack([
        loss.to(torch.float64),
        torch.tensor(mem, dtype=torch.float64, device=device),
        torch.tensor(flag, dtype=torch.float64, device=device),
    ])  # fmt: skip
    if world_size() > 1:
        parts = [torch.empty_like(mine) for _ in range(world_size())]
        dist.all_gather(parts, mine)
        mine = torch.stack(parts)
    rows = mine.view(-1, 3).tolist()
    memory = live.memory_fields([r[1] for r in rows], per_rank=memory_per_rank)
    loss_mean = sum(r[0] for r in rows) / len(rows)
    return loss_mean, memory, any(r[2] > 0 for r in rows)


def train_step(
    engine, stream: TokenStream, state: TrainState, plan: Plan, fault=None, preemption=None
) -> dict:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches. ``fault``: the
    injected faults (``anneal.faults``), None in a normal run. ``preemption``: the run's
    ``Preemption``; this step's collective sets its ``requested_by_any`` on every rank.

    The micro-batch losses stay on the device and are read once, at the end of the step, in
    the step's one collective (``_step_collective``)."""
    start = time.perf_counter()
    device = engine.device
    lr = engine.get_lr()[0]  # the LR this step applies
    loss_sum, wait_s = torch.zeros((), dtype=torch.float64, device=device), 0.0
    if fault is not None:
        fault.step_start(state.step + 1, engine.module)
    for _ in range(plan.grad_accum):
        t0 = time.perf_counter()
        samples = stream.indices_at(stream.position) if fault is not None else None
        x, y = stream.next_batch()
        wait_s += time.perf_counter() - t0
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = next_token_loss(engine(input_ids=x).logits, y)
        if fault is not None:
            loss = fault.loss(loss, state.step + 1, samples)
        engine.backward(loss)  # scales by 1/accumulation; reduces only at the boundary
        engine.step()  # at the boundary: clip, AdamW, LR step, zero grads
        loss_sum += loss.detach()
    if fault is not None:
        fault.step_end(state.step + 1, engine.module)
    loss_mean, memory, preempt = _step_collective(
        loss_sum / plan.grad_accum,
        device,
        preemption,
        memory_per_rank=plan.cfg.train.memory_per_rank,
    )
    if preemption is not None:
        preemption.requested_by_any = preempt
    state.step += 1
    state.tokens += plan.ds_config["train_batch_size"] * plan.seq_len
    grad_norm = engine.get_global_grad_norm()
    elapsed = time.perf_counter() - start
    return {
        "kind": "train",
        "step": state.step,
        "tokens": state.tokens,
        "loss": loss_mean,
        "lr": lr,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "tokens_per_s": plan.ds_config["train_batch_size"] * plan.seq_len / elapsed,
        "data_wait_s": round(wait_s, 6),
        "data_wait_share": round(wait_s / elapsed, 6),  # of step time; prefetch keeps it < 1%
        **memory,
        "time": round(time.time(), 3),  # wall clock at the end of the step
    }


@torch.no_grad()
def validate(engine, val: PackedSplit, token_bytes: np.ndarray, plan: Plan) -> dict:
    """Loss on the fixed held-out windows; bits per UTF-8 byte so tokenizers compare."""
    engine.eval()
    device = engine.device
    byte_table = torch.from_numpy(token_bytes).to(device, torch.float64)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # nats, tokens, bytes
    for windows in validation_windows(
        val.n_windows,
        n_samples=plan.cfg.train.eval_samples,
        rank=rank(),
        world_size=world_size(),
        micro_batch=plan.micro_batch,
    ):
        x, y = val.batch([max(j, 0) for j in windows])  # -1: padding, weight 0
        x, y = x.to(device), y.to(device)
        weight = torch.tensor([float(j >= 0) for j in windows], dtype=torch.float64, device=device)
        logits = engine(input_ids=x).logits.float()
        nats = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # (B, T)
        sums += torch.stack([
            (nats.double().sum(1) * weight).sum(),
            weight.sum() * y.size(1),
            (byte_table[y].sum(1) * weight).sum(),
        ])  # fmt: skip
    if world_size() > 1:
        dist.all_reduce(sums)
    engine.train()
    nats, tokens, n_bytes = sums.tolist()
    val_loss = nats / tokens
    return {
        "kind": "val",
        "step": 0,
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss),
        "val_bpb": nats / math.log(2) / n_bytes,
    }


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def run(cfg: RunConfig, overrides: list[str] = ()) -> dict:
    """Train per ``cfg``. Returns a summary (final losses, tokens/s, run directory).

    Everything is checked (``resolve_plan``), the engine built and the checkpoint loaded before
    anything is written to the run directory; a launch that fails after that but before its
    first step puts the directory back as it found it (``RunDir``), so the corrected relaunch
    starts cleanly instead of meeting a config.json of a run that never trained."""
    check_ranges(cfg)  # before the process group: collective_timeout_s goes there
    _setup_process(cfg.train.collective_timeout_s)
    plan = plan_run(cfg, overrides)
    for note in plan.notes:
        log.warning(note)
    torch.manual_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    data_dir = Path(cfg.data.path)
    train_split = PackedSplit(data_dir, "train", seq_len=plan.seq_len)
    evaluate = cfg.train.eval_samples > 0
    val_split = PackedSplit(data_dir, "val", seq_len=plan.seq_len) if evaluate else None
    data = (train_split, val_split, np.load(data_dir / "token_bytes.npy"))
    print0(plan.describe())
    engine = build_engine(plan)
    recompute = getattr(engine.module, "is_gradient_checkpointing", False)
    print0(f"activation checkpointing {'on' if recompute else 'off'}")
    t0 = time.perf_counter()
    resume_from = plan.resume_from and checkpoint.verified_resume(
        plan.resume_from, fallback=cfg.resume == "auto"
    )
    timing = {"verify_s": round(time.perf_counter() - t0, 3)}
    guard = Guard(cfg.guard, run_dir=plan.out, resuming=resume_from is not None)
    client = None
    if resume_from is not None:
        t0 = time.perf_counter()
        client = checkpoint.load(engine, resume_from)  # scanned first (anneal.safeload)
        timing["load_s"] = round(time.perf_counter() - t0, 3)
    run_dir = RunDir.for_launch(plan)
    try:
        return _train(plan, engine, guard, run_dir, data, resume=(resume_from, client, timing))
    except BaseException:
        run_dir.undo()
        raise


def _train(plan: Plan, engine, guard: Guard, run_dir: RunDir, data, *, resume) -> dict:
    """The loop, from the engine (and checkpoint) ``run`` prepared to the summary."""
    cfg = plan.cfg
    train_split, val_split, token_bytes = data
    n_params = modellib.count_params(plan.preset)
    metrics = MetricsLogger(plan.out)
    state, position = TrainState(), 0
    resume_from, client, timing = resume
    if resume_from is not None:
        state = TrainState(step=client["step"], tokens=client["tokens"])
        position = guard.restore(engine, client, client["data"]["position"])
        metrics.event(state.step, "resume", checkpoint=str(resume_from), position=position,
                      **timing)  # fmt: skip
        print0(f"resumed from {resume_from} at step {state.step}")
    view = live.LiveView(
        plan.out, cfg=cfg, config_doc=plan.config_document(), start_step=state.step
    )
    stream = _open_stream(train_split, plan, position)
    fault = faults.from_env(rank())
    samples_per_step = plan.ds_config["train_batch_size"]
    flops_per_token = modellib.flops_per_token(plan.preset, seq_len=plan.seq_len)
    peak = device_peak_flops(engine.device)
    last_train, last_val = None, None
    end = min(cfg.train.stop_at_step or cfg.train.max_steps, cfg.train.max_steps)
    preemption = Preemption(plan.out)  # SIGUSR1/SIGTERM: checkpoint after the step, exit 75
    check = forecast.Check(plan.out, start_step=state.step)  # the launcher's forecast vs measured
    beat = heartbeat.start(plan.out, rank=rank(), world_size=world_size(),
                           timeout_s=cfg.train.heartbeat_timeout_s)  # fmt: skip
    exports = ExportAfterSave(cfg.train.export_every_save)
    try:
        while state.step < end:
            last_train = train_step(engine, stream, state, plan, fault, preemption)
            last_train["mfu"] = flops_per_token * last_train["tokens_per_s"] / (peak * world_size())
            metrics.write(last_train)
            run_dir.stepped = True
            check.after_step(last_train, plan.tokens_per_step, engine.device, metrics)
            view.update(last_train)
            step_samples = (stream.position - samples_per_step, stream.position)
            verdict = guard.check(last_train, engine, samples=step_samples, metrics=metrics)
            if verdict == "rewind":
                stream.close()
                client, position = guard.rewind(
                    engine, rundir.checkpoints_dir(plan.out), spike_step=state.step,
                    spike_end=stream.position, samples_per_step=samples_per_step, metrics=metrics,
                )  # fmt: skip
                state = TrainState(step=client["step"], tokens=client["tokens"])
                stream = _open_stream(train_split, plan, position)
                continue
            last_val = (
                maybe_validate(engine, val_split, token_bytes, plan, state, metrics) or last_val
            )
            if last_val is not None and last_val["step"] == state.step:
                view.update(last_val)
            maybe_checkpoint(engine, stream, plan, state, metrics, guard, exports=exports)
            beat.completed(state.step)
            if preemption.requested_by_any:  # any rank signalled (train_step's collective)
                ckpt = rundir.checkpoints_dir(plan.out)
                preemption.stop(step=state.step, ckpt_dir=ckpt, metrics=metrics,
                                save=lambda stream=stream, state=state: maybe_checkpoint(
                                    engine, stream, plan, state, metrics, guard, force=True,
                                    exports=exports,
                                ))  # fmt: skip
    except UserError:
        raise
    except Exception as e:
        beat.failed(e)  # names a rank that went silent, if one did
        raise
    finally:
        exports.close()
        beat.close()
        preemption.close()
        view.close()
        stream.close()
        metrics.close()
    if state.step >= cfg.train.max_steps:
        live.finish_run(plan.out)  # rank 0: RUN/plots/*.png, the health report
    return {
        "run_dir": str(plan.out),
        "step": state.step,
        "tokens": state.tokens,
        "train_loss": last_train and last_train["loss"],
        "tokens_per_s": last_train and last_train["tokens_per_s"],
        "val_loss": last_val and last_val["val_loss"],
        "val_bpb": last_val and last_val["val_bpb"],
        "params": n_params,
    }


def maybe_validate(engine, val, token_bytes, plan: Plan, state: TrainState, metrics) -> dict | None:
    """Validate every ``eval_every`` steps and after the last step (never without val data)."""
    if val is None or not _due(state.step, plan.cfg.train.eval_every, plan.cfg.train.max_steps):
        return None
    row = {**validate(engine, val, token_bytes, plan), "step": state.step}
    metrics.write(row)
    print0(f"step {state.step:>6} | val loss {row['val_loss']:.4f} | ppl {row['val_ppl']:.2f} | "
           f"bpb {row['val_bpb']:.4f}")  # fmt: skip
    return row


def _open_stream(split: PackedSplit, plan: Plan, position: int) -> TokenStream:
    return TokenStream(split, seed=plan.cfg.train.seed, rank=rank(), world_size=world_size(),
                       micro_batch=plan.micro_batch, position=position,
                       prefetch=plan.cfg.data.prefetch_batches)  # fmt: skip


def maybe_checkpoint(
    engine,
    stream: TokenStream,
    plan: Plan,
    state: TrainState,
    metrics,
    guard: Guard,
    force=False,
    exports: ExportAfterSave | None = None,
) -> None:
    """Checkpoint every ``save_every`` steps, after the last step and at ``stop_at_step``
    (``force``: now, for a preemption)."""
    train = plan.cfg.train
    if not force and not (
        _due(state.step, train.save_every, train.max_steps) or state.step == train.stop_at_step
    ):
        return
    if exports is not None:
        exports.wait()  # the previous export reads its tag; keep-K may remove it in this save
    tag_dir = checkpoint.save(
        engine,
        rundir.checkpoints_dir(plan.out),
        step=state.step,
        client_state={
            **state.state_dict(),
            "data": stream.state_dict(),
            "guard": guard.state_dict(),
        },
        keep_last=train.keep_last,
        keep_every=train.keep_every,
        model=dataclasses.asdict(plan.preset),
    )
    metrics.event(state.step, "checkpoint", path=str(tag_dir))
    if exports is not None:
        exports.on_checkpoint(tag_dir)


class ExportAfterSave:
    """``train.export_every_save``: rank 0 exports each checkpoint, once it is complete on every
    rank, to ``RUN/hf/<tag>`` in a child process (``anneal export``, verified), so that the
    exporter's memory and time never land in the training process and the other ranks go on to
    their next collective. One export at a time: the next save, and the end of the run, wait
    for the one before. A failed export is logged; the run and its checkpoint are fine."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and is_main_process()
        self._child = None  # (Popen, tag_dir)

    def on_checkpoint(self, tag_dir: Path) -> None:
        if not self.enabled:
            return
        import subprocess
        import sys

        self.wait()
        run = rundir.of_checkpoint(tag_dir)
        out = rundir.hf_dir(run, tag_dir.name)
        cmd = [sys.executable, "-m", "anneal.cli", "export", str(run), "--tag", tag_dir.name,
               "--out", str(out), "--force"]  # fmt: skip
        sys.stdout.flush()
        try:
            self._child = (subprocess.Popen(cmd, env=_child_env()), tag_dir)
        except OSError as e:
            log.error("export of %s could not start (%s); the checkpoint is intact", tag_dir, e)

    def wait(self) -> None:
        """Until the running export (if any) has finished; log it if it failed."""
        if self._child is None:
            return
        child, tag_dir = self._child
        self._child = None
        if child.wait() != 0:
            log.error(
                "export of %s failed (exit %d, its error above); training goes on, the "
                "checkpoint is intact: export it later with `anneal export`",
                tag_dir,
                child.returncode,
            )

    close = wait


def _child_env() -> dict:
    """This environment, with the directory that holds this ``anneal`` first on PYTHONPATH."""
    import anneal

    root = str(Path(anneal.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _setup_process(collective_timeout_s: float = 1800.0) -> None:
    import deepspeed

    init_distributed(collective_timeout_s)
    setup_logging()
    accelerator = deepspeed.get_accelerator()
    if accelerator.device_name() == "cpu":
        _share_cpu_threads()
    else:  # before anything asks for "the current device"
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _share_cpu_threads() -> None:
    """On CPU, split the cores between the ranks on this host unless OMP_NUM_THREADS says."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
