"""Activations in the memory estimate: every tensor a decoder layer keeps for backward, and
the logits and loss.

Activations are counted the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", section 4.1) count them: every tensor a layer keeps for backward.
For their GPT-3 block that sums to the published ``s b h (34 + 5 a s / h)`` bytes per layer
(``saved_tensors(block="gpt")``); Anneal's Llama block (RMSNorm, RoPE, SDPA, SwiGLU, no
dropout) keeps ``s b h (22 + 8 f / h)`` bytes at bf16 with SDPA, which stores no attention
scores. With full recomputation a layer keeps only its input, ``2 s b h``, and backward
rebuilds one layer at a time.

A sparse layer (Qwen3-MoE under DeepSpeed AutoEP, ``deepspeed/module_inject/auto_ep_layer.py``)
keeps, in place of the SwiGLU's four ``s b f`` tensors, those of its routed copies: each of the
``T = s b`` tokens goes to ``k`` (top_k) experts of width ``I``, so the experts see ``N = k T``
rows, and with v bytes a value the layer keeps::

    N (2 h + 4 I) v  +  8 T E

the routed input of the experts' gate and up matmuls (``N h``), the gate, its SiLU, the up
projection and the down projection's input (``4 N I``), the experts' output that the combine
weights by the router's scores (``N h``), and two fp32 softmaxes over the E experts (the
router's, and the one transformers' load-balancing loss takes of the captured logits). This is
the balanced case: with expert parallelism a rank computes the rows routed to its own experts,
which is ``N`` on average and more on the rank whose experts the router favours (the run's
``moe_max_mean``). Index tensors (8 bytes a row) are left out. Against the tensors AutoEP's layer
saves (tests/planning/test_memory_moe.py, fp32, EP=1, h 256, I 128, E 8, top-2, 1024 tokens) the
count
is 2.7% low: the index tensors and the alignment padding of each expert's rows.
"""

from __future__ import annotations

from anneal.model import ModelPreset
from anneal.planning import memory_tp


def saved_tensors(
    *,
    s: int,
    b: int,
    h: int,
    f: int,
    a: int,
    kv: int,
    bf16: bool,
    eager: bool,
    block: str,
    t: int = 1,
    moe: tuple[int, int, int] | None = None,
) -> list[tuple[str, float]]:
    """Bytes each tensor that one decoder layer keeps for backward, Korthikanti et al.'s way.

    ``block="gpt"`` is their GPT-3 block (16-bit, 4h GeLU MLP, LayerNorm, dropout masks of 1
    byte), which sums to the paper's ``s b h (34 + 5 a s / h)``. ``block="llama"`` is Anneal's
    model as Hugging Face runs it: RMSNorm that saves an fp32 copy of its input and its
    normalised output, RoPE'd q and k, SDPA (no scores kept unless ``eager``), SwiGLU with
    intermediate size f, no dropout; ``kv`` is the key/value width (h without GQA); ``t``, TP.
    ``moe`` (experts E, top_k k, expert width I): the sparse layer's tensors in place of the
    SwiGLU's (``moe_saved_tensors``).
    """
    sbh, sbf, sbkv, scores = s * b * h, s * b * f, s * b * kv, a * s * s * b
    if block == "gpt":
        return memory_tp.divide_tensors(
            [
                ("attention: QKV input", 2 * sbh),
                ("attention: Q and K", 4 * sbh),
                ("attention: softmax output", 2 * scores),
                ("attention: softmax dropout mask", scores),
                ("attention: dropout output (for x V)", 2 * scores),
                ("attention: V", 2 * sbh),
                ("attention: output projection input", 2 * sbh),
                ("attention: dropout mask", sbh),
                ("MLP: first linear input", 2 * sbh),
                ("MLP: GeLU input", 8 * sbh),
                ("MLP: second linear input", 8 * sbh),
                ("MLP: dropout mask", sbh),
                ("two LayerNorm inputs", 4 * sbh),
            ],
            t,
        )
    v = 2 if bf16 else 4  # bytes per activation value
    norm = (4 + 2) if bf16 else (4 + 4)  # fp32 input copy (for the variance) + normalised output
    items = [
        ("attention: RMSNorm", norm * sbh),
        ("attention: q after RoPE", v * sbh),
        ("attention: k after RoPE and v", 2 * v * sbkv),
        ("attention: output projection input", v * sbh),
    ]
    if eager:
        # fp32 softmax probabilities (and their 16-bit cast) for the x V matmul.
        items.append(("attention: softmax probabilities", (4 + (2 if bf16 else 0)) * scores))
    else:
        items.append(("attention: SDPA output", v * sbh))
    items.append(("MLP: RMSNorm", norm * sbh))
    if moe is not None:
        items += moe_saved_tensors(tokens=s * b, h=h, moe=moe, v=v)
    else:
        items += [
            ("MLP: SiLU input (gate)", v * sbf),
            ("MLP: SiLU output", v * sbf),
            ("MLP: up projection output", v * sbf),
            ("MLP: down projection input", v * sbf),
        ]
    return memory_tp.divide_tensors(items, t)


def moe_saved_tensors(
    *, tokens: int, h: int, moe: tuple[int, int, int], v: int
) -> list[tuple[str, float]]:
    """The tensors a sparse layer keeps for backward in place of the SwiGLU's: with E experts,
    top_k k and expert width I, ``N = k tokens`` routed rows keep ``N (2 h + 4 I) v`` bytes and
    the router ``8 tokens E`` (module docstring)."""
    experts, top_k, width = moe
    rows = top_k * tokens
    return [
        ("MoE: router softmax (fp32)", 4 * tokens * experts),
        ("MoE: load-balancing loss softmax (fp32)", 4 * tokens * experts),
        ("MoE: routed tokens (expert input)", v * rows * h),
        ("MoE: SiLU input (gate)", v * rows * width),
        ("MoE: SiLU output", v * rows * width),
        ("MoE: up projection output", v * rows * width),
        ("MoE: down projection input", v * rows * width),
        ("MoE: expert output (weighted by the combine)", v * rows * h),
    ]


def layer_activation_bytes(preset: ModelPreset, work, *, bf16: bool) -> float:
    """Bytes one decoder layer keeps for backward, without recomputation."""
    return sum(
        n
        for _, n in saved_tensors(
            s=work.seq_len,
            b=work.micro_batch,
            h=preset.hidden_size,
            f=preset.intermediate_size,
            a=preset.num_attention_heads,
            kv=preset.num_key_value_heads * preset.head_dim,
            bf16=bf16,
            eager=work.eager_attention,
            block="llama",
            t=work.tp,
            moe=_routed_shape(preset),
        )
    )


def _routed_shape(preset: ModelPreset) -> tuple[int, int, int] | None:
    moe = preset.moe
    return None if moe is None else (moe.num_experts, moe.top_k, moe.expert_intermediate_size)


def activation_bytes(preset: ModelPreset, work, *, bf16: bool) -> int:
    """Activations kept for backward on one GPU. With full recomputation each layer keeps its
    input (2 s b h bytes at 16 bits) and backward rebuilds one layer's activations at a time."""
    per_layer = layer_activation_bytes(preset, work, bf16=bf16)
    layers = preset.num_hidden_layers
    if work.activation_checkpointing:
        value = 2 if bf16 else 4
        return int(
            layers * value * work.seq_len * work.micro_batch * preset.hidden_size + per_layer
        )
    return int(layers * per_layer)


def logits_bytes(preset: ModelPreset, work, *, bf16: bool) -> int:
    """Peak bytes of the logits and the loss.

    plain, at the start of backward: the fp32 log-softmax that cross-entropy keeps, its
    incoming gradient, exp(log-softmax) and the logits' fp32 gradient (4 x 4 bytes per token
    and vocabulary entry), plus that gradient's 16-bit cast under bf16. The forward logits
    (and their fp32 upcast) are freed by then.

    chunked (``anneal.train.loss``), in the loss's forward, where it computes the gradients:
    one chunk's fp32 logits and their log-softmax (2 x 4 bytes per chunk token and vocabulary
    entry; the log-softmax is then overwritten by the logits' gradient, whose 16-bit cast
    under bf16 takes the place of the freed logits), the hidden states' gradient (tokens x h
    values) and the head weight's, summed over chunks in fp32 (V x h x 4 bytes, and under bf16
    each chunk's 16-bit product, 2 more), both held into backward. With c = min(chunk, tokens)
    and v bytes a value: ``8 c V + tokens h v + V h (4 + 2 [bf16])``.
    """
    tokens, vocab, h = work.seq_len * work.micro_batch, preset.vocab_size, preset.hidden_size
    if work.loss == "plain" or work.tp > 1:  # the LM head's gathered output: the full logits
        return int(tokens * vocab * (4 * 4 + (2 if bf16 else 0)))
    chunk, value = min(work.loss_chunk_tokens, tokens), 2 if bf16 else 4
    return int(8 * chunk * vocab + tokens * h * value + vocab * h * (6 if bf16 else 4))
