"""The chunked loss (``anneal.train.loss``) against the plain one: the same mean cross-entropy
and the same gradients of every parameter as ``F.cross_entropy`` over the full logits of the
same Hugging Face model, within 1e-6 relative in fp32, with the head untied and tied to the
embedding, over a chunk size that does not divide the tokens, with ignored targets, and per
token as validation reads it, and under bf16 no further from fp32 than the plain path; no
tensor of the full logits' size is made in forward or backward; heads it cannot read are left
alone; the config keys are checked. The slow tests run it in a real single-rank ZeRO-3 engine
(the head weight partitioned) against the plain model's gradients, and train and validate
through the recipe against the same run with train.loss=plain."""

from __future__ import annotations

import copy
import json
import math
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from anneal.config.run import RunConfig
from anneal.config.run_checks import apply_overrides, check_ranges
from anneal.dist import free_port
from anneal.errors import UserError
from anneal.train import loss as losslib
from tests.conftest import ROOT, SMALL, env, read_metrics, run_process, run_recipe

VOCAB, B, T, CHUNK = 512, 2, 24, 7  # 48 tokens in chunks of 7: the last one short


def micro_model(*, tied: bool, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
        tie_word_embeddings=tied,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).float()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def loss_and_grads(model, x, y) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with losslib.targets(model, y):
        out = model(input_ids=x).logits
    loss = losslib.next_token_loss(out, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_same_loss_and_gradients_as_the_full_logits(tied):
    plain = micro_model(tied=tied)
    chunked = copy.deepcopy(plain)
    assert losslib.install(chunked, chunk_tokens=CHUNK)
    assert (chunked.lm_head.weight is chunked.model.embed_tokens.weight) == tied
    x, y = batch()
    y = y.clone()
    y[0, :5] = losslib.IGNORE_INDEX  # ignored targets count in neither loss nor mean

    ref_logits = plain(input_ids=x).logits
    ref = F.cross_entropy(ref_logits.reshape(-1, VOCAB), y.reshape(-1))
    ref.backward()
    loss, grads = loss_and_grads(chunked, x, y)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    assert rel(loss, ref.detach()) < 1e-6
    for name, p in plain.named_parameters():
        assert rel(grads[name], p.grad) < 1e-6, name
    # Outside ``targets`` the installed head gives the logits, as the plain one does.
    assert torch.equal(chunked(input_ids=x).logits, ref_logits.detach())


def test_one_chunk_gives_cross_entropys_loss_to_the_bit():
    """Up to one chunk of tokens, the chunked loss is F.cross_entropy's own value, bit for bit
    (the step's reference test compares losses to 1e-12), and its gradients within 1e-6."""
    hidden = torch.randn(B * T, 32, requires_grad=True)
    weight = torch.randn(VOCAB, 32, requires_grad=True)
    y = torch.randint(0, VOCAB, (B * T,))
    loss = losslib.linear_cross_entropy(hidden, weight, y, chunk_tokens=B * T)
    grads = torch.autograd.grad(loss, [hidden, weight])
    ref = F.cross_entropy(F.linear(hidden, weight), y)
    ref_grads = torch.autograd.grad(ref, [hidden, weight])
    assert loss.item() == ref.item()
    assert max(rel(a, b) for a, b in zip(grads, ref_grads, strict=True)) < 1e-6


def test_torch_compile_captures_the_chunked_loss_in_one_graph():
    """``train.compile`` (docs/throughput.md): dynamo traces the chunked loss, forward and
    backward, into one graph with no graph break, so that the head and the loss compile with
    the model (a backward that deleted an attribute of its context broke the graph at every
    step: 4 graphs and 2 breaks for this function); through torch's ``aot_eager`` backend (no
    inductor: 1.5 s here) its loss and gradients are eager's, bit for bit."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    hidden = torch.randn(B * T, 32, requires_grad=True)
    weight = torch.randn(VOCAB, 32, requires_grad=True)
    y = torch.randint(0, VOCAB, (B * T,))

    def forward(h, w):  # as in a model: something before the loss, something after
        return losslib.linear_cross_entropy(h * 1.5, w, y, chunk_tokens=CHUNK) * 2

    def loss_and_grads(fn):
        loss = fn(hidden, weight)
        return loss, torch.autograd.grad(loss, [hidden, weight])

    eager = loss_and_grads(forward)
    compiled = loss_and_grads(torch.compile(forward, backend="aot_eager"))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(compiled[0], eager[0])
    for got, want in zip(compiled[1], eager[1], strict=True):
        assert torch.equal(got, want)
    torch._dynamo.reset()


def test_bf16_gradients_are_as_close_to_fp32_as_the_plain_paths():
    """Under bf16 the head's gradient is summed over chunks in fp32: the chunked gradients are
    no further from the fp32 ones than the plain bf16 path's are."""
    hidden = torch.randn(B * T, 32)
    weight = torch.randn(VOCAB, 32) / 4
    y = torch.randint(0, VOCAB, (B * T,))

    def grads(fn, dtype):
        h, w = (t.to(dtype).requires_grad_() for t in (hidden, weight))
        return torch.autograd.grad(fn(h, w), [h, w])

    exact = grads(lambda h, w: F.cross_entropy(F.linear(h, w), y), torch.float32)
    plain = grads(lambda h, w: F.cross_entropy(F.linear(h, w).float(), y), torch.bfloat16)
    chunked = grads(
        lambda h, w: losslib.linear_cross_entropy(h, w, y, chunk_tokens=CHUNK), torch.bfloat16
    )
    for c, p, e in zip(chunked, plain, exact, strict=True):
        assert c.dtype == torch.bfloat16
        assert rel(c, e) <= 1.25 * rel(p, e)


def test_validation_nats_per_token():
    """Validation's (B, T) nats, under no_grad, equal plain cross-entropy's per token."""
    plain = micro_model(tied=False)
    chunked = copy.deepcopy(plain)
    losslib.install(chunked, chunk_tokens=CHUNK)
    x, y = batch(2)
    with torch.no_grad():
        ref = F.cross_entropy(plain(input_ids=x).logits.transpose(1, 2), y, reduction="none")
        with losslib.targets(chunked, y, per_token=True):
            nats = losslib.token_nats(chunked(input_ids=x).logits, y)
        with losslib.targets(plain, y, per_token=True):  # not installed: plain logits
            plain_nats = losslib.token_nats(plain(input_ids=x).logits, y)
    assert nats.shape == (B, T)
    assert rel(nats, ref) < 1e-6
    assert torch.equal(plain_nats, ref)


class _Sizes(TorchDispatchMode):
    """The largest number of elements of any tensor an op returns."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_the_full_logits_in_forward_or_backward():
    """Forward and backward of the chunked loss make nothing larger than one chunk's logits
    (or the head's weight and its gradient), where the plain loss makes the (B*T, V) logits."""
    hidden = torch.randn(B * T, 32, requires_grad=True)
    weight = torch.randn(VOCAB, 32, requires_grad=True)
    y = torch.randint(0, VOCAB, (B * T,))
    sizes = {}
    for name, fn in {
        "chunked": lambda: losslib.linear_cross_entropy(hidden, weight, y, chunk_tokens=CHUNK),
        "plain": lambda: F.cross_entropy(F.linear(hidden, weight), y),
    }.items():
        with _Sizes() as mode:
            fn().backward()
        sizes[name] = mode.largest
    assert sizes["plain"] == B * T * VOCAB
    assert sizes["chunked"] == max(CHUNK * VOCAB, weight.numel())


def test_heads_it_cannot_read_are_left_alone():
    """A biased head, a head that is not an ``nn.Linear`` (AutoTP's sharded layer) and
    soft-capped logits keep their forward; the step then reads their logits."""
    biased = micro_model(tied=False)
    biased.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    wrapped = micro_model(tied=False)
    wrapped.lm_head = torch.nn.Sequential(wrapped.lm_head)
    capped = micro_model(tied=False)
    capped.config.final_logit_softcapping = 30.0
    x, y = batch()
    for model in (biased, wrapped, capped):
        assert not losslib.install(model, chunk_tokens=CHUNK)
        assert "forward" not in vars(model.get_output_embeddings())
        with losslib.targets(model, y):
            out = model(input_ids=x).logits
        assert out.shape == (B, T, VOCAB)
        ref = F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
        assert torch.equal(losslib.next_token_loss(out, y), ref)


def test_the_config_keys_are_checked():
    """train.loss is chunked by default and takes chunked or plain; a chunk of 0 tokens is a
    UserError naming the key, before anything starts."""
    cfg = RunConfig(out="o", ds_config="cpu.json")
    assert (cfg.train.loss, cfg.train.loss_chunk_tokens) == ("chunked", 512)
    plain = apply_overrides(cfg, ["train.loss=plain", "train.loss_chunk_tokens=64"])
    assert (plain.train.loss, plain.train.loss_chunk_tokens) == ("plain", 64)
    check_ranges(plain)
    with pytest.raises(UserError, match="train.loss must be one of chunked, plain"):
        apply_overrides(cfg, ["train.loss=fused"])
    with pytest.raises(UserError, match="train.loss_chunk_tokens is 0"):
        check_ranges(apply_overrides(cfg, ["train.loss_chunk_tokens=0"]))


ZERO3_CHECK = textwrap.dedent(
    """
    import copy, json, os, sys
    import deepspeed, torch
    import torch.nn.functional as F
    from deepspeed.utils import safe_get_full_grad
    sys.path.insert(0, os.getcwd())
    from anneal.train import loss as losslib
    from tests.train.test_loss import batch, micro_model, rel, CHUNK, VOCAB

    from anneal.dist import init_distributed
    init_distributed()  # as the recipes do: gloo, never DeepSpeed's shm op (its JIT build)
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    figures = {}
    for tied in (False, True):
        plain = micro_model(tied=tied)
        x, y = batch()
        ref = F.cross_entropy(plain(input_ids=x).logits.reshape(-1, VOCAB), y.reshape(-1))
        ref.backward()
        engine, *_ = deepspeed.initialize(model=copy.deepcopy(plain), config=config,
                                          model_parameters=None)
        head = engine.module.lm_head
        assert head.weight.numel() == 0, "the head weight is partitioned outside its forward"
        assert losslib.install(engine.module, chunk_tokens=CHUNK)
        with losslib.targets(engine.module, y):
            out = engine(input_ids=x).logits
        assert out.dim() == 0, out.shape
        engine.backward(out)
        worst = max(rel(safe_get_full_grad(p), plain.get_parameter(n).grad)
                    for n, p in engine.module.named_parameters())
        figures["tied" if tied else "untied"] = {
            "loss": rel(out.detach(), ref.detach()), "grads": worst,
            "params": len(list(engine.module.parameters())),
        }
    print(json.dumps(figures))
    """
)


@pytest.mark.slow
def test_zero3_engine_gathers_the_head(tmp_path):
    """In a real single-rank DeepSpeed ZeRO-3 engine (gloo, the head's weight partitioned, so
    the loss only sees it through the head module's own gathering hooks), the chunked loss and
    every gradient equal the plain model's over full logits, untied and tied. Slow: DeepSpeed's
    import and two engine builds in a fresh process take 10-15 s."""
    script = tmp_path / "zero3_check.py"
    script.write_text(ZERO3_CHECK)
    e = {**env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    e["MASTER_PORT"], e["OMP_NUM_THREADS"] = str(free_port()), "1"
    proc = run_process([sys.executable, str(script)], timeout_s=400, check=True, cwd=ROOT, env=e)
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["tied"]["params"] == figures["untied"]["params"] - 1, figures
    for case in figures.values():
        assert case["loss"] < 1e-6 and case["grads"] < 1e-6, figures


@pytest.mark.slow
def test_the_recipe_trains_and_validates_as_with_the_plain_loss(
    same_seed_runs, tiny_data, tmp_path
):
    """The session's fp32 run (4 steps, validation at steps 2 and 4; the chunked loss, the
    default) against the same run with train.loss=plain, through the recipe: per-step losses
    and grad norms within 1e-5 relative, validation within 1e-6. Slow: one more recipe run
    (about 10 s)."""
    chunked_dir, chunked_proc = same_seed_runs["fp32"]
    args = ["--max-steps", "4", "--val-every", "2", "--save-every", "0", *SMALL]
    args += ["--set", "train.log_every=2", "--set", "train.loss=plain"]
    run_recipe(["--out", str(tmp_path / "plain"), "--data", str(tiny_data), *args])
    assert "runs plain" not in chunked_proc.stderr  # the head took the chunked loss
    cfg = json.loads((chunked_dir / "config.json").read_text())
    assert cfg["run"]["train"]["loss"] == "chunked"
    for kind, keys, tol in (("train", ("loss", "grad_norm"), 1e-5), ("val", ("val_loss",), 1e-6)):
        chunked, plain = read_metrics(chunked_dir, kind), read_metrics(tmp_path / "plain", kind)
        assert len(chunked) == len(plain) == {"train": 4, "val": 2}[kind]
        for a, b in zip(chunked, plain, strict=True):
            for key in keys:
                assert a[key] == pytest.approx(b[key], rel=tol), (kind, key, a, b)
