"""The launcher: every shipped hostfile parses, bad hostfiles name the line, the exact
deepspeed argument list is built, and two "nodes" on this machine (hostfiles/loopback,
--no-ssh, one launcher per node) train together through DeepSpeed's real runner."""

import subprocess
import sys
from pathlib import Path

import pytest

from launcher import hostfile
from launcher.__main__ import deepspeed_args
from launcher.__main__ import main as launcher_main
from tests.conftest import ROOT, SMALL, env, free_port, kill_tree, read_metrics

HOSTFILES = sorted((ROOT / "hostfiles").iterdir())


@pytest.mark.parametrize("path", HOSTFILES, ids=lambda p: p.name)
def test_shipped_hostfiles_parse(path):
    hosts = hostfile.parse(path)
    assert hosts and all(slots >= 1 for slots in hosts.values())


def test_loopback_is_two_nodes():
    assert hostfile.parse(ROOT / "hostfiles" / "loopback") == {"node1": 1, "node2": 1}


@pytest.mark.parametrize(
    "text,match",
    [
        ("gpu1 slots=8\ngpu2 slot=8\n", "line 2"),
        ("gpu1 slots=8\ngpu1 slots=8\n", "listed twice"),
        ("# nothing\n", "no hosts"),
        ("gpu1 slots=0\n", "at least 1"),
    ],
)
def test_bad_hostfiles(tmp_path, text, match):
    path = tmp_path / "hf"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        hostfile.parse(path)


def test_hostfile_command_round_trips(tmp_path):
    out = tmp_path / "hf"
    assert launcher_main(["hostfile", "--hosts", "a,b,c", "--slots", "4", "--out", str(out)]) == 0
    assert hostfile.parse(out) == {"a": 4, "b": 4, "c": 4}


def test_exact_deepspeed_arguments():
    assert deepspeed_args(
        recipe="recipes/pretrain_1b.py",
        recipe_args=["--out", "runs/1b"],
        hostfile_path="hostfiles/h100",
        master_port=29600,
    ) == [
        "--hostfile",
        "hostfiles/h100",
        "--master_port",
        "29600",
        "recipes/pretrain_1b.py",
        "--out",
        "runs/1b",
    ]
    assert deepspeed_args(
        recipe="r.py",
        recipe_args=[],
        hostfile_path="hf",
        no_ssh=True,
        node_rank=1,
        master_addr="10.0.0.1",
    ) == ["--hostfile", "hf", "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1", "r.py"]


def test_preflight_rejects_bad_launches(capsys):
    assert launcher_main(["run", "--dry-run", "recipes/nope.py"]) == 2
    assert "recipes/nope.py: no such file" in capsys.readouterr().err
    assert (
        launcher_main(
            [
                "run",
                "--hostfile",
                "hostfiles/loopback",
                "--no-ssh",
                "--dry-run",
                "recipes/pretrain_tiny.py",
            ]
        )
        == 2
    )
    assert "--node-rank and --master-addr" in capsys.readouterr().err
    assert (
        launcher_main(["run", "--dry-run", "recipes/pretrain_tiny.py", "--ds-config", "zero9.json"])
        == 2
    )


@pytest.mark.slow
def test_two_nodes_train_together(stdlib_data, tmp_path):
    out = tmp_path / "run"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launcher",
                "run",
                "--hostfile",
                "hostfiles/loopback",
                "--no-ssh",
                "--node-rank",
                str(k),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "recipes/pretrain_tiny.py",
                "--out",
                str(out),
                "--data",
                str(stdlib_data),
                "--max-steps",
                "2",
                "--eval-every",
                "2",
                "--save-every",
                "2",
                *SMALL,
            ],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for k in (0, 1)
    ]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            kill_tree(p)
        logs = [p.communicate()[0] for p in procs]
        pytest.fail("the two nodes did not finish in 300 s:\n" + "\n".join(x[-3000:] for x in logs))
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "2 rank(s)" in logs[0]
    assert [r["step"] for r in read_metrics(out, "train")] == [1, 2]
    manifest = Path(out / "checkpoints" / "step00000002" / "manifest.json")
    assert '"world_size": 2' in manifest.read_text()
