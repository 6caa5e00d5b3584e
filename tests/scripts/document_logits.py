"""Launched by tests/train/test_document_mask.py on 2 ranks (tests/scripts/ranks.py).

    document_logits.py OUT DATA RUN_DIR LAYOUT... -- RECIPE_ARGS...

For each LAYOUT ("sp2": Ulysses SP=2 under ZeRO-3; "tp2": AutoTP TP=2 under ZeRO-2), one after
the other in this process: Anneal's real engine for the tiny recipe with RECIPE_ARGS and
``data.document_mask=true``, in eval mode, given four windows through Anneal's own step code
(``model_inputs``, the chunked loss's per-token nats as validation reads them): [A, EOS, B] and
[A', EOS, B] (B spans both ranks' slices under SP=2), then [B, EOS, A] and [B, EOS, A'] (B
alone at the start). What each rank holds is gathered (SP: the slices along the sequence; TP:
AutoTP's head gathers the whole vocabulary on every rank), and rank 0 saves to OUT (torch.save)
the logits and nats of each layout, those with masking off on the same engine (no position
ids), and the reference: the same windows through the same step code on the plain model at
SP=1, TP=1 (built from the run's seed, as the engine's weights are), and B alone through plain
transformers (no position ids at all).
"""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist

LAYOUTS = {
    "sp2": ("ds.sequence_parallel_size=2", 3),
    "tp2": ("ds.tensor_parallel.autotp_size=2", 2),
}
A_LEN, B_LEN = 10, 22  # with the EOS between them, a window of 33 tokens (32 and its targets)


def windows(eos: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, y (4, 32) of the windows in the module docstring, and B (B_LEN,)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(2, vocab, (A_LEN,), generator=g)
    b = torch.randint(2, vocab, (B_LEN,), generator=g)
    other = (a - 2 + 7) % (vocab - 2) + 2  # A': every token another one, none EOS
    assert eos < 2 and not (a == other).any()
    end = torch.tensor([eos])
    rows = [
        torch.cat(parts) for parts in ([a, end, b], [other, end, b], [b, end, a], [b, end, other])
    ]
    rows = torch.stack(rows)
    return rows[:, :-1], rows[:, 1:], b


def gathered(engine, t: torch.Tensor) -> torch.Tensor:
    """This rank's part of (B, T, ...) made whole: under Ulysses the slices of the sequence
    group joined along T; otherwise (AutoTP's ranks hold the same) as it is."""
    if engine.sequence_parallel_size == 1:
        return t
    group = engine.seq_parallel_group
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


@torch.no_grad()
def outputs(engine, model, x, y, attention) -> dict[str, torch.Tensor]:
    """The logits (4, 32, V) and per-token nats (4, 32) of the windows through Anneal's step
    code, two windows a micro-batch (the launch's micro-batch), gathered."""
    from anneal.train import loss
    from anneal.train.step import model_inputs

    logits, nats = [], []
    for rows in (slice(0, 2), slice(2, 4)):
        inputs, targets = model_inputs(engine, x[rows], y[rows], attention)
        logits.append(gathered(engine, model(**inputs).logits.float()))
        with loss.targets(model, targets, per_token=True):
            out = model(**inputs).logits
        nats.append(gathered(engine, loss.token_nats(out, targets)))
    return {"logits": torch.cat(logits), "nats": torch.cat(nats)}


def one_layout(name: str, recipe_args: list[str], run_dir: str) -> tuple[dict, object]:
    """(this layout's outputs masked and unmasked, its launch)."""
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.model.attention import Attention
    from anneal.train import build_engine, resolve_run

    layout, stage = LAYOUTS[name]
    args = [*recipe_args, "--out", f"{run_dir}/{name}"]
    for item in (layout, f"ds.zero_optimization.stage={stage}", "data.document_mask=true"):
        args += ["--set", item]
    tiny = "recipes/pretrain_tiny.py"
    cfg, overrides = config_from_args(args, prog=tiny, on_cpu=True, **load_recipe(tiny))
    launch = resolve_run(cfg, overrides)
    assert launch.attention.document_mask and launch.attention.implementation == "sdpa"
    engine = build_engine(launch)
    engine.eval()
    x, y, _ = windows(launch.attention.eos_id, launch.preset.vocab_size)
    off = Attention()  # masking off: what Anneal always gave the model
    return {
        "masked": outputs(engine, engine, x, y, launch.attention),
        "unmasked": outputs(engine, engine, x, y, off),
        "describe": launch.attention.describe(),
    }, launch


def reference(launch) -> dict:
    """The windows at SP=1, TP=1: the plain model with the run's initial weights through the
    same step code, and B alone through plain transformers."""
    from anneal.model import build_model, init_weights_
    from anneal.train import loss

    model = build_model(launch.preset, attention=launch.attention.implementation).eval()
    init_weights_(model, std=launch.preset.initializer_range, seed=launch.cfg.train.seed)
    if launch.cfg.train.loss == "chunked":
        loss.install(model, chunk_tokens=launch.cfg.train.loss_chunk_tokens)
    one = types.SimpleNamespace(sequence_parallel_size=1)  # what model_inputs reads of one
    x, y, b = windows(launch.attention.eos_id, launch.preset.vocab_size)
    out = outputs(one, model, x, y, launch.attention)
    with torch.no_grad():
        out["alone"] = model(input_ids=b[None, :-1]).logits[0].float()  # (B_LEN - 1, V)
    return out


def main() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from anneal.dist import init_distributed, rank

    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    cut = argv.index("--")
    (out_path, _data, run_dir, *layouts), recipe_args = argv[:cut], argv[cut + 1 :]
    init_distributed(600)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    result, launch = {}, None
    for name in layouts:
        result[name], launch = one_layout(name, recipe_args, run_dir)
        # what Ulysses' registration replaced, put back for the next layout's engine
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        dist.barrier()
    if rank() == 0:
        result["reference"] = reference(launch)
        result["eos"] = launch.attention.eos_id
        result["b_start"] = A_LEN + 1
        torch.save(result, out_path)


if __name__ == "__main__":
    from anneal.dist import shutdown

    main()
    shutdown()
