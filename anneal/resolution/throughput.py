"""The launch's throughput settings, ``train.float8`` and ``train.compile`` (docs/throughput.md),
checked before any rank builds a model: what does not compose on this DeepSpeed, this device or
this install is one paragraph here, not a traceback from inside ``deepspeed.initialize``."""

from __future__ import annotations

from importlib import metadata

from anneal.config.run import TrainConfig
from anneal.errors import UserError
from anneal.model import ModelPreset
from anneal.model.float8_rule import choose_float8, dense_linear_shapes, sparse_refusal

TORCHAO_PIN = "torchao==0.18.0"
"""The torchao that requirements.txt pins: its float8 training runs on this torch (2.13), on
the CPU build too (``torch._scaled_mm``)."""
TORCHAO_OLDEST = (0, 18)
DEEPCOMPILE_PASSES = {1: ["z1"], 3: ["z3"]}
"""DeepCompile's passes by ZeRO stage (DeepSpeed 0.19.8 has ZeRO-1's and ZeRO-3's)."""


def deepcompile_section(zero_stage: int) -> dict:
    """The DeepSpeed config's ``compile`` section of ``train.compile=deepcompile`` at
    ``zero_stage`` (``check_throughput`` refused the stages without passes)."""
    return {"deepcompile": True, "passes": list(DEEPCOMPILE_PASSES[zero_stage])}


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
    train: TrainConfig, preset: ModelPreset, layout, *, zero_stage: int, device_type: str
) -> list[str]:
    """Refuse what does not compose (UserError, one paragraph); the notes of what does."""
    notes = []
    if train.float8 != "off":
        _check_float8(train, preset, tensor_parallel=layout.tensor_parallel)
    if train.compile != "off" and preset.is_moe:
        raise UserError(
            f"--set train.compile={train.compile} with the sparse model {preset.name}: AutoEP's "
            f"routing and expert loops are untested under torch.compile here. Train it with "
            f"--set train.compile=off."
        )
    if train.compile == "deepcompile":
        _check_deepcompile(train, layout, zero_stage=zero_stage, device_type=device_type)
    if train.compile == "torch":
        notes.append(
            "train.compile=torch: the first step compiles the model (inductor; tens of seconds "
            "on a CPU), shown apart as its compile_s; its tokens_per_s leaves that out"
        )
    return notes


def _check_deepcompile(train: TrainConfig, layout, *, zero_stage: int, device_type: str) -> None:
    """DeepCompile (DeepSpeed 0.19.8): a CUDA GPU, a stage with passes (ZeRO-1's z1, ZeRO-3's
    z3), no AutoTP or Ulysses beside it and no float8 (untested together)."""
    base = "--set train.compile=deepcompile"
    if device_type != "cuda":
        raise UserError(
            f"{base}: DeepSpeed's DeepCompile runs its passes through a CUDA operator, so it "
            f"cannot run on a CPU. Use --set train.compile=torch (torch.compile on the engine, "
            f"which runs here) or off."
        )
    if zero_stage not in (1, 3):
        raise UserError(
            f"{base} at ZeRO stage {zero_stage}: DeepSpeed 0.19.8's DeepCompile has passes for "
            f"ZeRO-1 (z1) and ZeRO-3 (z3) only. Set ds.zero_optimization.stage=1 or 3, or use "
            f"--set train.compile=torch."
        )
    if layout.tensor_parallel > 1 or layout.sequence_parallel > 1:
        raise UserError(
            f"{base} with tensor or sequence parallelism: DeepCompile's own autotp and autosp "
            f"passes replace DeepSpeed's AutoTP and Ulysses, which Anneal uses, and the two are "
            f"untested together. Use --set train.compile=torch, or no TP/SP."
        )
    if train.float8 != "off":
        raise UserError(
            f"{base} with --set train.float8={train.float8}: DeepCompile's passes over torchao's "
            f"float8 layers are untested. Use --set train.compile=torch with float8 (torchao's "
            f"own pairing), or DeepCompile with --set train.float8=off."
        )


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
    if reason := sparse_refusal(preset):
        raise UserError(
            f"--set train.float8={train.float8} with the sparse model {preset.name}: {reason}. "
            f"Train float8 on a dense preset, or this one with --set train.float8=off."
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


def describe_throughput(train: TrainConfig, preset: ModelPreset, zero_stage: int) -> list[str]:
    """The launch's lines for ``train.compile`` and ``train.float8`` (none when both are off)."""
    lines = []
    if train.compile == "torch":
        lines.append("train.compile=torch: engine.compile() (torch.compile, inductor)")
    elif train.compile == "deepcompile":
        passes = ", ".join(DEEPCOMPILE_PASSES[zero_stage])
        lines.append(f"train.compile=deepcompile: DeepSpeed's DeepCompile, passes {passes}")
    if train.float8 != "off":
        lines.append(describe_float8(train, preset))
    return lines
