"""``train.export_every_save``: a checkpoint is exported, verified, to ``RUN/hf/<tag>`` by a child
process (``anneal export``) that rank 0 starts once the save is complete on every rank, and the
training process never imports the exporter.

The fast test starts that child on a copy of the session's run (``tiny_run``): 10-20 s, most of
it the child importing torch and transformers and loading the model to verify it. The slow one
trains with the setting on: one run and two export children, about 65 s on 2 cores."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, SMALL, env, run_recipe


def test_a_save_is_exported_by_a_child_process(tiny_run, tmp_path):
    from anneal.hf.export import read_marker
    from anneal.train import ExportAfterSave

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    exports = ExportAfterSave(True)
    exports.on_checkpoint(run / "checkpoints" / "step00000002")
    exports.close()  # waits for the child
    hf = run / "hf" / "step00000002"
    assert read_marker(hf)["step"] == 2
    assert (hf / "model.safetensors").is_file()


@pytest.mark.slow
def test_each_save_of_a_run_is_exported(tiny_data, tmp_path):
    from anneal.hf.export import read_marker

    out = tmp_path / "run"
    stop = ["--max-steps", "4", "--val-every", "0", "--set", "train.stop_at_step=2"]
    done = run_recipe(
        [
            "--out",
            str(out),
            "--data",
            str(tiny_data),
            "--save-every",
            "1",
            *stop,
            *SMALL,
            "--set",
            "train.export_every_save=true",
        ]
    )
    for step in (1, 2):
        hf = out / "hf" / f"step{step:08d}"
        assert (hf / "model.safetensors").is_file(), sorted(out.rglob("*"))
        assert read_marker(hf)["step"] == step
    assert done.stdout.count("verified:") == 2, done.stdout[-3000:]


def test_the_training_process_does_not_import_the_exporter():
    probe = (
        "import sys, anneal.train; "
        "print([m for m in sys.modules if m.startswith(('anneal.hf', 'anneal.export'))])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=env()
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
