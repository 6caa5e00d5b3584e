"""Checkpoint integrity without a training run (a stand-in engine writes the files a ZeRO save
writes): the manifest holds a hash per file; a shard corrupted in place at the same size, or
truncated, makes the newest checkpoint fail verification and ``--resume auto`` fall back to the
previous one, while an explicit path refuses; a save that dies midway (a full disk) leaves the
previous checkpoint the newest and deletes nothing; keep_last prunes all but the newest K and
the keep_every milestones; the files stay valid zips (anneal export reads them with zipfile),
and the manifest's hash catches a flipped byte that torch.load reads without complaint."""

import errno
import json
import zipfile
from pathlib import Path

import pytest
import torch

from anneal.errors import UserError
from anneal.resilience import checkpoint


class FakeEngine:
    """Writes what a 2-rank ZeRO-3 save writes, in one process; optionally fails midway."""

    def __init__(self, fail_after_files: int | None = None):
        self.fail_after_files = fail_after_files

    def save_checkpoint(self, save_dir, *, tag, client_state, save_latest):
        tag_dir = Path(save_dir) / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        step = client_state["step"]
        for n, r in enumerate((0, 1)):
            if self.fail_after_files is not None and n >= self.fail_after_files:
                raise OSError(errno.ENOSPC, "No space left on device")
            for kind, size in (("model", 3000), ("optim", 200_000)):
                data = bytes((step * 7 + r + i) % 251 for i in range(size))
                (tag_dir / f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt").write_bytes(data)


class TorchSaveEngine:
    """Writes one rank's model states with torch.save, as DeepSpeed's checkpoint engine does."""

    weights = torch.arange(100_000, dtype=torch.float32)

    def save_checkpoint(self, save_dir, *, tag, client_state, save_latest):
        tag_dir = Path(save_dir) / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"w": self.weights, "client": client_state}, tag_dir / MODEL_STATES)


MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def save(ckpt: Path, step: int, engine=None, **keep) -> Path:
    keep = {"keep_last": 10, **keep}
    client = {"step": step, "tokens": step * 100, "data": {"position": step * 8}}
    return checkpoint.save(engine or FakeEngine(), ckpt, step=step, client_state=client, **keep)


def shard(tag_dir: Path) -> Path:
    return tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def test_manifest_holds_size_and_hash_of_every_file(tmp_path):
    tag_dir = save(tmp_path, 2)
    manifest = json.loads((tag_dir / "manifest.json").read_text())
    assert len(manifest["files"]) == 4
    for name, entry in manifest["files"].items():
        assert entry["size"] == (tag_dir / name).stat().st_size
        assert entry[checkpoint.HASH] == checkpoint.file_hash(tag_dir / name)
    assert (tmp_path / "latest").read_text() == "step00000002"
    assert checkpoint.verify(tag_dir) == []


def test_same_size_corruption_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    save(tmp_path, 2)
    newest = save(tmp_path, 4)
    data = bytearray(shard(newest).read_bytes())
    data[1000:1010] = bytes(10)  # same size: the size check alone passes it
    shard(newest).write_bytes(bytes(data))
    assert checkpoint.is_intact(newest)
    assert checkpoint.verify(newest) == [shard(newest).name]
    chosen = checkpoint.find_resume("auto", tmp_path)
    assert chosen == newest
    assert checkpoint.verified_resume(chosen, fallback=True) == tmp_path / "step00000002"
    assert "step00000004 is corrupt" in caplog.text
    with pytest.raises(UserError, match="corrupt"):
        checkpoint.verified_resume(newest, fallback=False)


def test_one_chooser_takes_the_newest_by_step_before_a_step_or_verified(tmp_path):
    """``resume.choose`` (resume's, the export's and eval's chooser): the newest intact tag,
    the one of a step, the newest before a step, None where there is none; ``verified`` skips
    a newer tag whose bytes changed, telling ``on_damaged`` which files differ."""
    from anneal.resilience.resume import choose

    tags = {step: save(tmp_path, step) for step in (2, 4, 6)}
    assert choose(tmp_path / "none") is None
    assert choose(tmp_path) == tags[6]
    assert choose(tmp_path, step=4) == tags[4]
    assert choose(tmp_path, step=5) is None
    assert choose(tmp_path, before_step=6) == tags[4]
    assert choose(tmp_path, before_step=2) is None
    data = bytearray(shard(tags[6]).read_bytes())
    data[10] ^= 1  # same size
    shard(tags[6]).write_bytes(bytes(data))
    damaged = []
    chosen = choose(tmp_path, verified=True, on_damaged=lambda t, bad: damaged.append((t, bad)))
    assert chosen == tags[4]
    assert damaged == [(tags[6], [shard(tags[6]).name])]
    assert choose(tmp_path) == tags[6]  # by size, still intact


def test_truncated_shard_is_not_intact(tmp_path):
    save(tmp_path, 2)
    newest = save(tmp_path, 4)
    shard(newest).write_bytes(shard(newest).read_bytes()[:-1])
    assert not checkpoint.is_intact(newest)
    assert checkpoint.find_resume("auto", tmp_path) == tmp_path / "step00000002"


def test_a_save_that_fails_midway_costs_nothing(tmp_path):
    save(tmp_path, 2, keep_last=1)
    with pytest.raises(OSError, match="No space"):
        save(tmp_path, 4, engine=FakeEngine(fail_after_files=1), keep_last=1)
    assert (tmp_path / "latest").read_text() == "step00000002"
    assert checkpoint.find_resume("auto", tmp_path) == tmp_path / "step00000002"
    assert checkpoint.verify(tmp_path / "step00000002") == []
    # the next save at that step replaces the torn directory instead of mixing with it
    assert checkpoint.verify(save(tmp_path, 4, keep_last=1)) == []
    assert [p.name for p in checkpoint.intact_checkpoints(tmp_path)] == ["step00000004"]


def test_keep_last_and_milestones(tmp_path):
    for step in range(1, 11):
        save(tmp_path, step, keep_last=3, keep_every=4)
    kept = [checkpoint.read_manifest(p)["step"] for p in checkpoint.intact_checkpoints(tmp_path)]
    assert kept == [4, 8, 9, 10]


def test_manifests_without_hashes_still_load(tmp_path):
    tag_dir = save(tmp_path, 2)
    manifest = json.loads((tag_dir / "manifest.json").read_text())
    manifest["files"] = {n: e["size"] for n, e in manifest["files"].items()}  # the old format
    (tag_dir / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.is_intact(tag_dir) and checkpoint.verify(tag_dir) == []


def test_saved_files_are_valid_zips_and_the_hash_catches_what_torch_load_accepts(tmp_path):
    # The files stay valid zip archives (anneal export reads them with zipfile, which checks
    # each record's CRC32); torch.load does not check it, so the manifest's hash is what
    # catches a flipped byte.
    tag_dir = save(tmp_path, 2, engine=TorchSaveEngine())
    path = tag_dir / MODEL_STATES
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    assert torch.equal(torch.load(path, weights_only=False)["w"], TorchSaveEngine.weights)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the weights' record
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=False)["w"], TorchSaveEngine.weights)
    assert checkpoint.verify(tag_dir) == [MODEL_STATES]
