"""Pre-flight: everything that can be checked on the launch host, before anything starts.

The recipe's flags go through the recipe's own parser and the whole launch is resolved for the
world size the hostfile or ``--num-gpus`` gives (ds_config strictly, batch arithmetic, data
directory, resume target and its tokenizer) by the same code the ranks run. Then: free disk in
the run directory for two checkpoints of this model, and ssh to every host, all failures listed
together. Every problem is a ``UserError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from anneal.errors import UserError
from anneal.hardware import DEFAULT_MFU
from anneal.planning import forecast, memory, memory_tp
from anneal.planning.float8_costs import Float8Setting

SSH_TIMEOUT_S = 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preflight:
    """What pre-flight resolved: the launch the ranks will make, and the forecast."""

    launch: object  # anneal.resolution.resolve.Launch
    world_size: int
    device_type: str
    checkpoint_bytes: int
    forecast: forecast.Forecast


def recipe_config(recipe: str, recipe_args: list[str], *, device_type: str):
    """(RunConfig, overrides) exactly as the recipe will build them from ``recipe_args``."""
    from anneal.cli.recipe import config_from_args, load_recipe

    spec = load_recipe(recipe)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            return config_from_args(
                list(recipe_args), prog=recipe, on_cpu=device_type == "cpu", **spec
            )
    except SystemExit as e:
        text = err.getvalue().strip()
        if e.code == 0:  # --help among the recipe flags
            raise UserError(f"recipe flags of {recipe}:\n{text}") from None
        why = text.splitlines()[-1].split("error: ", 1)[-1] if text else f"exit {e.code}"
        raise UserError(
            f"{recipe}: the recipe flags after '--' do not parse: {why}. "
            f"`python {recipe} --help` lists them (e.g. -- --ds-config zero2_bf16.json)."
        ) from None


def world_size(
    hosts: dict[str, int] | None, *, num_gpus: int | None, num_nodes: int | None, source: str = ""
) -> int:
    """Ranks DeepSpeed's runner starts for this hostfile and flags."""
    if num_gpus is not None and num_gpus < 1:
        raise UserError(
            f"--num-gpus {num_gpus}: the number of GPUs (ranks) to start on each node must be "
            f"at least 1. Leave --num-gpus out to use every GPU of the node (every slot of the "
            f"hostfile), or give e.g. --num-gpus 2."
        )
    if num_nodes is not None and num_nodes < 1:
        raise UserError(
            f"--num-nodes {num_nodes}: the number of nodes must be at least 1. Leave it out to "
            f"use every host of the hostfile, or give e.g. --num-nodes 2."
        )
    if hosts is None:
        if num_nodes not in (None, 1):
            raise UserError(f"--num-nodes {num_nodes}: without --hostfile there is one node.")
        if num_gpus is not None:
            return num_gpus
        import torch

        return max(1, torch.cuda.device_count())
    if num_nodes is not None:
        if not 1 <= num_nodes <= len(hosts):
            raise UserError(
                f"--num-nodes {num_nodes}: {source} lists {len(hosts)} hosts, so it must be "
                f"1..{len(hosts)}. Add hosts to the hostfile or ask for fewer nodes."
            )
        hosts = dict(list(hosts.items())[:num_nodes])
    return sum(min(s, num_gpus) if num_gpus else s for s in hosts.values())


def resolve(cfg, overrides, *, world_size: int, device_type: str):
    """``anneal.resolution.resolve.resolve_launch``: the ranks' own resolution, for this world size,
    and their check of the in-loop tasks (``anneal.eval.in_loop.check_launch``)."""
    from anneal.eval.in_loop import check_launch
    from anneal.resolution.batch_share import check_batch_share
    from anneal.resolution.resolve import resolve_launch

    launch = resolve_launch(cfg, overrides, world_size=world_size, device_type=device_type)
    check_launch(launch)
    check_batch_share(launch)
    return launch


def checkpoint_bytes(launch) -> int:
    """Bytes of one checkpoint: 16-bit (or fp32) weights plus fp32 master weights and Adam's
    two moments, over all ranks (anneal/planning/memory.py's model states without gradients).
    Under tensor parallelism each rank of a group saves the replicated parameters (embedding,
    norms) again beside its slices: t x (replicated + sharded / t)."""
    zero = memory.ZeroSetup.from_ds_config(launch.ds_config)
    tp = launch.layout.tensor_parallel
    weights, _, optimizer, _ = memory.model_state_bytes(
        tp * memory_tp.params_per_gpu(launch.preset, tp), dataclasses.replace(zero, stage=0), 1
    )
    return int(weights + optimizer)


def check_disk(out: Path, *, need_bytes: int) -> None:
    probe = Path(out).resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need_bytes:
        raise UserError(
            f"--out {out}: {memory.format_bytes(free)} free on its file system ({probe}), but "
            f"two checkpoints of this model need {memory.format_bytes(need_bytes)} (weights and "
            f"optimizer state, anneal/planning/memory.py). Free space, or choose an --out on a "
            f"larger "
            f"file system."
        )


def check_ssh(hosts: list[str], *, timeout_s: int = SSH_TIMEOUT_S) -> None:
    """Every host must run ``true`` over ssh without a prompt; all failures are listed."""
    if shutil.which("ssh") is None:
        raise UserError(
            "ssh is not installed on this host, and DeepSpeed's runner (pdsh) needs it to start "
            "the other nodes. Install openssh-client, or start each node with --no-ssh "
            "(or skip this check with --no-ssh-check)."
        )

    def probe(host: str) -> str | None:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout_s}", host, "true"]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s + 5, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            return f"{host}: no answer in {timeout_s + 5} s"
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            return f"{host}: {why}"
        return None

    with ThreadPoolExecutor(max_workers=min(64, len(hosts))) as pool:
        failures = [f for f in pool.map(probe, hosts) if f]
    if failures:
        raise UserError(
            f"{len(failures)} of {len(hosts)} hosts do not answer ssh "
            f"(`ssh -o BatchMode=yes HOST true`, {timeout_s} s timeout): "
            + "; ".join(failures)
            + ". DeepSpeed's runner starts every node through ssh without a password: set up "
            "keys and known_hosts for these hosts, remove them from the hostfile, or pass "
            "--no-ssh-check if they are reachable another way."
        )


def peak_flops(device_type: str, *, gpu: str | None, ranks_per_host: int) -> float:
    """FLOP/s of one device for the forecast: this host's CPU shared by its ranks; on GPUs
    ``gpu``'s, else this host's GPU, else anneal.hardware's DEFAULT_GPU."""
    import torch

    from anneal import hardware

    if device_type == "cpu":
        return hardware.device_peak_flops(torch.device("cpu")) / max(1, ranks_per_host)
    if gpu:
        return hardware.get_gpu(gpu).peak_flops
    if torch.cuda.is_available():
        return hardware.device_peak_flops(torch.device("cuda", 0))
    return hardware.get_gpu(hardware.DEFAULT_GPU).peak_flops


def fp8_peak_flops(device_type: str, *, gpu: str | None) -> float | None:
    """Float8 FLOP/s of one device for the forecast, as ``peak_flops`` picks the device; None
    on a CPU or a GPU without float8 units."""
    import torch

    from anneal import hardware

    if device_type == "cpu":
        return None
    if gpu:
        return hardware.get_gpu(gpu).fp8_peak_flops
    if torch.cuda.is_available():
        return hardware.device_fp8_peak_flops(torch.device("cuda", 0))
    return hardware.get_gpu(hardware.DEFAULT_GPU).fp8_peak_flops


def preflight(
    *,
    recipe: str,
    recipe_args: list[str],
    world_size: int,
    device_type: str,
    mfu: float | None,
    gpu: str | None = None,
    ranks_per_host: int = 1,
) -> Preflight:
    """Resolve and check the launch; UserError before anything is written or started."""
    from anneal.eval.in_loop import forecast_tokens

    cfg, overrides = recipe_config(recipe, recipe_args, device_type=device_type)
    launch = resolve(cfg, overrides, world_size=world_size, device_type=device_type)
    ckpt = checkpoint_bytes(launch)
    check_disk(Path(launch.out), need_bytes=2 * ckpt)
    if mfu is not None and not 0 < mfu <= 1:
        raise UserError(f"--mfu {mfu}: a fraction of peak in (0, 1]; 40% is --mfu 0.4.")
    peak = peak_flops(device_type, gpu=gpu, ranks_per_host=ranks_per_host)
    mfu, mfu_source = _mfu(launch, mfu, peak=peak, device_type=device_type)
    start = 0
    if launch.resume_from is not None:
        from anneal.resilience import checkpoint

        start = (checkpoint.read_manifest(Path(launch.resume_from)) or {}).get("step", 0)
    fc = forecast.make(
        preset=launch.preset,
        ds_config=launch.ds_config,
        tokens_per_step=launch.tokens_per_step,
        world_size=world_size,
        max_steps=launch.cfg.train.max_steps,
        start_step=start,
        mfu=mfu,
        peak_flops=peak,
        activation_checkpointing=launch.cfg.model.activation_checkpointing,
        eval_tokens=forecast_tokens(launch.cfg.train, start_step=start),
        device_type=device_type,
        mfu_source=mfu_source,
        float8=Float8Setting(
            recipe=launch.cfg.train.float8,
            layers=launch.cfg.train.float8_layers,
            compiled=launch.cfg.train.compile != "off",
        ),
        fp8_peak_flops=fp8_peak_flops(device_type, gpu=gpu),
    )
    return Preflight(
        launch=launch,
        world_size=world_size,
        device_type=device_type,
        checkpoint_bytes=ckpt,
        forecast=fc,
    )


def _mfu(launch, given: float | None, *, peak: float, device_type: str) -> tuple[float, str]:
    """(MFU, where it comes from) for the forecast: ``--mfu``; on a CPU, the rate a run of the
    same shape measured on this machine (``anneal.planning.measured_rate``); else assumed."""
    from anneal.planning import measured_rate

    if given is not None:
        return given, "--mfu"
    if device_type == "cpu" and (known := measured_rate.recall(measured_rate.shape_key(launch))):
        rate, run = known
        return rate / peak, f"measured here by {run}"
    return DEFAULT_MFU[device_type], ""


def resume_notes(pre: Preflight) -> list[str]:
    """The launch's line about a resume at another layout, and the conversion it will do
    (``anneal.resolution.parallel.describe_resume_change``): the pre-flight says it before the job
    starts, as the ranks do when they load."""
    return [n for n in pre.launch.notes if n.startswith("resume: ")]
