"""Model presets: parameter counts within 5% of their names (counted from the real Hugging Face
model, built on the meta device), the PaLM FLOPs formula, the decay rule and the init."""

import pytest
import torch

from anneal import model as modellib


@pytest.mark.parametrize("name", ["tiny", "125m", "350m", "1b", "7b"])
def test_count_params_matches_the_real_model(name):
    preset = modellib.get_preset(name)
    with torch.device("meta"):
        model = modellib.build_model(preset)
    assert sum(p.numel() for p in model.parameters()) == modellib.count_params(preset)
    embed = model.model.embed_tokens.weight.numel()
    assert modellib.count_params(preset, embeddings=False) == modellib.count_params(preset) - embed


@pytest.mark.parametrize("name", ["125m", "350m", "1b", "7b"])
def test_preset_size_is_within_5_percent_of_its_name(name):
    preset = modellib.get_preset(name)
    assert abs(modellib.count_params(preset) / preset.nominal_params - 1) <= 0.05


def test_tiny_is_a_few_million_parameters():
    assert 2e6 <= modellib.count_params(modellib.get_preset("tiny")) <= 10e6


def test_presets_are_llama_style():
    with torch.device("meta"):
        model = modellib.build_model(modellib.get_preset("tiny"))
    cfg = model.config
    assert cfg.hidden_act == "silu" and not cfg.tie_word_embeddings
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_flops_per_token_is_palm_formula():
    p = modellib.get_preset("7b")
    n = 6_738_415_616 - 32000 * 4096  # Llama-2-7B without the input embedding
    assert modellib.count_params(p, embeddings=False) == n
    expected = 6 * n + 12 * 32 * 32 * 128 * 4096
    assert modellib.flops_per_token(p) == expected
    assert modellib.flops_per_token(p, seq_len=2048) == 6 * n + 12 * 32 * 32 * 128 * 2048


def test_decay_only_on_matrices():
    model = modellib.build_model(modellib.get_preset("tiny").with_vocab(100))
    groups = modellib.param_groups(model, weight_decay=0.1)
    decay, no_decay = groups[0]["params"], groups[1]["params"]
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay) and all(p.dim() == 1 for p in no_decay)
    assert len(decay) + len(no_decay) == len(list(model.parameters()))
    # 4 layers x (q, k, v, o, gate, up, down) + embeddings + head; norms: 2 per layer + final
    assert len(decay) == 4 * 7 + 2 and len(no_decay) == 4 * 2 + 1


def test_decay_reads_ds_shape_of_partitioned_parameters():
    shard = torch.nn.Parameter(torch.zeros(10))  # what ZeRO-3 leaves: a 1-D shard
    shard.ds_shape = torch.Size([4, 5])
    assert modellib.is_decayed(shard)
    norm = torch.nn.Parameter(torch.zeros(10))
    norm.ds_shape = torch.Size([10])
    assert not modellib.is_decayed(norm)


def test_init_is_std_002_and_deterministic():
    preset = modellib.get_preset("tiny").with_vocab(1000)
    a, b = modellib.build_model(preset), modellib.build_model(preset)
    modellib.init_weights_(a, std=0.02, seed=3)
    modellib.init_weights_(b, std=0.02, seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert abs(a.model.embed_tokens.weight.std().item() - 0.02) < 1e-3
    assert torch.all(a.model.norm.weight == 1)
