"""Hugging Face in: a model directory to continue pretraining from (``model.init_from``,
``--init-from DIR``), read and checked when the launch is resolved, before any engine is built
or any weight is read.

``pretrained_preset`` turns ``DIR/config.json`` into the run's model (``ModelPreset.hf_config``:
the architecture through transformers' Auto classes, RoPE settings and
``max_position_embeddings`` kept; the recipe's preset shape is not used) and records where the
weights come from (``ModelPreset.init_from``: the directory and the sha256 of its config, weight
files and tokenizer; sha256 is what the Hub lists for each file). Refused with one paragraph
each: an architecture transformers does not know or that Anneal has not verified, a quantized
checkpoint, a dtype that cannot be cast to a float, an activation transformers does not know,
a link that leads out of the directory (or out of its hub cache's ``blobs/``), missing,
truncated or malformed weight files (``anneal.hf.weight_files``), a config.json whose sizes
the weight files' headers contradict (checked before anything is allocated), a vocabulary
with more ids than the embedding has rows, and (``check_model_tokenizer``) data tokenized with
another tokenizer. ``anneal.hf.load_weights`` then copies the tensors into the model, each
checked finite as it is read.

The config step (``anneal.config``) and the engine (``anneal.train``) import this module,
``load_weights`` and ``weight_files`` only; none of them imports anything of the export
(docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

from anneal.files import sha256_file
from anneal.hf.expert_names import fused_shapes
from anneal.hf.weight_files import check_fit, check_links, weight_files, weight_shapes
from anneal.hf.weight_files import error as _error
from anneal.model import ModelPreset, build_model, preset_from_dict

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3_moe")
"""``model_type`` values verified end to end (tests/hf/test_init_from.py,
tests/hf/test_moe_hf.py)."""
SPARSE_MODEL_TYPES = ("qwen3_moe",)
"""The sparse ones: trained through DeepSpeed's AutoEP with its ``qwen3_moe`` preset, the one
Anneal's sparse core configures (``anneal.model.qwen3_moe_config``)."""
_SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_experts",
    "experts_per_token",
    "expert_intermediate_size",
)


def read_hf_config(directory: Path) -> dict:
    """``DIR/config.json`` as a dict, its architecture known to transformers and verified
    here, not quantized, its dtype one that casts and its activation one transformers knows;
    every link in ``DIR`` leads inside it or into its hub cache's ``blobs/``."""
    path = directory / "config.json"
    if not directory.is_dir():
        raise _error(
            directory,
            "no such directory. Give a local directory as save_pretrained "
            "writes it (config.json and model.safetensors).",
        )
    check_links(directory)
    _refuse_an_anneal_run(directory)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise _error(
            directory,
            "holds no config.json, so its architecture is unknown. Give "
            "the directory save_pretrained wrote (config.json beside the weights).",
        ) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _error(
            directory,
            f"config.json cannot be read as JSON ({e}). Restore it from where the model came from.",
        ) from None
    if not isinstance(doc, dict):
        raise _error(directory, "config.json is not a JSON object. Restore it.")
    _check_architecture(directory, doc)
    _check_sparse_layers(directory, doc)
    _check_dtype(directory, doc)
    _check_activation(directory, doc)
    return doc


def _refuse_an_anneal_run(directory: Path) -> None:
    """An Anneal run directory (its config.json and checkpoints/), or one of its checkpoints
    (``RUN/checkpoints/stepN``), is refused with the export that makes a model of it."""
    from anneal import rundir
    from anneal.resilience.checkpoint import step_of_tag

    tag = directory.parent.name == rundir.CHECKPOINTS and step_of_tag(directory.name) is not None
    run = rundir.of_checkpoint(directory) if tag else directory
    if tag or (directory / rundir.CONFIG).is_file() and rundir.checkpoints_dir(run).is_dir():
        raise _error(
            directory,
            f"an Anneal run{' checkpoint' if tag else ''}, not a Hugging Face model directory. "
            f"Export it to one first: `anneal export {run}{f' --tag {directory.name}' * tag} "
            f'--out MODEL_DIR`, then give --init-from MODEL_DIR (docs/observability.md, "Export '
            f'to Hugging Face").',
        )


def _check_architecture(directory: Path, doc: dict) -> None:
    from transformers import CONFIG_MAPPING

    model_type = doc.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise _error(
            directory,
            f"config.json names model_type {str(model_type)[:40]!r}, an architecture this "
            f"transformers does not know, so the model cannot be built. Continued pretraining "
            f"supports {', '.join(SUPPORTED)}: give a checkpoint of one of these (or upgrade "
            f"transformers if the checkpoint is newer than it).",
        )
    if model_type not in SUPPORTED and _is_sparse(doc):
        raise _error(directory, _sparse_refusal(model_type))
    if model_type not in SUPPORTED:
        raise _error(
            directory,
            f"model_type {model_type!r} is known to transformers but not verified with Anneal "
            f"(its loss against transformers, ZeRO layouts and export are checked for "
            f"{', '.join(SUPPORTED)} only). Give a checkpoint of one of these.",
        )
    if doc.get("quantization_config") is not None:
        raise _error(
            directory,
            "config.json has a quantization_config: the weights are quantized (GPTQ, AWQ, "
            "bitsandbytes, ...) and cannot be trained as they are. Give the full-precision "
            "release (bf16, fp16 or fp32 weights).",
        )


def _is_sparse(doc: dict) -> bool:
    """A Mixture-of-Experts config.json (transformers' names for the expert count)."""
    return any(
        isinstance(doc.get(k), int)
        for k in ("num_experts", "num_local_experts", "n_routed_experts")
    )


def _sparse_refusal(model_type: str) -> str:
    return (
        f"model_type {model_type!r} is a Mixture-of-Experts architecture that Anneal does not "
        f"train: its sparse models run through DeepSpeed's AutoEP with the qwen3_moe preset "
        f"(transformers' Qwen3MoeForCausalLM: every layer sparse, experts fused as "
        f"gate_up_proj and down_proj, no shared expert), whose loss, checkpoints and export "
        f"are verified; other layouts (Mixtral's, OLMoE's, Qwen2-MoE's shared expert, "
        f"DeepSeek's) are not. Continue from a qwen3_moe checkpoint (such as "
        f"Qwen/Qwen3-30B-A3B-Base), or convert this one's weights into a Qwen3-MoE directory "
        f"first (docs/training.md, 'Sparse models from Hugging Face')."
    )


def _check_sparse_layers(directory: Path, doc: dict) -> None:
    """A qwen3_moe config.json with dense layers among the sparse ones is refused: Anneal's
    sparse counts (active parameters, FLOPs) take every layer as sparse."""
    step, dense = doc.get("decoder_sparse_step", 1), doc.get("mlp_only_layers") or []
    if doc.get("model_type") in SPARSE_MODEL_TYPES and (step != 1 or dense):
        raise _error(
            directory,
            f"config.json gives decoder_sparse_step {step!r} and mlp_only_layers "
            f"{str(dense)[:40]}: some layers are dense. Anneal trains Qwen3-MoE models whose "
            f"every layer is sparse (decoder_sparse_step 1, mlp_only_layers [], as "
            f"Qwen3-30B-A3B and Qwen3-235B-A22B ship); give such a checkpoint.",
        )


def _check_dtype(directory: Path, doc: dict) -> None:
    import torch

    for key in ("dtype", "torch_dtype"):
        value = doc.get(key)
        if value is None or value == "auto":
            continue
        dtype = getattr(torch, str(value), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise _error(
                directory,
                f"config.json gives {key} {str(value)[:40]!r}, which is no floating-point "
                f"torch dtype the weights could be cast from (bfloat16, float16, float32). "
                f"Correct {key} in config.json, or give the full-precision release.",
            )


def _check_activation(directory: Path, doc: dict) -> None:
    from transformers.activations import ACT2FN

    value = doc.get("hidden_act", "silu")
    if not isinstance(value, str) or value not in ACT2FN:
        raise _error(
            directory,
            f"config.json gives hidden_act {str(value)[:40]!r}, an activation this "
            f"transformers does not know ({', '.join(sorted(ACT2FN)[:8])}, ...), so the model "
            f"cannot be built. Correct hidden_act in config.json (Llama, Mistral and Qwen2 use "
            f"'silu'), or upgrade transformers if the checkpoint is newer than it.",
        )


# --- the preset ------------------------------------------------------------------------------


def pretrained_preset(directory: Path, *, data_vocab: int, model) -> ModelPreset:
    """The run's model from ``DIR/config.json`` (``model`` is the run's ``ModelConfig``: its
    ``seq_len`` sets the training context, 0 keeps the checkpoint's ``max_position_embeddings``;
    a shape override is refused), with where its weights come from."""
    directory = Path(directory)
    doc = read_hf_config(directory)
    set_shape = [k for k in _SHAPE_KEYS if getattr(model, k)]
    if set_shape:
        raise _error(
            directory,
            f"model.{set_shape[0]} is set, but the shape of a pretrained model is its "
            f"config.json's. Drop --set model.{set_shape[0]} (model.seq_len may change).",
        )
    files = weight_files(directory)
    shapes = fused_shapes(weight_shapes(directory, files))  # a sparse model's experts fused
    preset = preset_from_dict(
        {**doc, "rope_theta": _rope_theta(doc)},
        source=f"--init-from {directory}/config.json",
        hint="The file is not a decoder's config as save_pretrained writes it.",
        name=str(doc["model_type"]),
    )
    rows = preset.vocab_size
    if data_vocab > rows:
        raise _error(
            directory,
            f"the data's tokenizer has {data_vocab:,} ids and the model's embedding "
            f"{rows:,} rows, so ids {rows:,} and up have no embedding. Prepare the data with "
            f"the model's own tokenizer: anneal data prepare --tokenizer {directory}.",
        )
    preset = _router_settings(directory, dataclasses.replace(preset, hf_config=doc), model)
    _check_against_weights(directory, preset, shapes)
    seq_len = model.seq_len or preset.seq_len
    _describe(directory, doc, preset, seq_len, recipe_preset=model.preset)
    init_from = {
        "path": str(directory.resolve()),
        "config_sha256": sha256_file(directory / "config.json"),
        "files": {p.name: sha256_file(p) for p in files},
        "tokenizer_sha256": _tokenizer_sha256(directory),
    }
    return dataclasses.replace(preset, seq_len=seq_len, init_from=init_from, nominal_params=None)


def _router_settings(directory: Path, preset: ModelPreset, model) -> ModelPreset:
    """A sparse checkpoint's router as Anneal trains it: the router's logits returned (the
    objective adds their load-balancing loss and z-loss; the Hub's releases ship
    ``output_router_logits`` false), ``model.moe_aux_loss_coef`` and ``model.moe_z_loss_coef``
    applied when set (else config.json's ``router_aux_loss_coef`` and no z-loss). On a dense
    checkpoint either setting is refused: it would be ignored."""
    coefs = {"aux_loss_coef": model.moe_aux_loss_coef, "z_loss_coef": model.moe_z_loss_coef}
    given = {k: float(v) for k, v in coefs.items() if v is not None}
    if preset.moe is None:
        if given:
            raise _error(
                directory,
                f"model.moe_{next(iter(given))} is set, but the model of config.json is dense "
                f"(no experts), so there is no router to weigh. Drop the setting.",
            )
        return preset
    return dataclasses.replace(
        preset,
        moe=dataclasses.replace(preset.moe, **given),
        hf_config={**preset.hf_config, "output_router_logits": True},
    )


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_BUILD_ERRORS = (KeyError, ValueError, TypeError, AttributeError, IndexError, ArithmeticError)
"""What transformers raises on a config.json it cannot build a model from."""


def _check_against_weights(directory: Path, preset, shapes: dict[str, tuple]) -> None:
    """config.json against the shapes in the weight files' headers, before anything is
    allocated: the embedding's rows and width and the number of layers first (a message
    naming the key), then every parameter of the model built on the meta device."""
    import torch

    embed = shapes.get("model.embed_tokens.weight")
    layers = {int(m.group(1)) for n in shapes if (m := _LAYER.match(n))}
    rows, width = embed if embed is not None and len(embed) == 2 else (None, None)
    said = None
    if rows is not None and rows != preset.vocab_size:
        said = "vocab_size", preset.vocab_size, f"model.embed_tokens.weight has {rows:,} rows"
    elif width is not None and width != preset.hidden_size:
        said = "hidden_size", preset.hidden_size, f"model.embed_tokens.weight is {width:,} wide"
    elif layers and layers != set(range(preset.num_hidden_layers)):
        fact = f"the weights hold {len(layers)} layers"
        said = "num_hidden_layers", preset.num_hidden_layers, fact
    if said:
        key, value, fact = said
        raise _error(
            directory,
            f"config.json gives {key} {value:,} and {fact}: the config.json of another model, "
            f"or one edited. Restore config.json from where the weights came from (every size "
            f"in it must match the weight files).",
        )
    try:
        with torch.device("meta"):
            built = build_model(preset)
    except _BUILD_ERRORS as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise _error(
            directory,
            f"transformers cannot build the model config.json describes ({type(e).__name__}: "
            f"{first}). Restore config.json from where the weights came from.",
        ) from None
    want = {n: tuple(p.shape) for n, p in built.named_parameters()}  # a tied matrix once
    tied = {n for n, _ in built.named_parameters(remove_duplicate=False)} - set(want)
    check_fit(directory, want, tied, shapes)


def _tokenizer_sha256(directory: Path) -> str | None:
    """``anneal.data.tokenizer.tokenizer_sha256`` of the directory, None without a tokenizer
    (``check_model_tokenizer`` refuses that once the data is known)."""
    from anneal.data.tokenizer import tokenizer_sha256

    if not any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        return None
    return tokenizer_sha256(directory)


def _rope_theta(doc: dict) -> float:
    rope = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    theta = doc.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None)
    return float(theta) if isinstance(theta, int | float) else 10000.0


def _describe(directory: Path, doc: dict, preset, seq_len: int, *, recipe_preset: str) -> None:
    original = preset.seq_len
    log.info(
        "model from --init-from %s: %s, hidden %d, %d layers, vocab %d, context %d; the "
        "recipe's preset %r is not used",
        directory,
        doc["model_type"],
        preset.hidden_size,
        preset.num_hidden_layers,
        preset.vocab_size,
        original,
        recipe_preset,
    )
    if seq_len > original:
        rope = doc.get("rope_parameters") or doc.get("rope_scaling")
        log.warning(
            "model.seq_len %d is longer than the checkpoint's max_position_embeddings %d: "
            "positions past %d were never trained, and RoPE is used as config.json sets it "
            "(theta %g, %s), not rescaled. To extend the context, set rope scaling in %s "
            "(e.g. rope_type yarn or a larger rope_theta, as Code Llama and Llama 3.1 did) "
            "and train on long documents.",
            seq_len,
            original,
            original,
            preset.rope_theta,
            rope or "no scaling",
            directory / "config.json",
        )


# --- the tokenizer ---------------------------------------------------------------------------


def check_model_tokenizer(preset: ModelPreset, *, meta: dict, data_dir: Path) -> None:
    """The data must be tokenized with the model's own tokenizer: the data's
    ``tokenizer_sha256`` is that of the tokenizer files in the model directory, or of what
    ``anneal data prepare --tokenizer DIR`` installs from them. UserError before any weight is
    read."""
    from anneal.data.tokenizer import tokenizer_sha256
    from anneal.data.tokenizer_hf import installed_sha256

    directory = Path(preset.init_from["path"])
    fix = (
        f"Prepare the data with the model's tokenizer: anneal data prepare --tokenizer {directory}"
    )
    if not any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise _error(
            directory,
            f"holds no tokenizer (tokenizer.json or tokenizer.model), so --data {data_dir} "
            f"cannot be checked against the ids the model learned. Copy the release's "
            f"tokenizer files into it; then {fix[0].lower()}{fix[1:]}.",
        )
    want = meta.get("tokenizer_sha256")
    if want == tokenizer_sha256(directory) or want == installed_sha256(directory):
        return
    raise _error(
        directory,
        f"its tokenizer is not the one --data {data_dir} was prepared with (that data's "
        f"tokenizer has {meta.get('vocab_size')} ids, sha256 {str(want)[:12]}...): the "
        f"same token ids would mean other text to the model. {fix} --out NEW.",
    )
