"""Building the engine: resolve a launch for the live world (``resolve_run``), the model
(partitioned at construction under ZeRO-3) and ``deepspeed.initialize``, called here and nowhere
else; the process setup before it (process group, device, CPU threads)."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from anneal.config.run import RunConfig
from anneal.config.schedule import WarmupDecay
from anneal.dist import init_distributed, rank, setup_logging, world_size
from anneal.eval import in_loop
from anneal.model import (
    build_model,
    hf_model_config,
    init_weights_,
    model_class,
    muon_param_groups,
    param_groups,
)
from anneal.model.attention import SDPA
from anneal.resolution.batch_share import check_batch_share
from anneal.resolution.resolve import Launch, resolve_launch
from anneal.resolution.throughput import deepcompile_section
from anneal.train import experts, loss, sequence
from anneal.train.compiled import compile_engine
from anneal.train.float8 import convert_float8
from anneal.train.muon_engine import cpu_newton_schulz, muon_tags


def resolve_run(cfg: RunConfig, overrides: list[str] = ()) -> Launch:
    """Resolve this launch for the live world and device (see ``anneal.resolution.resolve``), and
    check its in-loop tasks (``anneal.eval.in_loop.check_launch``) and its batch against its
    train split (``anneal.resolution.batch_share``)."""
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    launch = resolve_launch(
        cfg,
        overrides,
        world_size=world_size(),
        device_type="cuda" if device.type == "cuda" else "cpu",
        fast_bf16=device.type == "cuda" and torch.cuda.is_bf16_supported(),
    )
    in_loop.check_launch(launch)  # train.eval_tasks: a layout or spec they cannot run with
    check_batch_share(launch)  # a batch that is a large share of the train split
    return launch


def build_engine(launch: Launch):
    """Model (partitioned at construction under ZeRO-3; its weights initialised, or read from
    ``model.init_from``) -> the DeepSpeed engine."""
    ds = launch.ds_config
    preset = launch.preset
    # DeepSpeed's process groups for AutoTP, or for Ulysses (which also swaps the attention)
    mpu = _tensor_parallel_groups(launch.layout.tensor_parallel) or sequence.register(launch)
    model, gather = _build_model(preset, ds, mpu, attention=launch.attention.implementation)
    if preset.init_from is None:
        init_weights_(
            model, std=preset.initializer_range, seed=launch.cfg.train.seed, gather=gather
        )
    else:
        from anneal.hf.load_weights import load_pretrained_

        load_pretrained_(model, Path(preset.init_from["path"]), gather=gather)
    if launch.layout.sequence_parallel > 1:
        sequence.check_model(model, launch.attention.implementation)
    if launch.cfg.model.activation_checkpointing:
        checkpoint_activations(model)
    if launch.cfg.train.float8 != "off":  # before initialize: DeepSpeed sees the float8 modules
        _train_in_float8(model, launch.cfg.train)
    opt_params = ds["optimizer"]["params"]
    schedule = launch.schedule
    engine_config = {k: v for k, v in ds.items() if k != "scheduler"}
    if launch.cfg.train.compile == "deepcompile":
        engine_config["compile"] = deepcompile_section(launch.zero_stage)
    engine = _initialize(
        model=model,
        model_parameters=_optimizer_groups(model, opt_params, launch),
        config=engine_config,
        lr_scheduler=lambda opt: WarmupDecay(opt, schedule),
        mpu=mpu,
    )
    if ds.get("zero_optimization", {}).get("stage", 0) == 0 and not launch.bf16:
        _keep_fp32_clip_norm(engine)
    train = launch.cfg.train
    if train.loss == "chunked" and not loss.install(
        engine.module, chunk_tokens=train.loss_chunk_tokens
    ):
        # After initialize, as AutoTP replaces the head with its vocabulary-sharded layer.
        logging.getLogger(__name__).warning(
            "train.loss=chunked: the model's output layer (%s) is not a bias-free nn.Linear; "
            "the loss runs plain, over the full logits",
            type(engine.module.get_output_embeddings()).__name__,
        )
    if train.compile != "off":  # after the chunked loss: the head is compiled with it
        compile_engine(engine)
    return engine


def _train_in_float8(model, train) -> None:
    """torchao's float8 training on the layers ``anneal.model.float8_rule`` picks; which, said
    once (rank 0)."""
    choice = convert_float8(model, recipe=train.float8, layers=train.float8_layers)
    if rank() == 0:
        logging.getLogger(__name__).info("%s", choice.describe(train.float8))


def build_scoring_engine(preset, ds: dict, *, tensor_parallel: int, load_weights):
    """An engine that only scores: ``preset``'s model built as training builds it (partitioned
    at construction under ZeRO-3, AutoTP's groups made first), ``load_weights(model, gather)``
    fills it (``gather`` as ``load_pretrained_`` takes it; None without ZeRO-3), and
    ``deepspeed.initialize`` is given no optimizer and no scheduler: no optimizer state is
    allocated and no optimizer is built (nor any extension compiled for one). In eval mode."""
    mpu = _tensor_parallel_groups(tensor_parallel)
    model, gather = _build_model(preset, ds, mpu)
    load_weights(model, gather)
    config = {k: v for k, v in ds.items() if k not in ("optimizer", "scheduler")}
    engine = _initialize(model=model, config=config, mpu=mpu)
    engine.eval()
    return engine


def _build_model(preset, ds: dict, mpu, *, attention: str = SDPA):
    """(the model, ``gather``): partitioned at construction under ZeRO-3, where ``gather(params)``
    makes a module's parameters whole and writable on rank 0 (None otherwise); with
    ``attention`` (the launch's, ``anneal.model.attention``; a scoring engine's is SDPA)."""
    import deepspeed

    if ds.get("zero_optimization", {}).get("stage", 0) != 3:
        return build_model(preset, attention=attention), None
    # Import transformers' model code (and torch._dynamo with it) before zero.Init patches
    # tensor construction; importing it inside fails with a dynamo signature mismatch.
    model_class(hf_model_config(preset))
    # partitioned over the data-parallel group, as the engine's ZeRO-3 will partition
    # (under Ulysses: the sequence-data-parallel group, all ranks)
    dp_group = _partition_group(mpu)
    with deepspeed.zero.Init(config_dict_or_path=ds, data_parallel_group=dp_group, mpu=mpu):
        model = build_model(preset, attention=attention)
    return model, lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def _initialize(**kwargs):
    """``deepspeed.initialize``, called here and nowhere else in Anneal; the engine. A sparse
    model's AutoEP runs under ``experts.autoep_registry_fix`` (its transformers 5 repair), and
    every engine under ``muon_tags`` (Muon's halves by ``anneal.model.muon``)."""
    import deepspeed

    sparse = kwargs["config"].get("expert_parallel", {}).get("enabled", False)
    with experts.autoep_registry_fix() if sparse else contextlib.nullcontext(), muon_tags():
        engine, *_ = deepspeed.initialize(**kwargs)
    return engine


def _optimizer_groups(model, opt_params: dict, launch: Launch) -> list[dict]:
    """AdamW's decay / no-decay groups; under Muon (``opt_params`` has ``muon_lr``, which the
    resolution writes) Muon's beside them (``anneal.model.muon``), its Newton-Schulz eager and
    in fp32 on a CPU (``cpu_newton_schulz``)."""
    if "muon_lr" not in opt_params:
        return param_groups(model, weight_decay=opt_params["weight_decay"])
    if launch.device_type == "cpu":
        cpu_newton_schulz()
    return muon_param_groups(
        model.named_parameters(),
        weight_decay=opt_params.get("weight_decay", 0.0),
        adam_lr=opt_params["adam_lr"],
        muon_lr=opt_params["muon_lr"],
        scale=launch.cfg.optim.muon_scale,
    )


def _tensor_parallel_groups(tp: int):
    """DeepSpeed's own tensor- and data-parallel process groups (``deepspeed.utils.groups``,
    groups of ``tp`` consecutive ranks), made before ``deepspeed.initialize`` and given to it as
    its ``mpu``; None without tensor parallelism. Given no mpu, DeepSpeed's config would count
    the whole world, not world / tp, against ``train_batch_size``; AutoTP then finds these
    groups made and shards over them, as its own ``_configure_tensor_parallel_states`` would."""
    if tp == 1:
        return None
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
    return groups


def _partition_group(mpu):
    """The group ZeRO-3 partitions parameters over: the mpu's data-parallel group (AutoTP),
    Ulysses' sequence-data-parallel group, or None (the world) without an mpu."""
    if mpu is None:
        return None
    if hasattr(mpu, "get_sequence_data_parallel_group"):
        return mpu.get_sequence_data_parallel_group()
    return mpu.get_data_parallel_group()


def data_replica(engine) -> tuple[int, int]:
    """(this rank's index among the data-parallel replicas, their number), from the engine's
    own data-parallel process group: the ranks of one tensor-parallel group share an index, so
    they read the same samples (AutoTP needs identical inputs across a group); so do the ranks
    of a sequence-parallel group (``anneal.train.sequence.sp_data_replica``)."""
    import torch.distributed as dist

    replica = sequence.sp_data_replica(engine)
    if replica is not None:
        return replica
    return dist.get_rank(group=engine.data_parallel_group), engine.dp_world_size


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


def setup_process(collective_timeout_s: float = 1800.0) -> None:
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


def checkpoint_activations(model) -> None:
    """transformers' activation checkpointing, non-reentrant, through its current name
    (``gradient_checkpointing_enable`` is a deprecated alias that warns on every run)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
