"""Model size presets -> transformers.LlamaConfig -> LlamaForCausalLM.

The model knows nothing about distribution. ZeRO-3 partitioning is applied by the caller
(``anneal.train``) wrapping construction in ``deepspeed.zero.Init``; this module only offers
``init_weights_`` so that the caller can re-apply the std-0.02 init that construction under
``zero.Init`` skips (embeddings otherwise come out with std 1.0).

Embeddings are untied (Llama-style): the LM head has its own matrix. Parameter counts below
therefore include two vocab x hidden matrices.

A run that continues a Hugging Face checkpoint (``model.init_from``) keeps that checkpoint's
architecture instead: its ``config.json`` rides in the preset (``hf_config``) and the model is
built through transformers' Auto classes (Llama, Qwen2, Mistral; ``anneal.hf.load``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import TYPE_CHECKING

from anneal.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: presets and counts are read by
    # commands that never build a model (`anneal data prepare`, `plan`, `estimate`), and
    # importing torch costs them 2-3 s and about 200 MB of resident memory.
    import torch
    from torch import nn

# Nominal vocabulary used to size the presets (Llama's). At training time the vocabulary comes
# from the prepared data and the real count is printed at start.
NOMINAL_VOCAB = 32000


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """Shape of a Llama-style decoder. Names follow transformers.LlamaConfig."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    seq_len: int
    """Training context length in tokens (also max_position_embeddings)."""
    nominal_params: float | None
    """The size the name promises, in parameters; None for ``tiny``."""
    vocab_size: int = NOMINAL_VOCAB
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    hf_config: dict | None = None
    """The ``config.json`` of a Hugging Face checkpoint this model starts from
    (``model.init_from``; ``anneal.hf.load``): its architecture, built through transformers'
    Auto classes, tied embeddings and RoPE settings included. None: a Llama preset."""
    init_from: dict | None = None
    """Where the starting weights come from: the directory and the sha256 of its config.json,
    of each weight file and of its tokenizer. None: initialised from ``seed``."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def with_vocab(self, vocab_size: int) -> ModelPreset:
        return dataclasses.replace(self, vocab_size=vocab_size)

    def heads_not_dividing(self, tp: int) -> list[str]:
        """The head counts (query, key-value) that ``tp`` tensor-parallel ranks cannot share
        out whole, as "name count" (AutoTP deals whole heads to each rank of a group)."""
        keys = ("num_attention_heads", "num_key_value_heads")
        return [f"{key} {getattr(self, key)}" for key in keys if getattr(self, key) % tp]


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in [
        ModelPreset(
            name="tiny",
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            seq_len=256,
            nominal_params=None,
            vocab_size=8192,
        ),
        ModelPreset(
            name="125m",
            hidden_size=768,
            intermediate_size=1792,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=12,
            seq_len=2048,
            nominal_params=125e6,
        ),
        ModelPreset(
            name="350m",
            hidden_size=1024,
            intermediate_size=2560,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            seq_len=2048,
            nominal_params=350e6,
        ),
        ModelPreset(
            name="1b",
            hidden_size=2048,
            intermediate_size=5504,
            num_hidden_layers=18,
            num_attention_heads=16,
            num_key_value_heads=16,
            seq_len=2048,
            nominal_params=1e9,
        ),
        ModelPreset(
            name="7b",
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            seq_len=4096,
            nominal_params=7e9,
        ),
    ]
}


PRETRAINED = "pretrained"
"""The preset name of a recipe whose model is always a Hugging Face checkpoint's
(``recipes/continue_pretraining.py``): it has no shape of its own."""


def get_preset(name: str) -> ModelPreset:
    if name == PRETRAINED:
        raise UserError(
            f"model.preset {PRETRAINED}: this recipe continues a pretrained model and has no "
            f"shape of its own. Give --init-from DIR, a Hugging Face model directory "
            f"(config.json, weights and tokenizer, as save_pretrained writes them)."
        )
    if name not in PRESETS:
        raise UserError(
            f"model.preset {str(name)[:40]!r}: no such preset. Choose one of "
            f"{', '.join(PRESETS)} (--set model.preset=NAME), or set the shape with "
            f"model.hidden_size, model.num_hidden_layers, ... on top of one."
        )
    return PRESETS[name]


SHAPE_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "seq_len",
    "vocab_size",
)
"""The sizes a model document must give as positive integers."""


def preset_from_dict(
    doc: dict, *, source: str, prefix: str = "", hint: str = "", name: str = "run"
) -> ModelPreset:
    """The one reader of a model's shape from a document: the ``model`` section of a run's
    config.json, a Hugging Face config.json (``max_position_embeddings`` is the context,
    ``num_key_value_heads`` defaults to the heads) or a flat object with the preset's fields.

    UserError naming ``source`` and the key (``prefix`` + key, e.g. ``model.hidden_size``),
    followed by ``hint``, when a size is not a positive integer or the heads do not divide.
    """
    fields = {f.name for f in dataclasses.fields(ModelPreset)}
    model = {k: v for k, v in doc.items() if k in fields}
    model["name"] = str(doc.get("name") or name)
    model.setdefault("nominal_params", None)
    model.setdefault("num_key_value_heads", model.get("num_attention_heads"))
    model.setdefault("seq_len", doc.get("max_position_embeddings", 2048))
    model.setdefault("vocab_size", NOMINAL_VOCAB)
    for key in SHAPE_SIZES:
        v = model.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            shown = "missing" if v is None else repr(v)[:40]
            raise UserError(
                f"{source}: no integer {prefix}{key} ({shown}); each size must be a positive "
                f"integer. {hint}".rstrip()
            )
    heads, kv, hidden = (
        model["num_attention_heads"],
        model["num_key_value_heads"],
        model["hidden_size"],
    )
    if hidden % heads or heads % kv:
        raise UserError(
            f"{source}: {prefix}hidden_size {hidden}, {prefix}num_attention_heads {heads} and "
            f"{prefix}num_key_value_heads {kv} do not divide. {hint}".rstrip()
        )
    return ModelPreset(**model)


def llama_config(preset: ModelPreset):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.seq_len,
        rope_theta=preset.rope_theta,
        initializer_range=preset.initializer_range,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def hf_model_config(preset: ModelPreset):
    """The transformers config of the model: a Hugging Face checkpoint's own (``hf_config``,
    its ``max_position_embeddings`` and RoPE settings kept) or the Llama preset's."""
    if preset.hf_config is None:
        return llama_config(preset)
    from transformers import AutoConfig

    doc = dict(preset.hf_config)
    config = AutoConfig.for_model(doc.pop("model_type"), **doc)
    config.use_cache = False
    return config


def model_class(config):
    """The causal-LM class of a transformers config (its module imported)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)]


def build_model(preset: ModelPreset) -> nn.Module:
    """A freshly constructed causal LM (LlamaForCausalLM for a preset) in fp32 with SDPA
    attention."""
    cfg = hf_model_config(preset)
    cfg._attn_implementation = "sdpa"
    return model_class(cfg)(cfg)


def count_params(preset: ModelPreset, *, embeddings: bool = True) -> int:
    """Exact parameter count of the preset's LlamaForCausalLM, from its shapes.

    ``embeddings=False`` leaves out the input embedding only; the LM head stays, as in the
    PaLM FLOPs convention (tied embeddings count once, as the head).
    """
    if preset.hf_config is not None:
        return _counted_params(json.dumps(preset.hf_config, sort_keys=True), embeddings)
    h, f, n_layers = preset.hidden_size, preset.intermediate_size, preset.num_hidden_layers
    kv = preset.num_key_value_heads * preset.head_dim
    attn = h * h + 2 * h * kv + h * h  # q, k, v, o
    mlp = 3 * h * f  # gate, up, down (SwiGLU)
    norms = 2 * h
    per_layer = attn + mlp + norms
    head = preset.vocab_size * h
    embed = preset.vocab_size * h if embeddings else 0
    return n_layers * per_layer + h + head + embed


@functools.lru_cache(maxsize=8)
def _counted_params(hf_config: str, embeddings: bool) -> int:
    """The parameters of a Hugging Face architecture, counted on the meta device (biases,
    tied embeddings and other shapes included) without allocating any."""
    import torch

    preset = dataclasses.replace(PRESETS["tiny"], hf_config=json.loads(hf_config))
    with torch.device("meta"):
        model = build_model(preset)
    total = sum(p.numel() for p in model.parameters())  # a tied matrix once
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    return total if embeddings or tied else total - embed.numel()


def flops_per_token(preset: ModelPreset, *, seq_len: int | None = None) -> float:
    """Training FLOPs per token: ``6N + 12*L*H*Q*T`` (PaLM, appendix B).

    N excludes the input embedding but includes the LM head; the second term is attention's
    score and value matmuls with L layers, H heads, Q head dim and T context length.
    """
    t = seq_len or preset.seq_len
    n = count_params(preset, embeddings=False)
    return 6 * n + 12 * preset.num_hidden_layers * preset.num_attention_heads * preset.head_dim * t


def human_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def is_decayed(p: torch.Tensor) -> bool:
    """Weight decay goes on 2-D+ weights only.

    Under ZeRO-3 a partitioned parameter is a 1-D shard (``p.dim() == 1``); its real shape is
    ``p.ds_shape``. Reading ``dim()`` would silently give no decay at all.
    """
    shape = getattr(p, "ds_shape", None)
    ndim = len(shape) if shape is not None else p.dim()
    return ndim >= 2


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """AdamW groups: decoupled decay on matrices, none on norm weights and biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if is_decayed(p) else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def _init_module_(module: nn.Module, std: float) -> None:
    from torch import nn

    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif hasattr(module, "weight") and "RMSNorm" in type(module).__name__:
        nn.init.ones_(module.weight)


def init_weights_(model: nn.Module, *, std: float, seed: int, gather=None) -> None:
    """Deterministic init: N(0, std) for Linear and Embedding weights, ones for RMSNorm.

    ``gather(params)`` is a context manager that makes a module's parameters whole and
    writable (``deepspeed.zero.GatheredParameters`` under ZeRO-3); modules are visited one at a
    time so at most one module is ever gathered. The result depends only on ``seed``, not on
    the ZeRO stage or the number of ranks.
    """
    import torch

    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for module in model.modules():
            params = list(module.parameters(recurse=False))
            if not params:
                continue
            if gather is None:
                with torch.no_grad():
                    _init_module_(module, std)
            else:
                with gather(params), torch.no_grad():
                    _init_module_(module, std)
    finally:
        torch.random.set_rng_state(gen_state)
