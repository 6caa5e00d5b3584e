"""The optimizer state of two ZeRO checkpoints saved at the same layout, compared file by file:
a run that changed its layout and came back against the run that never did."""

from __future__ import annotations

from pathlib import Path

import torch


def optimizer_files(tag: Path) -> dict[str, dict]:
    """Each ``*_optim_states.pt`` of a ZeRO checkpoint: its optimizer state dict."""
    return {
        p.name: torch.load(p, weights_only=False)["optimizer_state_dict"]
        for p in sorted(Path(tag).glob("*_optim_states.pt"))
    }


def assert_close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    """Elementwise within 1e-5 relative (plus 1e-5 of the largest), but for fewer than one
    element in ten thousand: the steps before and after the layout changed reduce in another
    order, and Adam magnifies that where the second moment is near 0
    (tests/resilience/test_world_size.py). A load that went wrong (moments reset, slices misplaced)
    misses in most elements."""
    assert got.shape == want.shape, what
    a, b = got.double(), want.double()
    off = (a - b).abs() > 1e-5 * b.abs() + 1e-5 * b.abs().max()
    assert off.float().mean().item() < 1e-4, (what, int(off.sum()), b.numel())


def assert_same_optimizer_state(got_tag: Path, want_tag: Path) -> None:
    """The same files; in each, every param group's hyperparameters and Adam step exactly,
    its fp32 master partition and moments by ``assert_close``."""
    got, want = optimizer_files(got_tag), optimizer_files(want_tag)
    assert sorted(got) == sorted(want) and want
    for name, w in want.items():
        g = got[name]
        gb, wb = g["base_optimizer_state"], w["base_optimizer_state"]
        for gg, wg in zip(gb["param_groups"], wb["param_groups"], strict=True):
            assert {k: v for k, v in gg.items() if k != "params"} == {
                k: v for k, v in wg.items() if k != "params"
            }
        assert sorted(gb["state"]) == sorted(wb["state"])
        for i, ws in wb["state"].items():
            gs = gb["state"][i]
            assert float(gs["step"]) == float(ws["step"]), (name, i)
            for key in ("exp_avg", "exp_avg_sq"):
                assert_close(gs[key], ws[key], (name, i, key))
        masters = zip(
            g["single_partition_of_fp32_groups"], w["single_partition_of_fp32_groups"], strict=True
        )
        for i, (a, b) in enumerate(masters):
            assert_close(a, b, (name, i, "master"))


def assert_same_zero3_state(got_tag: Path, want_tag: Path) -> None:
    """``assert_same_optimizer_state`` for two ZeRO-3 checkpoints saved at the same layout:
    in each rank's file, every param group's hyperparameters exactly, and per sub-group its
    Adam step exactly, its fp32 partition and moments by ``assert_close``."""
    got, want = optimizer_files(got_tag), optimizer_files(want_tag)
    assert sorted(got) == sorted(want) and want
    for name, w in want.items():
        g = got[name]
        gb, wb = g["optimizer_state_dict"], w["optimizer_state_dict"]
        for gg, wg in zip(gb["param_groups"], wb["param_groups"], strict=True):
            assert {k: v for k, v in gg.items() if k != "params"} == {
                k: v for k, v in wg.items() if k != "params"
            }
        assert sorted(gb["state"]) == sorted(wb["state"]) and wb["state"]
        for i, ws in wb["state"].items():
            gs = gb["state"][i]
            assert float(gs["step"]) == float(ws["step"]), (name, i)
            for key in ("exp_avg", "exp_avg_sq"):
                assert_close(gs[key], ws[key], (name, i, key))
        flats = zip(g["fp32_flat_groups"], w["fp32_flat_groups"], strict=True)
        for i, (a, b) in enumerate(flats):
            assert_close(a, b, (name, i, "master"))


def adam_state(run_dir, step):
    """A ZeRO-1/2 checkpoint's AdamW state, whole: per param group its hyperparameters and
    Adam step, and its fp32 master weights and moments with the ranks' flat partitions joined
    (rank 0's first; the padding, if any, at the end)."""
    tag = run_dir / "checkpoints" / f"step{step:08d}"
    files = sorted(
        tag.glob("zero_pp_rank_*_optim_states.pt"), key=lambda p: int(p.name.split("_")[3])
    )
    sds = [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in files]
    groups = []
    for g, hyper in enumerate(sds[0]["base_optimizer_state"]["param_groups"]):
        states = [sd["base_optimizer_state"]["state"][g] for sd in sds]
        groups.append(
            {
                "hyper": {k: v for k, v in hyper.items() if k != "params"},
                "step": [float(s["step"]) for s in states],
                "master": torch.cat([sd["single_partition_of_fp32_groups"][g] for sd in sds]),
                **{k: torch.cat([s[k] for s in states]) for k in ("exp_avg", "exp_avg_sq")},
            }
        )
    return groups


def assert_same_adam_state(got, want, *, step: float, moved: int):
    """Hyperparameters and steps exactly; master weights and moments elementwise within 1e-5
    relative (plus 1e-5 of the largest), but for fewer than one element in ten thousand: steps
    taken on 2 ranks sum in another order than on 1, and Adam magnifies that where the second
    moment is near 0 (10 of 1.1M elements here, 2 -> 1 ranks), there by up to about one update
    of the learning rate. A load that went wrong (moments reset, partitions misplaced, a
    group's hyperparameters copied) misses in most elements. ``step``: the Adam step both
    must be at; ``moved``: the steps since the two states were one (each moves a master weight
    by about the learning rate at most)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g["hyper"] == w["hyper"] and set(g["step"]) == set(w["step"]) == {step}
        for key in ("master", "exp_avg", "exp_avg_sq"):
            n = min(len(g[key]), len(w[key]))  # without the padding of either layout
            assert n >= len(w[key]) - 64
            a, b = g[key][:n].double(), w[key][:n].double()
            off = (a - b).abs() > 1e-5 * b.abs() + 1e-5 * b.abs().max()
            assert off.float().mean().item() < 1e-4, (key, int(off.sum()), n)
        # each AdamW step moves a weight by about lr at most (the decay aside)
        assert (g["master"][:n] - w["master"][:n]).abs().max() <= moved * 2 * w["hyper"]["lr"]
