"""Which layouts a checkpoint resumes at, decided from its manifest before anything loads
(``anneal.launch.parallel.check_resume_stage`` and ``check_resume_layout``): another number of
ranks within a ZeRO stage family (ZeRO-1/2, ZeRO-3), ZeRO-1 and 2 for each other, another
sequence-parallel degree on as many ranks, another tensor-parallel degree (or TP on another
number of ranks) at ZeRO-1/2; refused, each with the setting that works: a move between
ZeRO-1/2 and ZeRO-3 either way, another number of ranks without ZeRO, a change that needs
DeepSpeed's universal checkpoint with sequence parallelism on either side, and a
tensor-parallel change at ZeRO-3 or without ZeRO. The resumes that are carried run end to end
in tests/test_world_size.py, tests/test_sequence_parallel.py and tests/test_tensor_parallel.py."""

import json

import pytest

from anneal.errors import UserError
from anneal.launch import parallel
from anneal.resilience.manifest import read_manifest

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
    assert parallel.saved_zero_stage(doc) == stage


@pytest.mark.parametrize(
    "saved,stage,ranks",
    [(1, 1, 1), (2, 2, 1), (1, 2, 2), (2, 1, 1), (3, 3, 1), (3, 3, 4), (0, 0, 2), (None, 3, 1)],
)
def test_what_resumes(tmp_path, saved, stage, ranks):
    files = {0: NONE, 1: ZERO12, 2: ZERO12, 3: ZERO3}.get(saved, [])
    doc = manifest(files, **({} if saved is None else {"zero_stage": saved}))
    parallel.check_resume_stage(tmp_path, doc, stage=stage, world_size=ranks)


@pytest.mark.parametrize(
    "saved,stage,ranks,match",
    [
        (2, 3, 2, "saved at ZeRO-1 or 2 .* stage 3.*stage=2"),
        (1, 3, 1, "stage=1"),
        (3, 2, 2, "saved at ZeRO stage 3 .* stage 2.*stage=3"),
        (3, 1, 1, "stage=3"),
        (0, 0, 1, "saved by 2 ranks without ZeRO.*resume with 2 ranks"),
        (0, 2, 2, "stage=0"),
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


def test_a_conversion_the_disk_cannot_hold_is_refused_before_it_starts(tmp_path, monkeypatch):
    """Twice the checkpoint's size must be free where the conversion goes; otherwise the
    figures, on every rank, and nothing written."""
    import shutil
    from collections import namedtuple

    from anneal.resilience import universal

    tag = tmp_path / "run" / "checkpoints" / "step00000004"
    tag.mkdir(parents=True)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 3000)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, 5999))
    with pytest.raises(UserError, match=r"twice the checkpoint's 0.00 GiB.*Free space") as e:
        universal.check_space(tag, tag.parent)
    assert e.value.every_rank
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, 6000))
    universal.check_space(tag, tag.parent)
    universal.check_space(tag, tmp_path / "new" / "checkpoints")  # a new run's, not there yet
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        ["run", "checkpoints", "step00000004", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    )
