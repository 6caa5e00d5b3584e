"""Resume on another number of ranks (ZeRO-3, fp32 on CPU, the same global batch): a checkpoint
written by 2 ranks resumes on 1 and one written by 1 resumes on 2, with ``--resume auto``,
through DeepSpeed's universal checkpoint (converted once, cached under the resuming run's
``checkpoints/.universal/``, never in the tag directory). The
losses after the resume match a run that never changed its world size (within 1e-4 relative:
only the order of the reductions differs), the data position is kept, and the no-decay param
group still has weight decay 0 after the load (DeepSpeed 0.19.8's ZeRO-3 universal load copies
the first group's hyperparameters into every group, and shares one Adam step counter between
sub-groups, which would show in the losses)."""

import pytest

from tests.conftest import SMALL, read_metrics, run_recipe

pytestmark = pytest.mark.slow
N = 4
PAIRS = zip(SMALL[::2], SMALL[1::2], strict=True)
BASE = [x for pair in PAIRS if pair[1] != "ds.gradient_accumulation_steps=2" for x in pair]


def _args(data, out, ranks, *extra):
    accum = 4 // ranks  # 16 samples per step whatever the number of ranks (micro-batch 4)
    return [
        "--out",
        str(out),
        "--data",
        str(data),
        "--max-steps",
        str(2 * N),
        "--save-every",
        str(N),
        "--eval-every",
        "0",
        *BASE,
        "--set",
        "train.eval_samples=0",
        "--set",
        f"ds.gradient_accumulation_steps={accum}",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(stdlib_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ws") / "ref"
    run_recipe(_args(stdlib_data, out, 1), ranks=1, timeout_s=400)
    return {r["step"]: r for r in read_metrics(out, "train")}


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_on_another_number_of_ranks(stdlib_data, tmp_path, reference, before, after):
    stop = ["--set", f"train.stop_at_step={N}"]
    run_recipe(_args(stdlib_data, tmp_path, before, *stop), ranks=before, timeout_s=400)
    done = run_recipe(
        _args(stdlib_data, tmp_path, after, "--resume", "auto"), ranks=after, timeout_s=400
    )
    tag = tmp_path / "checkpoints" / f"step{N:08d}"
    assert f"resumed from {tag} at step {N}" in done.stdout
    assert f"was saved by {before} ranks, this job has {after}" in done.stderr
    [made] = (tmp_path / "checkpoints" / ".universal").glob(f"step{N:08d}-*")
    assert (made / "zero").is_dir() and (made / "manifest.json").is_file()
    assert not (tag / "universal").exists()
    assert "param groups after the universal load: weight_decay [0.1, 0.0]" in done.stderr
    [resume] = [e for e in read_metrics(tmp_path, "event") if e["event"] == "resume"]
    assert resume["position"] == N * 16
    rows = {r["step"]: r for r in read_metrics(tmp_path, "train")}
    for step in range(N + 1, 2 * N + 1):
        assert rows[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-4), step
        assert rows[step]["lr"] == pytest.approx(reference[step]["lr"], rel=1e-9), step
        assert rows[step]["tokens"] == reference[step]["tokens"]
