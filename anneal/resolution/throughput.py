"""The launch's throughput settings, ``train.float8`` and ``train.compile`` (docs/throughput.md),
checked before any rank builds a model: what does not compose on this DeepSpeed, this device or
this install is one paragraph here, not a traceback from inside ``deepspeed.initialize``."""

from __future__ import annotations

from importlib import metadata

from anneal.config.run import TrainConfig
from anneal.errors import UserError
from anneal.model import ModelPreset
from anneal.model.float8_rule import choose_float8, dense_linear_shapes

TORCHAO_PIN = "torchao==0.18.0"
"""The torchao that requirements.txt pins: its float8 training runs on this torch (2.13), on
the CPU build too (``torch._scaled_mm``)."""
TORCHAO_OLDEST = (0, 18)


def installed_torchao() -> str | None:
    """The installed torchao's version (from its package metadata: torchao is not imported),
    or None."""
    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return None


def torchao_refusal(version: str | None) -> str | None:
    """Why ``train.float8`` cannot run with torchao ``version`` (None: not installed), or
    None when it can."""
    fix = f"Install the pinned one: pip install '{TORCHAO_PIN}' (requirements.txt)"
    if version is None:
        return (
            f"--set train.float8: float8 training is torchao's, and torchao is not installed "
            f"in this Python. {fix}, or train without it: --set train.float8=off."
        )
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        major_minor = (0, 0)
    if major_minor < TORCHAO_OLDEST:
        return (
            f"--set train.float8: torchao {version} is installed, older than the 0.18 whose "
            f"float8 training Anneal is tested with (the recipes' names and filters changed "
            f"before it). {fix}, or train without it: --set train.float8=off."
        )
    return None


def check_throughput(
    train: TrainConfig, preset: ModelPreset, *, tensor_parallel: int, device_type: str
) -> list[str]:
    """Refuse what does not compose (UserError, one paragraph); the notes of what does."""
    notes = []
    if train.float8 != "off":
        _check_float8(train, preset, tensor_parallel=tensor_parallel)
    if train.compile == "deepcompile" and device_type != "cuda":
        raise UserError(
            "--set train.compile=deepcompile: DeepSpeed's DeepCompile runs its passes through "
            "a CUDA operator, so it cannot run on a CPU. Use --set train.compile=torch "
            "(torch.compile on the engine, which runs here) or off."
        )
    return notes


def _check_float8(train: TrainConfig, preset: ModelPreset, *, tensor_parallel: int) -> None:
    refusal = torchao_refusal(installed_torchao())
    if refusal:
        raise UserError(refusal)
    if tensor_parallel > 1:
        raise UserError(
            f"--set train.float8={train.float8} with tensor parallelism (AutoTP, "
            f"tensor_parallel.autotp_size={tensor_parallel}): AutoTP replaces each nn.Linear with "
            f"its own sharded layer, and float8's Float8Linear is an nn.Linear, so one would "
            f"undo or wrap the other; the pair is untested anywhere, and Anneal will not train "
            f"with it until a GPU test shows it right. Train float8 with ZeRO (stage 1 to 3) "
            f"and no AutoTP, or keep AutoTP with --set train.float8=off."
        )
    if preset.is_moe:
        raise UserError(
            f"--set train.float8={train.float8} with the sparse model {preset.name}: its experts "
            f"are fused tensors that AutoEP replaces, not Linear layers, so float8 would reach "
            f"only the attention and the router, and a router in float8 is untested. Train "
            f"float8 on a dense preset, or this one with --set train.float8=off."
        )


def describe_float8(train: TrainConfig, preset: ModelPreset) -> str:
    """The launch's float8 line: the layers the rule picks at this shape, when the shape is a
    dense preset's (a Hugging Face model's are named when the engine is built)."""
    head = f"train.float8={train.float8}, train.float8_layers={train.float8_layers}"
    if preset.hf_config is not None:
        return f"{head}: the layers in float8 are named when the engine is built"
    choice = choose_float8(
        dense_linear_shapes(preset), recipe=train.float8, layers=train.float8_layers
    )
    return f"{head}; {choice.describe(train.float8)}"
