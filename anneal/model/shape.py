"""The shape of a model: ``ModelPreset`` (a Llama-style decoder, or a sparse one with
``MoeShape``), and ``preset_from_dict``, the one reader of a shape from a document.

Embeddings are untied (Llama-style): the LM head has its own matrix. A run that continues a
Hugging Face checkpoint (``model.init_from``) keeps that checkpoint's architecture instead: its
``config.json`` rides in the preset (``hf_config``) and the model is built through transformers'
Auto classes (``anneal.hf.load``).
"""

from __future__ import annotations

import dataclasses

from anneal.errors import UserError

# Nominal vocabulary used to size the presets (Llama's). At training time the vocabulary comes
# from the prepared data and the real count is printed at start.
NOMINAL_VOCAB = 32000


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeShape:
    """The sparse feed-forward of a Mixture-of-Experts decoder (every layer sparse), in
    transformers' Qwen3-MoE names where they exist: ``num_experts`` experts of width
    ``expert_intermediate_size`` (``moe_intermediate_size``), ``top_k`` of them
    (``num_experts_per_tok``) per token, weighted by the router's softmax renormalised over the
    chosen ones when ``norm_topk_prob``."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.01
    """Weight of the router's load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4:
    ``E * sum_i f_i * P_i``, 1 when balanced; transformers' ``router_aux_loss_coef``)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5: the mean squared log-sum-exp
    of the router logits), which Anneal adds itself: Qwen3-MoE has none of its own."""

    @classmethod
    def from_dict(cls, doc) -> MoeShape | None:
        """The shape of a run's ``model.moe`` (its own field names) or of a Hugging Face
        config.json (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
        ``router_aux_loss_coef``); None for a dense model."""
        if not isinstance(doc, dict):
            return None
        if isinstance(doc.get("moe"), dict):
            doc = doc["moe"]
            names = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in doc.items() if k in names})
        experts = doc.get("num_experts", doc.get("num_local_experts"))
        if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
            return None
        return cls(
            num_experts=experts,
            top_k=doc.get("num_experts_per_tok", 1),  # checked by preset_from_dict
            expert_intermediate_size=int(
                doc.get("moe_intermediate_size") or doc.get("intermediate_size")
            ),
            norm_topk_prob=bool(doc.get("norm_topk_prob", True)),
            aux_loss_coef=float(doc.get("router_aux_loss_coef", 0.0)),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """Shape of a decoder. Names follow transformers.LlamaConfig (and Qwen3MoeConfig with
    ``moe``)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    seq_len: int
    """Training context length in tokens (also max_position_embeddings)."""
    nominal_params: float | None
    """The size the name promises, in parameters (total, for a sparse model); None for the
    tiny presets."""
    vocab_size: int = NOMINAL_VOCAB
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    head_size: int = 0
    """Width of one attention head (transformers' ``head_dim``); 0: hidden / heads."""
    moe: MoeShape | None = None
    """The sparse feed-forward of a Mixture-of-Experts model (a Qwen3-MoE decoder); None: dense
    (Llama's SwiGLU of ``intermediate_size``)."""
    hf_config: dict | None = None
    """The ``config.json`` of a Hugging Face checkpoint this model starts from
    (``model.init_from``; ``anneal.hf.load``): its architecture, built through transformers'
    Auto classes, tied embeddings and RoPE settings included. None: a preset."""
    init_from: dict | None = None
    """Where the starting weights come from: the directory and the sha256 of its config.json,
    of each weight file and of its tokenizer. None: initialised from ``seed``."""

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def with_vocab(self, vocab_size: int) -> ModelPreset:
        return dataclasses.replace(self, vocab_size=vocab_size)

    def heads_not_dividing(self, tp: int) -> list[str]:
        """The head counts (query, key-value) that ``tp`` tensor-parallel ranks cannot share
        out whole, as "name count" (AutoTP deals whole heads to each rank of a group)."""
        keys = ("num_attention_heads", "num_key_value_heads")
        return [f"{key} {getattr(self, key)}" for key in keys if getattr(self, key) % tp]


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
    if isinstance(doc.get("head_dim"), int) and "head_size" not in model:
        model["head_size"] = doc["head_dim"]  # a Hugging Face config.json's name
    model["moe"] = MoeShape.from_dict(doc)
    if model["moe"] is not None:
        _check_top_k(model["moe"], doc, source=source, prefix=prefix, hint=hint)
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
    if (hidden % heads and not model.get("head_size")) or heads % kv:
        raise UserError(
            f"{source}: {prefix}hidden_size {hidden}, {prefix}num_attention_heads {heads} and "
            f"{prefix}num_key_value_heads {kv} do not divide. {hint}".rstrip()
        )
    return ModelPreset(**model)


def _check_top_k(moe: MoeShape, doc: dict, *, source: str, prefix: str, hint: str) -> None:
    """UserError naming ``source`` and the key unless each token goes to 1 to ``num_experts``
    experts: a top-0 router trains a model without its experts, and DeepSpeed's AutoEP refuses
    a top-k above the experts only once its engine is built (a ValueError on every rank)."""
    experts, k = moe.num_experts, moe.top_k
    run_doc = isinstance(doc.get("moe"), dict)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        raise UserError(
            f"{source}: no integer {prefix}moe.num_experts ({str(experts)[:40]}); a sparse "
            f"model has at least one expert per layer. {hint}".rstrip()
        )
    if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= experts:
        return
    key = f"{prefix}{'moe.top_k' if run_doc else 'num_experts_per_tok'}"
    raise UserError(
        f"{source}: {key} is {str(k)[:40]}, but each token is routed to top-k of its layer's "
        f"{experts} experts, so k is a whole number from 1 to {experts} (with 0 the model "
        f"would train without its experts; above {experts} DeepSpeed's AutoEP fails when its "
        f"engine starts). Set {key} to one of 1..{experts}. {hint}".rstrip()
    )
