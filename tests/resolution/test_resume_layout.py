"""Which layouts a checkpoint resumes at, decided from its manifest before anything loads
(``anneal.resolution.parallel.check_resume_stage`` and ``check_resume_layout``): ZeRO-1, 2 and 3
on any number of ranks, whichever of them saved it, another sequence-parallel degree on as many
ranks, another tensor-parallel degree (or TP on another number of ranks) at ZeRO-1/2; refused,
each with the setting that works: a move to or from ZeRO stage 0, another number of ranks
without ZeRO, a change that needs DeepSpeed's universal checkpoint with sequence parallelism on
either side, and a tensor-parallel change with ZeRO-3 on either side or without ZeRO. The
resumes that are carried run end to end in tests/resilience/test_world_size.py,
tests/train/test_sequence_parallel.py and tests/train/test_tensor_parallel.py."""

import json

import pytest

from anneal.errors import UserError
from anneal.resilience.manifest import read_manifest, saved_zero_stage
from anneal.resolution import parallel

ZERO3 = ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
ZERO12 = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
NONE = ["mp_rank_00_model_states.pt"]


def manifest(files, **fields):
    return {"step": 4, "world_size": 2, "files": {f: {"size": 1} for f in files}, **fields}


@pytest.mark.parametrize(
    "doc,stage",
    [
        (manifest(ZERO12, zero_stage=1), 1),
        (manifest(ZERO3, zero_stage=3), 3),
        (manifest(ZERO3), 3),  # a manifest from before the field: the file names tell
        (manifest(ZERO12), 2),
        (manifest(NONE), 0),
        (manifest([]), None),
    ],
)
def test_the_saved_stage(doc, stage):
    assert saved_zero_stage(doc) == stage


@pytest.mark.parametrize(
    "saved,stage,ranks",
    [
        (1, 1, 1),
        (2, 2, 1),
        (1, 2, 2),
        (2, 1, 1),
        (3, 3, 1),
        (3, 3, 4),
        (0, 0, 2),
        (None, 3, 1),
        (2, 3, 2),  # ZeRO-1/2 <-> 3: through the universal checkpoint, made loadable at both
        (1, 3, 1),
        (3, 2, 2),
        (3, 1, 4),
    ],
)
def test_what_resumes(tmp_path, saved, stage, ranks):
    files = {0: NONE, 1: ZERO12, 2: ZERO12, 3: ZERO3}.get(saved, [])
    doc = manifest(files, **({} if saved is None else {"zero_stage": saved}))
    parallel.check_resume_stage(tmp_path, doc, stage=stage, world_size=ranks)


@pytest.mark.parametrize(
    "saved,stage,ranks,match",
    [
        (0, 0, 1, "saved by 2 ranks without ZeRO.*resume with 2 ranks"),
        (0, 2, 2, "saved at ZeRO stage 0 .* stage 2.*stage=0.*--init-from"),
        (3, 0, 2, "saved at ZeRO stage 3 .* stage 0.*stage=3"),
    ],
)
def test_what_is_refused_and_what_works_instead(tmp_path, saved, stage, ranks, match):
    files = {0: NONE, 1: ZERO12, 2: ZERO12, 3: ZERO3}[saved]
    with pytest.raises(UserError, match=match):
        parallel.check_resume_stage(
            tmp_path, manifest(files, zero_stage=saved), stage=stage, world_size=ranks
        )


@pytest.mark.parametrize(
    "value,ok", [(2, True), (0, True), (None, True), (4, False), (True, False)]
)
def test_a_manifest_with_a_stage_that_is_not_one_is_not_a_manifest(tmp_path, value, ok):
    (tmp_path / "manifest.json").write_text(json.dumps(manifest(ZERO12, zero_stage=value)))
    assert (read_manifest(tmp_path) is not None) == ok


def test_a_changed_layout_is_one_line_and_an_unchanged_one_none(tmp_path):
    tag = tmp_path / "step00000004"
    doc = manifest(ZERO12, zero_stage=2, expert_parallel_size=2)
    line = parallel.describe_resume_change(tag, doc, parallel.Layout(2, 1, 1, 1), stage=2)
    assert line.startswith("resume: step00000004 was saved on 2 ranks, ZeRO-2, expert-parallel 2;")
    assert "this launch is 2 ranks, ZeRO-2, expert-parallel 1" in line
    assert "universal checkpoint" in line and "\n" not in line
    doc = manifest(ZERO3, zero_stage=3)
    line = parallel.describe_resume_change(tag, doc, parallel.Layout(1, 1), stage=3)
    assert "saved on 2 ranks, ZeRO-3; this launch is 1 rank, ZeRO-3:" in line
    assert parallel.describe_resume_change(tag, doc, parallel.Layout(2, 1), stage=3) is None
    line = parallel.describe_resume_change(tag, doc, parallel.Layout(2, 1), stage=2)
    assert "saved on 2 ranks, ZeRO-3; this launch is 2 ranks, ZeRO-2:" in line
    doc = manifest(ZERO12, zero_stage=1)
    assert parallel.describe_resume_change(tag, doc, parallel.Layout(2, 1), stage=2) is None


@pytest.mark.parametrize(
    "saved,here,stage,says",
    [
        (  # another SP degree on as many ranks: the replicas change, the files load as saved
            dict(sequence_parallel_size=2),
            parallel.Layout(2, 1, 1),
            2,
            "saved on 2 ranks, ZeRO-2, sequence-parallel 2, data-parallel 1; this launch is "
            "2 ranks, ZeRO-2, sequence-parallel 1, data-parallel 2: its files load as saved",
        ),
        (
            dict(),
            parallel.Layout(2, 1, 2),
            3,
            "saved on 2 ranks, ZeRO-3, sequence-parallel 1, data-parallel 2; this launch is "
            "2 ranks, ZeRO-3, sequence-parallel 2, data-parallel 1: its files load as saved",
        ),
        (
            dict(tensor_parallel_size=2),
            parallel.Layout(2, 1),
            2,
            "saved on 2 ranks, ZeRO-2, tensor-parallel 2, data-parallel 1; this launch is "
            "2 ranks, ZeRO-2, tensor-parallel 1, data-parallel 2: it is converted once",
        ),
        (
            dict(tensor_parallel_size=2, world_size=4),
            parallel.Layout(4, 1),
            2,
            "saved on 4 ranks, ZeRO-2, tensor-parallel 2, data-parallel 2; this launch is "
            "4 ranks, ZeRO-2, tensor-parallel 1, data-parallel 4: it is converted once",
        ),
        (  # TP=2 on 2 ranks to TP=2 on 4: the replicas change with the ranks alone
            dict(tensor_parallel_size=2),
            parallel.Layout(4, 2),
            2,
            "saved on 2 ranks, ZeRO-2, tensor-parallel 2; this launch is 4 ranks, ZeRO-2, "
            "tensor-parallel 2: it is converted once",
        ),
    ],
)
def test_what_resumes_at_another_parallel_degree(tmp_path, saved, here, stage, says):
    files = ZERO3 if stage == 3 else ZERO12
    doc = manifest(files, zero_stage=stage, **saved)
    parallel.check_resume_layout(tmp_path, doc, here, stage=stage)
    parallel.check_resume_stage(tmp_path, doc, stage=stage, world_size=here.world_size)
    line = parallel.describe_resume_change(tmp_path / "step00000004", doc, here, stage=stage)
    assert says in line and "\n" not in line


@pytest.mark.parametrize(
    "saved,here,stage,match",
    [
        (  # SP on either side of a universal conversion
            dict(sequence_parallel_size=2),
            parallel.Layout(1, 1),
            2,
            "tp_degree=2.*Resume on 2 ranks.*--init-from",
        ),
        (dict(), parallel.Layout(4, 1, 2), 3, "get_tensor_model_parallel_world_size.*2 ranks"),
        (
            dict(sequence_parallel_size=2, expert_parallel_size=2),
            parallel.Layout(2, 1, 2),
            2,
            "Resume on 2 ranks",
        ),
        (  # TP at ZeRO-3, either way
            dict(tensor_parallel_size=2),
            parallel.Layout(2, 1),
            3,
            "at ZeRO-3.*map describes 0.*autotp_size=2 on 2 ranks.*--init-from",
        ),
        (dict(), parallel.Layout(2, 2), 3, "exceeds dimension size.*autotp_size=1 on 2 ranks"),
        (dict(tensor_parallel_size=2), parallel.Layout(4, 2), 3, "autotp_size=2 on 2 ranks"),
        (dict(tensor_parallel_size=2), parallel.Layout(2, 1), 0, "without ZeRO.*autotp_size=2"),
    ],
)
def test_what_is_refused_at_another_parallel_degree(tmp_path, saved, here, stage, match):
    doc = manifest(ZERO3 if stage == 3 else ZERO12, zero_stage=stage, **saved)
    with pytest.raises(UserError, match=match) as caught:
        parallel.check_resume_layout(tmp_path, doc, here, stage=stage)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "saved,here,stage,match",
    [
        (dict(sequence_parallel_size=2), parallel.Layout(2, 1, 2), 3, "tp_degree=2"),
        (dict(tensor_parallel_size=2), parallel.Layout(2, 2), 3, "ZeRO-3 on one side"),
        (dict(tensor_parallel_size=2, zero_stage=3), parallel.Layout(2, 2), 2, "map describes"),
    ],
)
def test_a_move_between_zero_2_and_3_is_refused_where_the_layout_is(
    tmp_path, saved, here, stage, match
):
    """A move between ZeRO-1/2 and ZeRO-3 goes through the universal checkpoint, on as many
    ranks too: so it is refused where that conversion is (SP on either side, TP with ZeRO-3 on
    either side)."""
    saved = {"zero_stage": 5 - stage, **saved}
    doc = manifest(ZERO3 if saved["zero_stage"] == 3 else ZERO12, **saved)
    parallel.check_resume_stage(tmp_path, doc, stage=stage, world_size=here.world_size)
    with pytest.raises(UserError, match=match):
        parallel.check_resume_layout(tmp_path, doc, here, stage=stage)


def test_a_conversion_the_disk_cannot_hold_is_refused_before_it_starts(tmp_path, monkeypatch):
    """3.5 times the checkpoint's size must be free where the conversion goes (3.00x was its
    peak in bench_checkpoint); otherwise the figures, on every rank, and nothing written."""
    import shutil
    from collections import namedtuple

    from anneal.resilience import universal

    tag = tmp_path / "run" / "checkpoints" / "step00000004"
    tag.mkdir(parents=True)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 3000)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, 10499))
    with pytest.raises(UserError, match=r"3.5 times the checkpoint.*prune-universal") as e:
        universal.check_space(tag, tag.parent)
    assert e.value.every_rank
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, 10500))
    universal.check_space(tag, tag.parent)
    universal.check_space(tag, tmp_path / "new" / "checkpoints")  # a new run's, not there yet
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        ["run", "checkpoints", "step00000004", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    )


@pytest.mark.parametrize(
    "accum,ranks,saved,says",
    [
        (
            4,
            1,
            16,
            "the global batch stays 16 samples, here 4 a micro-batch x 4 accumulation "
            "steps x 1 data-parallel rank",
        ),
        (
            1,
            4,
            16,
            "the global batch stays 16 samples, here 4 a micro-batch x 1 accumulation "
            "step x 4 data-parallel ranks",
        ),
        (
            2,
            1,
            16,
            "the global batch CHANGES from 16 to 8 samples (4 a micro-batch x 2 "
            "accumulation steps x 1 data-parallel rank), as this launch's batch settings say; "
            "--set ds.gradient_accumulation_steps=4 keeps 16",
        ),
        (
            1,
            4,
            24,
            "CHANGES from 24 to 16 samples (4 a micro-batch x 1 accumulation step x 4 "
            "data-parallel ranks), as this launch's batch settings say; 24 is no multiple of "
            "micro-batch 4 x 4 ranks",
        ),
        (2, 1, None, "the global batch stays 8 samples"),  # no saved record: nothing to compare
        (2, 1, "16", "the global batch stays 8 samples"),  # not a number: not trusted
    ],
)
def test_the_batch_arithmetic_at_the_new_layout(accum, ranks, saved, says):
    """The line a resume at another layout ends with: the global batch re-derived for this
    launch's ranks, kept or changed against the saved run's, and the setting that keeps it."""
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum}
    ds["train_batch_size"] = 4 * accum * ranks
    assert says in parallel.describe_batch(ds, parallel.Layout(ranks, 1), saved_batch=saved)
