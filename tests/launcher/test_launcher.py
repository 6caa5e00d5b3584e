"""The launcher: one command line for every subcommand (launcher options anywhere, recipe flags
after ``--``, a dry run starts nothing), the exact deepspeed argument list, ``.deepspeed_env``
and the rendered sbatch (golden files), the pre-flight's line for a resume on another number
of ranks, hostfiles and Slurm node lists (against ``scontrol show hostnames`` where Slurm is
installed), every bad input of issues 7 and 8 as one paragraph with exit 2 and nothing
written, and two "nodes" on this machine (hostfiles/loopback, --no-ssh, one launcher per node)
that train, checkpoint and resume through DeepSpeed's real runner."""

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import launcher.__main__ as launcher_cli
from anneal.errors import UserError
from launcher import dsenv, hostfile, slurm, venv
from launcher.__main__ import deepspeed_args, split_argv
from launcher.__main__ import main as launcher_main
from tests.conftest import ROOT, SMALL, env, free_port, kill_tree, read_metrics, tree

HOSTFILES = sorted((ROOT / "hostfiles").iterdir())
GOLDEN = Path(__file__).parents[1] / "golden"


def golden(name: str, text: str) -> None:
    """Compare with tests/golden/NAME; ANNEAL_UPDATE_GOLDEN=1 rewrites it."""
    path = GOLDEN / name
    if os.environ.get("ANNEAL_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs (ANNEAL_UPDATE_GOLDEN=1 rewrites it)"


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
        ("gpu1 slots=x\n", "line 1"),
        ("gpu1;touch${IFS}/tmp/x slots=8\n", "characters other than"),
        ("$(reboot) slots=8\n", "characters other than"),
        ("-oProxyCommand=x slots=8\n", "starts with '-'"),
    ],
)
def test_bad_hostfiles(tmp_path, text, match):
    path = tmp_path / "hf"
    path.write_text(text)
    with pytest.raises(UserError, match=match):
        hostfile.parse(path)


NODELISTS = [
    (
        "gpu[001-003,007],cpu-a[1-2]-ib",
        ["gpu001", "gpu002", "gpu003", "gpu007", "cpu-a1-ib", "cpu-a2-ib"],
    ),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[01-3]", ["n01", "n02", "n03"]),
    ("x", ["x"]),
    ("a[1-2],b,c.d_e", ["a1", "a2", "b", "c.d_e"]),
    ("n[1-3]x[05-06]", ["n1x05", "n1x06", "n2x05", "n2x06", "n3x05", "n3x06"]),
    ("rack1-n[1,3-4]", ["rack1-n1", "rack1-n3", "rack1-n4"]),
    ("node[1-2]", ["node1", "node2"]),
]


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory):
    """A slurm.conf that ``scontrol show hostnames`` can read (it needs no daemon)."""
    path = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    path.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n")
    return path


@pytest.mark.parametrize("nodelist,expected", NODELISTS, ids=[n for n, _ in NODELISTS])
def test_nodelist_expansion(nodelist, expected, slurm_conf, monkeypatch):
    assert slurm.expand_nodelist(nodelist) == expected
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol (Debian package slurm-client) is absent: checked without reference")
    monkeypatch.setenv("SLURM_CONF", str(slurm_conf))
    reference = slurm.scontrol_hostnames(nodelist)
    if reference is None:
        # Slurm 22.05 refuses text after a single bracket group ("cpu-a[1-2]-ib"), which
        # newer Slurm and real clusters' names use; the expected list above is the reference.
        assert "]-" in nodelist or "]b" in nodelist, f"scontrol refused {nodelist}"
        return
    assert reference == expected


@pytest.mark.parametrize(
    "nodelist", ["n[3-1]", "n[1-2", "n[a-b]", "n[]", "n[1-2]]", "n;rm", "a[1-2],a1", "", "n[[1]]"]
)
def test_bad_nodelists(nodelist):
    with pytest.raises(UserError, match="does not parse"):
        slurm.expand_nodelist(nodelist)


def test_hostfile_from_slurm(tmp_path):
    environ = {"SLURM_JOB_NODELIST": "gpu[001-002]", "SLURM_GPUS_ON_NODE": "8"}
    assert hostfile.from_slurm(environ) == {"gpu001": 8, "gpu002": 8}
    assert hostfile.from_slurm(environ, slots=4) == {"gpu001": 4, "gpu002": 4}
    with pytest.raises(UserError, match="--slots"):
        hostfile.from_slurm({"SLURM_JOB_NODELIST": "a"})
    with pytest.raises(UserError, match="not inside a Slurm"):
        hostfile.from_slurm({})


def test_hostfile_command(tmp_path, monkeypatch, capsys):
    out = tmp_path / "hf"
    assert launcher_main(["hostfile", "--hosts", "a,b,c", "--slots", "4", "--out", str(out)]) == 0
    assert hostfile.parse(out) == {"a": 4, "b": 4, "c": 4}
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[001-003,007]")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    assert launcher_main(["hostfile", "--from-slurm", "--out", str(out)]) == 2  # it exists
    assert hostfile.parse(out) == {"a": 4, "b": 4, "c": 4}
    assert launcher_main(["hostfile", "--from-slurm", "--out", str(out), "--force"]) == 0
    assert out.read_text() == "".join(f"gpu00{i} slots=8\n" for i in (1, 2, 3, 7))
    capsys.readouterr()
    bad = tmp_path / "bad"
    # --nodes larger than the allocation; a node list that does not parse; a shell metacharacter
    assert launcher_main(["hostfile", "--from-slurm", "--nodes", "5", "--out", str(bad)]) == 2
    assert "allocation has 4 hosts" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[001-003")
    assert launcher_main(["hostfile", "--from-slurm", "--out", str(bad)]) == 2
    assert "does not parse" in capsys.readouterr().err
    assert launcher_main(["hostfile", "--hosts", "a,b;reboot", "--out", str(bad)]) == 2
    assert "'b;reboot'" in capsys.readouterr().err
    assert not bad.exists()


def test_command_line_split():
    assert split_argv(["run", "r.py", "--dry-run", "--", "--out", "x", "--", "y"]) == (
        ["run", "r.py", "--dry-run"],
        ["--out", "x", "--", "y"],
    )


@pytest.mark.parametrize("missing", ["torch", "deepspeed"])
def test_a_python_without_torch_or_deepspeed_gets_the_fix_not_a_traceback(
    missing, tiny_data, tmp_path, capsys, monkeypatch
):
    """``python -m launcher run`` and ``submit`` with a Python that cannot import torch or
    DeepSpeed (a bare ``python`` outside the virtual environment): one paragraph naming the
    package, this Python and the fix (``.venv/bin/python``, ``make setup``), exit 2, nothing
    written; not a ModuleNotFoundError traceback."""
    for name in [m for m in sys.modules if m == missing or m.startswith(missing + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # `import torch` raises ModuleNotFoundError
    out = tmp_path / "run"
    flags = ["--", "--out", str(out), "--data", str(tiny_data)]
    for argv in (
        ["run", "--device", "cpu", "--num-gpus", "1", "recipes/pretrain_tiny.py", *flags],
        ["submit", "recipes/pretrain_tiny.py", "--nodes", "1", "--gpus-per-node", "1"]
        + ["--partition", "p", "--time", "01:00:00", "--device", "cpu", "--dry-run", *flags],
    ):
        assert launcher_main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"launcher: error: this Python ({sys.executable}) cannot import {missing}"
        ), err
        assert ".venv/bin/python -m launcher" in err and "make setup" in err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_python_m_launcher_without_torch_exits_2_with_the_fix(tmp_path):
    """``python -m launcher run`` as a process whose Python has no torch at all (the import
    blocked before anything of the launcher loads): exit 2 and the paragraph, no traceback; its
    ``hostfile`` needs no torch and still works (the sbatch script runs it first)."""
    block = "import runpy, sys; sys.modules['torch'] = None; "
    block += "runpy.run_module('launcher', run_name='__main__', alter_sys=True)"
    for argv, rc in (
        (["run", "recipes/pretrain_tiny.py", "--dry-run"], 2),
        (["hostfile", "--hosts", "a", "--out", str(tmp_path / "h"), "--dry-run"], 0),
    ):
        done = subprocess.run(
            [sys.executable, "-c", block, *argv],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env(),
        )
        assert done.returncode == rc, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        if rc == 2:
            assert "cannot import torch" in done.stderr and "make setup" in done.stderr


def test_the_packages_the_launcher_names_are_the_requirements():
    """Each package the launcher's missing-package paragraph covers is one of
    requirements.txt's, so the advice (install the requirements in .venv) is right."""
    names = {
        line.split("==")[0].strip()
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert set(venv.NEEDS) <= names


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("hostfile", dict(hostfile_path="hostfiles/h100", master_port=29600)),
        ("no_ssh", dict(hostfile_path="hf", no_ssh=True, node_rank=1, master_addr="10.0.0.1")),
        ("num_gpus", dict(num_gpus=2)),
        ("num_nodes", dict(hostfile_path="hf", num_nodes=1, num_gpus=4)),
    ],
)
def test_exact_deepspeed_arguments(name, kwargs):
    args = deepspeed_args(
        recipe="recipes/pretrain_1b.py", recipe_args=["--out", "runs/1b"], **kwargs
    )
    golden(f"deepspeed_args.{name}.txt", "\n".join(args) + "\n")


def test_dry_run_prints_the_exact_command(tiny_data, tmp_path, capsys, monkeypatch):
    """Launcher options after RECIPE count (issue 7: this once started a real launch)."""
    out = tmp_path / "run"
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    argv = [
        "run",
        "recipes/pretrain_tiny.py",
        "--num-gpus",
        "2",
        "--dry-run",
        "--device",
        "cpu",
        "--",
        "--out",
        str(out),
        "--data",
        str(tiny_data),
        "--max-steps",
        "10",
    ]
    assert launcher_main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        f"{Path(sys.executable).parent / 'deepspeed'} --num_gpus 2 recipes/pretrain_tiny.py "
        f"--out {out} --data {tiny_data} --max-steps 10" in printed
    )
    assert "NCCL_DEBUG=INFO" in printed and "hf_secret" not in printed
    assert "forecast:" in printed and "per process" in printed and "per GPU" not in printed
    assert not out.exists()


def test_pre_flight_says_a_resume_on_fewer_ranks_converts_the_checkpoint(
    two_rank_run, tiny_data, capsys
):
    """``run`` and ``submit`` (dry runs) continuing the session's 2-rank ZeRO-3 run on 1 rank
    print the layout change, the conversion and the batch arithmetic for the new layout before
    anything starts, one line; at the layout
    the checkpoint was saved at they print none. Nothing in the run directory changes (other
    tests read it)."""
    out = two_rank_run["out"]
    before = tree(out)
    flags = ["--", "--out", str(out), "--data", str(tiny_data), "--max-steps", "3"]
    flags += ["--val-every", "0", "--save-every", "1", *SMALL, "--resume", "auto"]
    line = (
        "resume: step00000002 was saved on 2 ranks, ZeRO-3; this launch is 1 rank, ZeRO-3: it "
        "is converted once to DeepSpeed's universal checkpoint under this run's "
        "checkpoints/.universal/ and loaded from there"
    )
    submit = ["submit", "recipes/pretrain_tiny.py", "--gpus-per-node", "1", "--partition", "p"]
    submit += ["--time", "01:00:00", "--device", "cpu", "--dry-run"]
    run = ["run", "recipes/pretrain_tiny.py", "--device", "cpu", "--dry-run"]
    # The batch arithmetic for 1 rank: SMALL pins 2 accumulation steps, which halves the saved
    # global batch of 16 (micro-batch 4 x 2 steps x 2 ranks); 4 steps keep it.
    halved = (
        "; the global batch CHANGES from 16 to 8 samples (4 a micro-batch x 2 accumulation "
        "steps x 1 data-parallel rank), as this launch's batch settings say; --set "
        "ds.gradient_accumulation_steps=4 keeps 16"
    )
    kept = (
        "; the global batch stays 16 samples, here 4 a micro-batch x 4 accumulation steps x 1 "
        "data-parallel rank"
    )
    accum4 = ["--set", "ds.gradient_accumulation_steps=4"]
    for argv, changed, batch in (
        ([*run, "--num-gpus", "1", *flags], True, halved),
        ([*run, "--num-gpus", "1", *flags, *accum4], True, kept),
        ([*submit, "--nodes", "1", *flags], True, halved),
        ([*submit, "--nodes", "2", *flags], False, None),
    ):
        code = launcher_main(argv)
        printed, err = capsys.readouterr()
        assert code == 0, err
        notes = [n for n in printed.splitlines() if n.startswith("resume: ")]
        assert len(notes) == changed, printed
        if changed:
            assert notes[0].startswith(line), printed
            assert notes[0].endswith(batch), printed
    assert tree(out) == before


@pytest.mark.parametrize(
    "recipe", ["pretrain_125m.py", "pretrain_1b.py", "long_context_1b.py"], ids=lambda r: r[:-3]
)
def test_submit_forecasts_for_the_gpus_the_job_asks_for(recipe, stdlib_data, tmp_path, capsys):
    """docs/cluster.md's submit command (2 nodes x 8 GPUs, 4 hours), dry run, on this host with
    or without a GPU (issue 33): the forecast is for 16 H100s (anneal.hardware.DEFAULT_GPU) at
    40% MFU, never for this host's devices; the script asks for the GPUs; and the preemption
    signal's lead is the default grace, at least 120 s and under half the job's time (no refusal
    of a --grace-s nobody gave, no ``--signal=B:USR1@38326`` in a 4-hour job). The data is the
    docs' data/stdlib (tiny_data's 84K tokens are less than one step of these recipes, which is
    refused: anneal.resolution.batch_share), without evaluation."""
    out = tmp_path / "run"
    argv = ["submit", f"recipes/{recipe}", "--nodes", "2", "--gpus-per-node", "8"]
    argv += ["--partition", "gpu", "--time", "04:00:00", "--dry-run", "--"]
    argv += ["--out", str(out), "--data", str(stdlib_data), "--set", "train.val_samples=0"]
    code = launcher_main(argv)
    printed, err = capsys.readouterr()
    assert code == 0, err
    assert "at MFU 40% of 989 TFLOP/s x 16 devices" in printed
    assert "#SBATCH --gpus-per-node=8\n" in printed
    grace = int(re.search(r"#SBATCH --signal=B:USR1@(\d+)\n", printed)[1])
    assert 120 <= grace <= 2 * 3600 and "note: the forecast asks for" not in printed
    assert not out.exists()


def test_the_default_grace_fits_the_job():
    """The default lead of the preemption signal: two forecast steps, one save at 200 MB/s and
    30 s, at least 120 s; at most half the job's --time (in each of Slurm's forms) and Slurm's
    65535 s, with a note when that cuts it short."""
    grace = slurm.default_grace_s
    assert grace(step_s=1.0, checkpoint_bytes=int(2e9), time="04:00:00") == (120, "")
    assert grace(step_s=100.0, checkpoint_bytes=int(94e9), time="1-00") == (700, "")
    seconds, note = grace(step_s=100.0, checkpoint_bytes=int(94e9), time="20")
    assert seconds == 600 and "asks for 700 s" in note and "--time 20" in note
    seconds, note = grace(step_s=1e6, checkpoint_bytes=0, time="30-00:00:00")
    assert seconds == slurm.MAX_SIGNAL_S and "asks for 2000030 s" in note
    forms = {"90": 5400, "04:00:00": 14400, "1-12": 129600, "1-12:30": 131400, "0": None}
    assert {t: slurm.time_limit_s(t) for t in forms} == forms


def test_deepspeed_env(tmp_path):
    environ = {
        "NCCL_DEBUG": "INFO",
        "NCCL_SOCKET_IFNAME": "ib0",
        "HF_HOME": "/scratch/hf cache",
        "HF_TOKEN": "hf_xxx",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "PYTHONPATH": "/code",
        "OMP_NUM_THREADS": "8",
        "AWS_SECRET_ACCESS_KEY": "x",
        "WANDB_API_KEY": "x",
        "WANDB_PROJECT": "p",
        "MY_PASSWORD": "x",
        "HOME": "/root",
    }
    values = dsenv.select(environ, ["WANDB_PROJECT"])
    run = tmp_path / "run"
    run.mkdir()
    (run / ".deepspeed_env").write_text(
        "# hand-written: the fabric\nNCCL_SOCKET_IFNAME=eth0\n\nGITHUB_TOKEN=ghp_x\nFOO=bar\n"
    )
    runner = dsenv.write(run, values)
    golden("deepspeed_env.txt", (run / ".deepspeed_env").read_text())
    golden("deepspeed_env.runner.txt", runner.read_text())
    for path in (run / ".deepspeed_env", runner):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert "hf_xxx" not in path.read_text() and "ghp_x" not in path.read_text()
    with pytest.raises(UserError, match="looks like a secret"):
        dsenv.select(environ, ["WANDB_API_KEY"])
    with pytest.raises(UserError, match="not set"):
        dsenv.select(environ, ["NOPE"])


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("two_nodes_cpu", dict(nodes=2, gpus_per_node=1, gpus=False, account=None, grace_s=120)),
        ("eight_h100", dict(nodes=8, gpus_per_node=8, gpus=True, account="proj1", grace_s=300)),
    ],
)
def test_rendered_sbatch(name, kwargs):
    text = slurm.render_sbatch(
        job_name="anneal-1b",
        partition="debug",
        time="04:00:00",
        run_dir=Path("/runs/1b"),
        workdir=Path("/code/anneal"),
        python="/code/anneal/.venv/bin/python",
        recipe="recipes/pretrain_1b.py",
        recipe_args=["--out", "/runs/1b", "--max-steps", "9"],
        **kwargs,
    )
    golden(f"sbatch.{name}.txt", text)
    if shutil.which("bash"):
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def _launch(argv):
    return subprocess.run(
        [sys.executable, "-m", "launcher", *argv],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


BAD_LAUNCHES = {
    "ds_config_missing": (["--", "--ds-config=missing.json"], "--ds-config missing.json"),
    "ds_config_trailing": (["--", "--ds-config"], "expected one argument"),
    "ds_config_typo": (["--", "--set", "ds.zero_optimization.stag=2"], "stag"),
    "batch_not_dividing": (
        ["--num-gpus", "3", "--", "--set", "ds.train_batch_size=64"],
        "does not divide",
    ),
    "recipe_flag_before_dashes": (["--max-steps", "5"], "Recipe flags go after '--'"),
    "nodes_over_hostfile": (
        ["--hostfile", "hostfiles/loopback", "--num-nodes", "3"],
        "lists 2 hosts",
    ),
    # tiny_data has no validation window of the 7b's 4,097 tokens: evaluation off
    "disk_for_two_checkpoints": (
        ["--", "--set", "model.preset=7b", "--set", "train.val_samples=0"],
        "two checkpoints",
    ),
}


@pytest.mark.parametrize("case", BAD_LAUNCHES, ids=list(BAD_LAUNCHES))
def test_bad_launches(case, tiny_data, tmp_path, capsys, monkeypatch):
    """One paragraph on stderr, exit 2, nothing written, nothing started (no --dry-run)."""

    def start(*args, **kwargs):
        raise AssertionError(f"pre-flight let a bad launch start: {args}")

    monkeypatch.setattr(launcher_cli.subprocess, "run", start)
    extra, match = BAD_LAUNCHES[case]
    out = tmp_path / "run"
    before = extra[: extra.index("--")] if "--" in extra else extra
    after = extra[extra.index("--") + 1 :] if "--" in extra else []
    base = ["--out", str(out), "--data", str(tiny_data), "--max-steps", "10"]
    code = launcher_main(
        [
            "run",
            "recipes/pretrain_tiny.py",
            "--device",
            "cpu",
            "--no-ssh-check",
            *before,
            "--",
            *base,
            *after,
        ]
    )
    printed = capsys.readouterr()
    assert code == 2, printed.out + printed.err
    assert match in printed.err and printed.err.startswith("launcher: error: ")
    assert len(printed.err.strip().splitlines()) == 1, printed.err  # one paragraph
    assert "deepspeed" not in printed.out
    assert not out.exists()


def test_unreachable_hosts_are_listed_together(tiny_data, tmp_path):
    if shutil.which("ssh") is None:
        pytest.skip("ssh (Debian package openssh-client) is absent")
    hf = tmp_path / "hf"
    hf.write_text("127.0.0.3 slots=1\n127.0.0.4 slots=1\n")  # nothing listens there
    out = tmp_path / "run"
    data = ["--data", str(tiny_data)]
    done = _launch(
        [
            "run",
            "recipes/pretrain_tiny.py",
            "--hostfile",
            str(hf),
            "--device",
            "cpu",
            "--",
            "--out",
            str(out),
            *data,
            "--max-steps",
            "10",
        ]
    )
    assert done.returncode == 2, done.stderr
    assert "2 of 2 hosts do not answer ssh" in done.stderr
    assert "127.0.0.3:" in done.stderr and "127.0.0.4:" in done.stderr
    assert not out.exists()


@pytest.mark.slow
def test_two_nodes_train_checkpoint_and_resume(stdlib_data, tmp_path):
    """Two "nodes" with --no-ssh --node-rank K: train 2 steps, then resume to 4."""
    out = tmp_path / "run"

    def both_nodes(max_steps: int, *resume: str) -> list[str]:
        port = str(free_port())
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "launcher",
                    "run",
                    "recipes/pretrain_tiny.py",
                    "--hostfile",
                    "hostfiles/loopback",
                    "--no-ssh",
                    "--node-rank",
                    str(k),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    port,
                    "--device",
                    "cpu",
                    "--",
                    "--out",
                    str(out),
                    "--data",
                    str(stdlib_data),
                    "--max-steps",
                    str(max_steps),
                    "--val-every",
                    "2",
                    "--save-every",
                    "2",
                    *resume,
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
            pytest.fail("the nodes did not finish in 300 s:\n" + "\n".join(x[-3000:] for x in logs))
        assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
        return logs

    logs = both_nodes(2)
    assert "2 rank(s)" in logs[0]
    manifest = out / "checkpoints" / "step00000002" / "manifest.json"
    assert '"world_size": 2' in manifest.read_text()
    logs = both_nodes(4, "--resume", "auto")  # explicit: the run is now longer
    assert "resumed from" in logs[0]
    assert [r["step"] for r in read_metrics(out, "train")] == [1, 2, 3, 4]
    assert (out / "checkpoints" / "step00000004" / "manifest.json").is_file()


def test_submit_forecasts_a_float8_run_at_the_float8_peak(stdlib_data, tmp_path, capsys):
    """The same dry run of the 1b recipe with ``train.float8=tensorwise``: the forecast counts
    its float8 layers' matmuls (every hidden matrix but the first: 6 N K FLOPs a token each) at
    the H100's float8 peak (1,979 TFLOP/s) and says the MFU against the bf16 peak."""
    from anneal.model import flops_per_token, get_preset

    h, inter = 2048, 5504
    share = 6 * (18 * (4 * h * h + 3 * h * inter) - h * h)
    share /= flops_per_token(get_preset("1b").with_vocab(8192))  # the stdlib corpus's vocab
    factor = 1 - share + share * 989 / 1979
    argv = ["submit", "recipes/pretrain_1b.py", "--nodes", "2", "--gpus-per-node", "8"]
    argv += ["--partition", "gpu", "--time", "04:00:00", "--dry-run", "--"]
    argv += ["--out", str(tmp_path / "run"), "--data", str(stdlib_data)]
    argv += ["--set", "train.val_samples=0", "--set", "train.float8=tensorwise"]
    code = launcher_main(argv)
    printed, err = capsys.readouterr()
    assert code == 0, err
    assert "at MFU 40% of 989 TFLOP/s x 16 devices" in printed
    assert f"float8 peak: {factor:.2f}x the step time, MFU {0.4 / factor:.0%} against" in printed
