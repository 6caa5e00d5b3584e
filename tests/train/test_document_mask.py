"""Document masking (``data.document_mask``) through Anneal's own step code on plain
transformers models, in this process (no launch): a document B's logits and per-token losses
(the chunked loss's per-token nats, as validation reads them) are bitwise the same whether A or
another document A' of the same length precedes it in the window, for every attention
implementation Anneal can build on a CPU (eager and SDPA), and equal those of B alone in a
window of its own, the reference (within 1e-6); a sparse model's within 1e-6 (its experts batch
both documents' tokens); without masking they are not (the test can fail). Masking off gives
the model exactly the inputs Anneal always gave it. The rows of a micro-batch made one row
(flash-attn's varlen input) give the same logits as the rows apart. Under Ulysses the core
attention that rebuilds the documents' mask from the gathered positions
(``sequence.documents_sdpa``) equals transformers' own masked SDPA. The launch resolves the
setting, prints it and records it; an older run's config.json (no such key) compares equal to
masking off. A run with masking off, through the shipped CPU engine and the real loop, feeds the
model the input ids alone and gives plain transformers' step losses bitwise.

Slow, on 2 ranks: the real engines at Ulysses SP=2 (ZeRO-3) and AutoTP TP=2 give B's logits and
per-token nats bitwise the same after A and after A', and within 1e-6 relative of the plain
model at SP=1, TP=1 (tests/scripts/document_logits.py, one launch for both); masked runs at SP=2
and TP=2 train with the per-step losses of one rank, and resume exactly."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest
import torch

from anneal.config.run_compare import config_differences
from anneal.model import build_model, get_preset, init_weights_
from anneal.model.attention import Attention
from anneal.train import loss
from anneal.train.sequence import documents_sdpa
from anneal.train.step import model_inputs
from tests.conftest import (
    PARALLEL_SHAPE,
    SMALL,
    read_metrics,
    resolve_tiny,
    run_recipes,
    sets,
)

EOS, VOCAB = 1, 300
ENGINE = types.SimpleNamespace(sequence_parallel_size=1)  # what model_inputs reads of one
MASKED = Attention(eos_id=EOS)


def _model(preset_name: str, attention: str):
    preset = get_preset(preset_name).with_vocab(VOCAB)
    preset = dataclasses.replace(preset, hidden_size=64, num_hidden_layers=2, seq_len=64)
    model = build_model(preset, attention=attention)
    init_weights_(model, std=0.02, seed=3)
    return model.eval()


def _windows():
    """Two windows of 64 tokens (+1 for the targets): A, EOS, B and A', EOS, B, with A and A'
    of 30 tokens that differ everywhere; B starts at index 31 in both."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(2, VOCAB, (30,), generator=g), torch.randint(2, VOCAB, (34,), generator=g)
    other = (a + 7 - 2) % (VOCAB - 2) + 2  # A': every token another one, none EOS
    rows = torch.stack([torch.cat([d, torch.tensor([EOS]), b]) for d in (a, other)])
    return rows[:, :-1], rows[:, 1:], b


def _outputs(model, x, y, attention):
    """(logits, per-token nats) of the model through Anneal's step code."""
    inputs, targets = model_inputs(ENGINE, x, y, attention)
    with torch.no_grad():
        logits = model(**inputs).logits
        loss.install(model, chunk_tokens=7)
        with loss.targets(model, targets, per_token=True):
            nats = loss.token_nats(model(**inputs).logits, targets)
    model.get_output_embeddings().anneal_loss.targets = None
    return logits, nats


def _within_1e6(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "preset, attention", [("tiny", "eager"), ("tiny", "sdpa"), ("tiny-moe", "sdpa")]
)
def test_a_document_does_not_see_the_one_before_it(preset, attention):
    """Each window a micro-batch of its own, so that B's tokens take the same places in every
    kernel (the chunked loss's chunks included). The sparse model routes the tokens of both
    documents through the same experts, whose matmuls then see another number of rows: equal
    within 1e-6 there (1.8e-7 measured on logits of about 0.7), not bitwise."""
    model = _model(preset, attention)
    x, y, b = _windows()
    (la, na), (lo, no) = (_outputs(model, x[i : i + 1], y[i : i + 1], MASKED) for i in (0, 1))
    same = torch.equal if preset == "tiny" else _within_1e6
    assert same(la[0, 31:], lo[0, 31:])
    assert same(na[0, 31:], no[0, 31:])
    assert not torch.allclose(na[0, 30], no[0, 30])  # the EOS sees its own document
    logits, _ = _outputs(model, x, y, MASKED)  # and in one micro-batch of both
    assert same(logits[0, 31:], logits[1, 31:])
    with torch.no_grad():  # the reference: B alone, plain transformers, no position ids
        alone = model(input_ids=b[None, :-1]).logits[0]
    assert _within_1e6(la[0, 31:], alone)
    unmasked, _ = _outputs(model, x, y, None)
    assert (unmasked[0, 31:] - unmasked[1, 31:]).abs().max() > 1e-3  # A leaks into B


def test_masking_off_gives_the_model_what_it_always_got():
    x, y, _ = _windows()
    for off in (None, Attention()):
        inputs, targets = model_inputs(ENGINE, x, y, off)
        assert inputs.keys() == {"input_ids"} and inputs["input_ids"] is x and targets is y
    model = _model("tiny", "sdpa")
    logits, _ = _outputs(model, x, y, Attention())
    with torch.no_grad():
        assert torch.equal(logits, model(input_ids=x).logits)


def _gathered_weights(module) -> dict[str, torch.Tensor]:
    """The module's weights, whole (ZeRO-3 holds them partitioned), copied."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_masking_off_trains_and_validates_as_plain_transformers(tiny_data, world_of_one, tmp_path):
    """A run with masking off is the run Anneal always made: the shipped CPU engine (cpu.json:
    fp32 ZeRO-3; one rank in this process) and the real Trainer's loop, two steps of
    accumulation 2 and validation after the second. Every forward the engine ran got the
    input ids alone, the stream's windows (no position ids, no mask); each step's loss is
    bitwise that of plain transformers (the SDPA model Anneal always built, its head given
    the same chunked loss) fed the input ids alone, with the weights the engine had before the
    step; the validation loss is the same model's within 1e-12 (sums in float64). 2.2 s here
    after the file's other fast tests (8.5 s of CPU alone, importing DeepSpeed first)."""
    from anneal.data.stream import PackedSplit, TokenStream, validation_windows
    from anneal.resilience.guard import Guard
    from anneal.rundir import RunDir
    from anneal.train.engine import build_engine
    from anneal.train.observers import Observer
    from anneal.train.trainer import Data, Trainer

    out = tmp_path / "run"
    args = ["--out", str(out), "--data", str(tiny_data), "--max-steps", "3"]
    args += ["--val-every", "2", "--save-every", "0", *SMALL, *sets("train.stop_at_step=2")]
    launch = resolve_tiny(args, world_size=1)
    assert launch.attention == Attention() and launch.zero_stage == 3
    engine = build_engine(launch)
    calls = []  # (training?, positional args, keyword args) of every forward of the model
    engine.module.register_forward_pre_hook(
        lambda m, a, kw: calls.append((m.training, a, dict(kw))), with_kwargs=True
    )
    weights = [_gathered_weights(engine.module)]
    rows = []

    class Watch(Observer):
        def on_step(self, row):
            rows.append(row)
            weights.append(_gathered_weights(engine.module))

        def on_val(self, row):
            rows.append(row)

    guard = Guard(launch.cfg.guard, run_dir=out, resuming=False)
    data = Data.open(launch)
    Trainer(launch, engine, guard, RunDir.for_launch(launch), data, watchers=[Watch()]).train(
        None, {}
    )
    assert [r.get("kind") for r in rows] == ["train", "train", "val"]
    assert all(a == () and kw.keys() == {"input_ids"} for _, a, kw in calls)

    plain = build_model(launch.preset)  # SDPA, as Anneal always built it
    loss.install(plain, chunk_tokens=launch.cfg.train.loss_chunk_tokens)
    seed, batch = launch.cfg.train.seed, launch.micro_batch
    stream = TokenStream(data.train, seed=seed, rank=0, world_size=1, micro_batch=batch, prefetch=0)
    trained = [c for c in calls if c[0]]
    assert len(trained) == 2 * launch.grad_accum
    for step in (1, 2):
        plain.load_state_dict(weights[step - 1])
        micro = []
        for i in range(launch.grad_accum):
            x, y = stream.next_batch()
            assert torch.equal(trained[(step - 1) * launch.grad_accum + i][2]["input_ids"], x)
            with loss.targets(plain, y):  # with gradients, as the step computes it
                micro.append(plain(input_ids=x).logits.detach().item())
        assert rows[step - 1]["loss"] == sum(micro) / launch.grad_accum, step

    val = PackedSplit(tiny_data, "val", seq_len=launch.seq_len)
    windows = validation_windows(
        val.n_windows,
        n_samples=launch.cfg.train.val_samples,
        rank=0,
        world_size=1,
        micro_batch=batch,
        sources=val.source_windows,
    )
    evaluated = [c for c in calls if not c[0]]
    assert len(evaluated) == len(windows) and all(min(w) >= 0 for w in windows)
    plain.load_state_dict(weights[2])
    plain.eval()
    nats, tokens = 0.0, 0
    for (_, _, kw), w in zip(evaluated, windows, strict=True):
        x, y = val.batch(w)
        assert torch.equal(kw["input_ids"], x)
        with torch.no_grad(), loss.targets(plain, y, per_token=True):
            nats += loss.token_nats(plain(input_ids=x).logits, y).double().sum().item()
        tokens += y.numel()
    assert rows[2]["val_loss"] == pytest.approx(nats / tokens, rel=1e-12)


def test_the_rows_made_one_row_give_the_same_logits():
    """flash-attn reads documents only from a batch of one row: B x T as one row, each window
    starting a document at position 0, is the same computation (here with SDPA's mask)."""
    model = _model("tiny", "sdpa")
    x, y, _ = _windows()
    rows, _ = _outputs(model, x, y, MASKED)
    one, nats = _outputs(model, x, y, dataclasses.replace(MASKED, flat_batch=True))
    assert one.shape == (1, 2 * 64, VOCAB) and nats.shape == (1, 2 * 64)
    assert _within_1e6(one.view(rows.shape), rows)


def test_ulysses_core_rebuilds_transformers_mask():
    """What the core attention gets under Ulysses (no mask, the whole sequence's positions)
    gives transformers' own masked SDPA output: the same boolean mask, rebuilt."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import create_causal_mask

    from anneal.data.documents import document_positions

    model = _model("tiny", "sdpa")
    x, _, _ = _windows()
    positions = document_positions(x, EOS)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(3))
    attn = model.model.layers[0].self_attn
    embeds = torch.zeros(2, 64, 64)
    mask = create_causal_mask(model.config, embeds, None, None, position_ids=positions)
    want, _ = sdpa_attention_forward(attn, q, k, v, mask)
    got, _ = documents_sdpa(attn, q, k, v, None, position_ids=positions)
    assert torch.equal(got, want)
    plain = torch.arange(64).repeat(2, 1)  # no restart: SDPA's causal flag, as transformers
    got, _ = documents_sdpa(attn, q, k, v, None, position_ids=plain)
    assert torch.equal(got, sdpa_attention_forward(attn, q, k, v, None)[0])


def test_the_launch_resolves_prints_and_records_it(tiny_data, tmp_path):
    args = ["--out", str(tmp_path / "run"), "--data", str(tiny_data)]
    launch = resolve_tiny([*args, *sets("data.document_mask=true")], world_size=1)
    assert launch.attention == Attention(eos_id=EOS, reason=launch.attention.reason)
    assert "attention sdpa, documents masked (each ends at id 1" in launch.describe()
    doc = launch.config_document()
    assert doc["run"]["data"]["document_mask"] is True and doc["launch"]["attention"] == "sdpa"
    off = resolve_tiny(args, world_size=1)
    assert off.attention == Attention() and "no document masking" in off.describe()
    older = json.loads(json.dumps(off.config_document()))
    del older["run"]["data"]["document_mask"]  # written before the setting existed
    assert config_differences(older, off.config_document()) == []
    assert config_differences(older, doc) == ["run.data.document_mask: False -> True"]


# -- slow: the real engine, real processes -------------------------------------------------------


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """A prepared corpus of 3,000 short documents (one to three words, about 9 tokens each,
    byte-level vocabulary), so that every window of 32 tokens holds several boundaries."""
    from anneal.data.prepare import prepare

    words = "the quick brown fox jumps over a lazy dog while seven ducks watch".split()
    docs = [" ".join(words[i % 11 : i % 11 + 1 + i % 3]) for i in range(3000)]
    src = tmp_path_factory.mktemp("docs_src") / "text.txt"
    src.write_text("\n\n".join(docs))
    out = tmp_path_factory.mktemp("docs_prep") / "data"
    prepare(inputs=[str(src)], out=out, vocab_size=300, progress=False)
    from anneal.data.stream import PackedSplit

    split = PackedSplit(out, "train", seq_len=32)
    windows = torch.from_numpy(np.stack([split.window(j) for j in range(split.n_windows)]))
    assert ((windows[:, :-1] == EOS).sum(1) >= 2).float().mean() > 0.9
    return out


STEPS_MASKED = 6


def _masked(data, out, *, layout: str, stage: int, ranks: int, extra=()) -> dict:
    """6 steps of 4 samples (micro-batch 2; accumulation 2 at data-parallel 1) at sequence 32
    with ``data.document_mask=true``, validated at the last, saved at steps 3 and 6."""
    args = [
        *("--out", str(out), "--data", str(data), "--max-steps", str(STEPS_MASKED + 1)),
        *("--val-every", str(STEPS_MASKED), "--save-every", "3"),
        *sets(
            f"train.stop_at_step={STEPS_MASKED}",
            *PARALLEL_SHAPE,
            "ds.gradient_accumulation_steps=2",
            f"ds.zero_optimization.stage={stage}",
            layout,
            "data.document_mask=true",
        ),
        *extra,
    ]
    return dict(args=args, ranks=ranks)


@pytest.fixture(scope="module")
def masked_runs(short_docs, tmp_path_factory):
    """With masking on: SP=1 x TP=1 on 1 rank (the reference, ZeRO-2), Ulysses SP=2 on 2 ranks
    (ZeRO-3), AutoTP TP=2 on 2 ranks (ZeRO-2), then the SP=2 run resumed from its step-3
    checkpoint: four launches, two at a time."""
    tmp = tmp_path_factory.mktemp("masked")
    first = {
        "ref": _masked(
            short_docs, tmp / "ref", layout="ds.sequence_parallel_size=1", stage=2, ranks=1
        ),
        "sp2": _masked(
            short_docs, tmp / "sp2", layout="ds.sequence_parallel_size=2", stage=3, ranks=2
        ),
        "tp2": _masked(
            short_docs, tmp / "tp2", layout="ds.tensor_parallel.autotp_size=2", stage=2, ranks=2
        ),
    }
    tag = tmp / "sp2" / "checkpoints" / "step00000003"
    resumed = _masked(
        short_docs,
        tmp / "resumed",
        layout="ds.sequence_parallel_size=2",
        stage=3,
        ranks=2,
        extra=["--resume", str(tag)],
    )
    done = dict(zip(first, run_recipes(list(first.values())), strict=True))
    done["resumed"] = run_recipes([resumed])[0]
    return tmp, done


def _train_rows(out) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out, "train")}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sp2", "tp2"])
def test_masked_runs_at_sp2_and_tp2_equal_the_run_on_one_rank(masked_runs, name):
    """Slow (4 launches). Per-step losses and gradient norms within 1e-5 relative of the
    1-rank run with masking on, and its validation loss and bits per byte: under Ulysses the
    mask stays whole across the all-to-all (a mask lost there gives other losses), under AutoTP
    each rank's heads get it. The launch printed the attention and recorded the setting."""
    tmp, done = masked_runs
    ref, run = _train_rows(tmp / "ref"), _train_rows(tmp / name)
    assert sorted(ref) == sorted(run) == list(range(1, STEPS_MASKED + 1))
    for step in ref:
        for key in ("loss", "grad_norm"):
            assert run[step][key] == pytest.approx(ref[step][key], rel=1e-5), (step, key)
    val_ref, val = read_metrics(tmp / "ref", "val")[-1], read_metrics(tmp / name, "val")[-1]
    for key in ("val_loss", "val_bpb"):
        assert val[key] == pytest.approx(val_ref[key], rel=1e-5), key
    config = json.loads((tmp / name / "config.json").read_text())
    assert config["run"]["data"]["document_mask"] is True
    assert config["launch"]["attention"] == "sdpa"
    assert "attention sdpa, documents masked" in done[name].stdout


@pytest.mark.slow
def test_masked_resume_is_exact(masked_runs):
    """Slow (shares ``masked_runs``): steps 4-6 after resuming the SP=2 run's step-3 checkpoint
    are bitwise those of the run that went on."""
    tmp, done = masked_runs
    full, resumed = _train_rows(tmp / "sp2"), _train_rows(tmp / "resumed")
    assert sorted(resumed) == list(range(4, STEPS_MASKED + 1))
    for step in resumed:
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert resumed[step][key] == full[step][key], (step, key)
    val_full, val_resumed = (read_metrics(tmp / n, "val")[-1] for n in ("sp2", "resumed"))
    assert val_resumed["val_loss"] == val_full["val_loss"]
    assert f"resumed from {tmp / 'sp2' / 'checkpoints' / 'step00000003'}" in done["resumed"].stdout


@pytest.fixture(scope="module")
def layout_logits(tiny_data, tmp_path_factory) -> dict:
    """tests/scripts/document_logits.py on 2 ranks, one launch for both layouts: Ulysses SP=2
    under ZeRO-3, then AutoTP TP=2 under ZeRO-2, each the real engine of the tiny recipe at
    PARALLEL_SHAPE with masking on; what it saved (its docstring)."""
    tmp = tmp_path_factory.mktemp("layout_logits")
    out = tmp / "logits.pt"
    args = [str(out), str(tiny_data), str(tmp / "runs"), "sp2", "tp2", "--"]
    args += ["--data", str(tiny_data), *sets(*PARALLEL_SHAPE)]
    run_recipes([dict(args=args, ranks=2, recipe="tests/scripts/document_logits.py")])
    return torch.load(out)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the largest magnitude of the reference."""
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["sp2", "tp2"])
def test_a_document_does_not_see_the_one_before_it_at_sp2_and_tp2(layout_logits, layout):
    """Slow (one 2-rank launch for both layouts, about 17 s here; the real engines' logits are
    what the step-loss drill above cannot show). B (22 tokens, across both ranks' slices under
    SP=2) after A and after A' (10 tokens each): its logits and per-token nats bitwise equal on
    each layout; B alone at the window's start the same within 1e-6 (0.0 measured: bitwise);
    every window's logits and nats within 1e-6 relative of the plain model's at SP=1, TP=1
    through the same step code (SP=2: 0.0; TP=2: 2.9e-7 and 1.6e-7 measured), and B's within
    1e-6 of plain transformers' B alone. Masking off on the same engine, A reaches B (the
    test can fail: so does a mask lost across Ulysses' all-to-all)."""
    got, ref, s = layout_logits[layout], layout_logits["reference"], layout_logits["b_start"]
    n = ref["alone"].size(0)  # B's tokens that have a target inside B
    assert "documents masked" in got["describe"]
    masked = got["masked"]
    for key in ("logits", "nats"):
        after_a, after_other, alone = masked[key][0, s:], masked[key][1, s:], masked[key][2, :n]
        assert torch.equal(after_a, after_other), (key, (after_a - after_other).abs().max())
        assert torch.equal(alone, masked[key][3, :n]), key  # what follows B changes nothing
        assert _relative(after_a, alone) <= 1e-6, key
        assert _relative(masked[key], ref[key]) <= 1e-6, key
    assert _relative(masked["logits"][0, s:], ref["alone"]) <= 1e-6
    unmasked = got["unmasked"]["logits"]
    leak = (unmasked[0, s:] - unmasked[1, s:]).abs().max().item()
    assert leak > 1e-3  # A leaks into B
    print(  # the figures of docs/training.md (pytest -s)
        f"{layout}: against SP=1, TP=1 logits {_relative(masked['logits'], ref['logits']):.2g} "
        f"losses {_relative(masked['nats'], ref['nats']):.2g}; unmasked, A moves B by {leak:.2g}"
    )
