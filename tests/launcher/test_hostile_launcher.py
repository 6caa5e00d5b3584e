"""Hostile input to the launcher (``python -m launcher``) and bench/gpu.sh: refused as one clear
paragraph with exit 2, no traceback, and nothing around the command changed (issue 18).

Proves, one surface at a time:
- ``hostfile``: every value is checked before anything is written (``--slots 0`` is refused,
  not taken for 8; ``--slots -1`` writes nothing); an existing ``--out`` is kept byte for byte
  unless ``--force``, and ``--force`` replaces only a hostfile (never another file or a
  directory), by renaming a complete new file over it; hostfiles with garbage, binary bytes,
  Unicode digits, huge slot counts or duplicate hosts are refused with the line.
- ``submit``: the rendered sbatch script quotes or refuses every value; a newline or ``%`` in
  the run directory, a control character in a path or a recipe flag are refused by name; a
  virtual environment at ``u"$(touch MARKER)"/bin`` is only a path when the rendered script
  runs under bash (fake srun and scontrol): MARKER never appears.
- ``run``: ``--master-addr`` goes through the host-name check; for a pdsh launch (several
  nodes, no ``--no-ssh``) recipe flags, the recipe, the working directory and the Python with
  shell syntax are refused, and only there; DeepSpeed's own pdsh command line, run by bash,
  delivers every accepted value unchanged.
- ``.deepspeed_env``: secrets by name part (``HF_PWD``, ``HF_HUB_PAT``, ``*_PASSPHRASE``,
  ``HF_BEARER``, ``HF_HUB_CREDS``, ``TORCH_LOGIN``, ...,
  but not ``PATH`` or the shell's ``PWD``) and credentials in values (``user:pass@``) are left
  out, and the launcher prints their names, never their values.
- ``--num-gpus 0`` says what ``--num-gpus`` is and how to fix it.
- bench/gpu.sh puts only a private ``mktemp -d`` directory on PYTHONPATH and removes it.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest

from anneal.errors import UserError
from launcher import dsenv, slurm
from launcher.__main__ import main as launcher_main
from tests.conftest import tree

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "pretrain_tiny.py")
GPU_SH = ROOT / "bench" / "gpu.sh"


def launch(capsys, argv: list[str]) -> tuple[int, str, str]:
    """``python -m launcher ARGV`` in-process: (exit code, stdout, stderr), never a traceback."""
    code = launcher_main(argv)
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err
    return code, printed.out, printed.err


def refused(capsys, argv: list[str], *must: str) -> str:
    """Assert that ``argv`` exits 2 with one paragraph on stderr holding every ``must``."""
    code, out, err = launch(capsys, argv)
    assert code == 2, out + err
    assert err.startswith("launcher: error: ") and len(err.strip().splitlines()) == 1, err
    for text in must:
        assert text in err, f"{text!r} not in: {err}"
    return err


@pytest.fixture(scope="module")
def launcher_data(tmp_path_factory) -> Path:
    """A real prepared directory from a few kilobytes of text (a 300-token vocabulary)."""
    from anneal.data.prepare import prepare

    src = tmp_path_factory.mktemp("src") / "text.txt"
    src.write_text("\n\n".join(f"document {i}: " + "the quick brown fox " * 40 for i in range(150)))
    out = tmp_path_factory.mktemp("prep") / "data"
    prepare(inputs=[str(src)], out=out, vocab_size=300, val_fraction=0.2)
    return out


# --- hostfile: item 7 ---------------------------------------------------------------------


def test_slots_zero_is_refused_not_taken_for_the_default(tmp_path, capsys):
    out = tmp_path / "hf"
    refused(
        capsys,
        ["hostfile", "--hosts", "a,b", "--slots", "0", "--out", str(out)],
        "--slots",
        "at least 1",
        "e.g. 8",
    )
    assert tree(tmp_path) == {str(tmp_path): "dir"}


def test_negative_slots_write_nothing(tmp_path, capsys):
    out = tmp_path / "sub" / "hf"
    err = refused(
        capsys,
        ["hostfile", "--hosts", "a", "--slots", "-1", "--out", str(out)],
        "--slots",
        "at least 1",
    )
    assert "line 1" not in err  # the flag is blamed, not a file it should not have written
    assert tree(tmp_path) == {str(tmp_path): "dir"}


@pytest.mark.parametrize(
    "bad",
    [
        ["--slots", "-1"],
        ["--slots", "5000"],
        ["--hosts", "a,b;reboot"],
        ["--hosts", "a,a"],
        ["--nodes", "3"],
        [],  # the file exists and there is no --force
    ],
    ids=["negative-slots", "huge-slots", "metachar-host", "duplicate-host", "nodes", "no-force"],
)
def test_a_refused_call_leaves_the_existing_hostfile_byte_identical(tmp_path, capsys, bad):
    out = tmp_path / "hf"
    out.write_bytes(b"# mine, hand-written\ngpu001 slots=8\r\n")
    before = tree(tmp_path)
    hosts = [] if "--hosts" in bad else ["--hosts", "gpu001,gpu002"]
    force = ["--force"] if bad else []  # refused for the value, not for the existing file
    err = refused(capsys, ["hostfile", "--out", str(out), *hosts, *bad, *force])
    assert (bad[0] if bad else "--force") in err
    assert tree(tmp_path) == before


def test_an_existing_hostfile_is_replaced_only_with_force_and_atomically(tmp_path, capsys):
    out = tmp_path / "hf"
    out.write_text("old1 slots=2\n")
    before = tree(tmp_path)
    argv = ["hostfile", "--hosts", "gpu001,gpu002", "--slots", "4", "--out", str(out)]
    refused(capsys, argv, f"--out {out}: exists", "--force")
    assert tree(tmp_path) == before
    inode = out.stat().st_ino
    code, printed, _ = launch(capsys, [*argv, "--force"])
    assert code == 0 and "wrote" in printed
    assert out.read_text() == "gpu001 slots=4\ngpu002 slots=4\n"
    # A new file renamed over the old one (a reader sees one or the other), nothing beside it.
    assert out.stat().st_ino != inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("kind", ["text", "directory", "link", "empty"])
def test_force_replaces_nothing_but_a_hostfile(tmp_path, capsys, kind):
    out = tmp_path / "target"
    if kind == "text":
        out.write_text("my notes\nnot a hostfile\n")
    elif kind == "empty":
        out.write_text("")
    elif kind == "directory":
        out.mkdir()
        (out / "keep.txt").write_text("keep")
    else:
        (tmp_path / "real").write_text("gpu1 slots=8\n")
        out.symlink_to(tmp_path / "real")
    before = tree(tmp_path)
    err = refused(
        capsys, ["hostfile", "--hosts", "gpu001", "--out", str(out), "--force"], f"--out {out}"
    )
    assert any(s in err for s in ("not a hostfile", "a directory", "a link")), err
    assert "Name a" in err or "Choose a new file" in err
    assert tree(tmp_path) == before


def test_out_in_a_file_that_is_not_a_directory(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    before = tree(tmp_path)
    refused(
        capsys,
        ["hostfile", "--hosts", "a", "--out", str(tmp_path / "file" / "hf")],
        "not a writable directory",
    )
    assert tree(tmp_path) == before


# Hostfiles a user might hand over: each refused with the file, the line or the problem, and
# the fix, before anything else happens. ``run`` reads the hostfile first, so no data needed.
BAD_HOSTFILES = {
    "binary": (b"\xff\xfe\x00\x81gpu1 slots=8\n", "not UTF-8 text"),
    "superscript-slots": ("gpu1 slots=\u00b2\n".encode(), "line 1"),
    "fullwidth-slots": ("gpu1 slots=\uff18\n".encode(), "line 1"),
    "huge-slots": (b"gpu1 slots=99999999999999999999\n", "more than 1024"),
    "zero-slots": (b"gpu1 slots=0\n", "at least 1"),
    "unicode-host": ("gp\u00fc1 slots=8\n".encode(), "characters other than"),
    "bom": ("\ufeffgpu1 slots=8\n".encode(), "characters other than"),
    "nul": (b"gpu1\x00x slots=8\n", "characters other than"),
    "duplicate": (b"gpu1 slots=8\ngpu2 slots=8\ngpu1 slots=4\n", "line 3"),
    "extra-field": (b"gpu1 slots=8 extra\n", "is not 'HOST slots=N'"),
    "no-slots": (b"gpu1\n", "is not 'HOST slots=N'"),
    "long-host": (b"h" * 300 + b" slots=8\n", "longer than any DNS name"),
    "comments-only": (b"# gpu1 slots=8\n\n", "no hosts"),
    "huge-file": (b"a" * (2 << 20), "larger than"),
}


@pytest.mark.parametrize("case", BAD_HOSTFILES, ids=list(BAD_HOSTFILES))
def test_bad_hostfiles_are_refused_before_anything_runs(tmp_path, capsys, case):
    data, match = BAD_HOSTFILES[case]
    hf = tmp_path / "hf"
    hf.write_bytes(data)
    before = tree(tmp_path)
    err = refused(
        capsys,
        [
            "run",
            RECIPE,
            "--hostfile",
            str(hf),
            "--dry-run",
            "--device",
            "cpu",
            "--",
            "--out",
            str(tmp_path / "run"),
        ],
        f"hostfile {hf}",
        match,
    )
    assert len(err) < 600  # the message quotes a bounded piece of the line, not the file
    assert tree(tmp_path) == before


def test_a_directory_or_a_device_is_not_a_hostfile(tmp_path, capsys):
    for path in (tmp_path, Path("/dev/null"), Path("/dev/zero")):
        refused(
            capsys,
            ["run", RECIPE, "--hostfile", str(path), "--device", "cpu", "--dry-run"],
            f"hostfile {path}: not a regular file",
        )
    assert tree(tmp_path) == {str(tmp_path): "dir"}


def test_the_sbatch_script_replaces_the_hostfile_of_its_previous_run():
    """A requeued job writes RUN/hostfile again: the template passes --force (a hostfile it
    wrote is all --force replaces)."""
    text = (ROOT / "launcher" / "templates" / "multinode.sbatch").read_text()
    line = next(ln for ln in text.splitlines() if "-m launcher hostfile" in ln)
    assert "--force" in line


# --- sbatch: item 11 ----------------------------------------------------------------------


def _render(**kw):
    args = dict(
        job_name="anneal-x",
        nodes=2,
        gpus_per_node=1,
        gpus=False,
        partition="debug",
        time="01:00:00",
        account=None,
        grace_s=120,
        run_dir=Path("/runs/x"),
        workdir=Path("/code"),
        python="/code/.venv/bin/python",
        recipe="recipes/pretrain_tiny.py",
        recipe_args=["--out", "/runs/x"],
    )
    return slurm.render_sbatch(**{**args, **kw})


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(run_dir=Path("/runs/x\ntouch /tmp/pwned")), "--out '/runs/x\\ntouch /tmp/pwned'"),
        (dict(run_dir=Path("/runs/%j-x")), "holds '%'"),
        (dict(run_dir=Path("/runs/a#b")), "holds '#'"),
        (dict(run_dir=Path('/runs/a"b')), "holds '\"'"),
        (dict(run_dir=Path("/runs/a\\b")), "holds '\\\\'"),
        (dict(workdir=Path("/code\n#SBATCH --x")), "the working directory"),
        (dict(python="/py\rthon"), "the Python"),
        (dict(recipe_args=["--out", "/runs/x", "--set", "a=b\nrm -rf ~"]), "recipe argument"),
        (dict(recipe_args=["--note", "x\u2028y"]), "recipe argument"),
        (dict(grace_s=0), "--grace-s 0"),
        (dict(grace_s=70000), "--grace-s 70000"),
        (dict(master_port=0), "--master-port 0"),
        (dict(time="\uff10\uff11:00:00"), "--time"),
        (dict(partition="gpu\n#SBATCH --x"), "--partition"),
        (dict(account="a b"), "--account"),
    ],
)
def test_every_value_the_sbatch_script_embeds_is_quoted_or_refused(kw, match):
    with pytest.raises(UserError) as e:
        _render(**kw)
    msg = str(e.value)
    assert match in msg and "\n" not in msg, msg
    assert any(
        fix in msg
        for fix in ("Choose", "Remove", "Run from", "Use", "Give", "give", "only", "e.g.")
    )


def test_a_run_directory_with_a_space_is_quoted_on_the_sbatch_line():
    text = _render(run_dir=Path("/runs/my run"), recipe_args=["--out", "/runs/my run"])
    assert '#SBATCH --output="/runs/my run/logs/slurm-%j.out"' in text
    assert "RUN_DIR='/runs/my run'" in text and "--out '/runs/my run'" in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


FAKE_SLURM = {
    "srun": '#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n',
    "scontrol": '#!/bin/sh\n[ "$2" = hostnames ] && echo node1\n'
    '[ "$2" = node ] && echo "NodeName=node1 NodeAddr=127.0.0.1"\nexit 0\n',
}


def test_an_interpreter_path_with_shell_syntax_never_runs(tmp_path):
    """The sbatch script rendered for a virtual environment at ``u"$(touch MARKER)"/bin``,
    then run by bash as the batch job (fake srun and scontrol on PATH that run the node's
    command here; a fake ``deepspeed`` in that environment records what it was given): the
    path is only ever a path, so MARKER never appears, and deepspeed at that path receives
    the hostfile, node rank, rendezvous and the recipe command exactly."""
    venv = tmp_path / 'u"$(touch MARKER)"' / "bin"
    fake = tmp_path / "slurm"
    for d in (venv, fake, tmp_path / "code"):
        d.mkdir(parents=True)
    record = tmp_path / "deepspeed.argv"
    scripts = {
        venv / "python": "#!/bin/sh\nexit 0\n",
        venv / "deepspeed": f'#!/bin/sh\nprintf "%s\\0" "$0" "$@" > {shlex.quote(str(record))}\n',
        **{fake / name: text for name, text in FAKE_SLURM.items()},
    }
    for path, text in scripts.items():
        path.write_text(text)
        path.chmod(0o755)
    run_dir = tmp_path / "run"
    recipe_args = ["--out", str(run_dir), "--set", "x=$(touch MARKER)"]
    script = tmp_path / "submit.sbatch"
    script.write_text(
        _render(
            run_dir=run_dir,
            workdir=tmp_path / "code",
            python=str(venv / "python"),
            recipe_args=recipe_args,
        )
    )
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = {
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "1",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NODEID": "0",
    }
    done = subprocess.run(
        ["bash", str(script)], cwd=tmp_path / "code", env=env, capture_output=True, text=True
    )
    assert not list(tmp_path.rglob("MARKER")), done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    got = record.read_text().split("\0")[:-1]
    assert got == [
        str(venv / "deepspeed"),
        *("--hostfile", f"{run_dir}/hostfile", "--no_ssh", "--node_rank", "0"),
        *("--master_addr", "127.0.0.1", "--master_port", "29500"),
        "recipes/pretrain_tiny.py",
        *recipe_args,
    ]


def test_submit_refuses_a_newline_in_out_and_writes_nothing(tmp_path, capsys, launcher_data):
    base = ["submit", RECIPE, *"--nodes 2 --gpus-per-node 1 --partition p --device cpu".split()]
    base += ["--time", "01:00:00"]
    before = tree(tmp_path)
    for out, match in (("run\ntouch pwned", "holds '\\n'"), ("run-%j", "holds '%'")):
        for dry in ([], ["--dry-run"]):
            refused(
                capsys,
                [*base, *dry, "--", "--out", str(tmp_path / out), "--data", str(launcher_data)],
                "--out",
                match,
                "Choose an --out",
            )
    assert tree(tmp_path) == before


SUBMIT_OPTIONS = {
    "nodes-0": (["--nodes", "0"], "--nodes and --gpus-per-node must be at least 1"),
    "grace-0": (["--grace-s", "0"], "--grace-s 0"),
    "grace-negative": (["--grace-s", "-5"], "--grace-s -5"),
    "grace-over-time": (["--grace-s", "3600"], "--grace-s 3600: the job's --time 01:00:00"),
    "port": (["--master-port", "99999"], "--master-port 99999"),
    "partition": (["--partition", "gpu;reboot"], "--partition"),
    "time": (["--time", "1:00:00\n#SBATCH --x"], "--time"),
    "account": (["--account", "$(id)"], "--account"),
    "env-secret": (["--env", "HF_HUB_PAT"], "--env HF_HUB_PAT: looks like a secret"),
    "env-credential": (["--env", "HF_ENDPOINT"], "user:password@ credential"),
}


@pytest.mark.parametrize("case", SUBMIT_OPTIONS, ids=list(SUBMIT_OPTIONS))
def test_bad_submit_options(tmp_path, capsys, monkeypatch, launcher_data, case):
    monkeypatch.setenv("HF_HUB_PAT", "hf_pat_value")
    monkeypatch.setenv("HF_ENDPOINT", "https://user:hunter2@hub.example")
    extra, match = SUBMIT_OPTIONS[case]
    opts = {"--nodes": "2", "--gpus-per-node": "1", "--partition": "p", "--time": "01:00:00"}
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        opts[flag] = value
    argv = ["submit", RECIPE, "--device", "cpu", *[x for kv in opts.items() for x in kv]]
    before = tree(tmp_path)
    err = refused(
        capsys, [*argv, "--", "--out", str(tmp_path / "run"), "--data", str(launcher_data)], match
    )
    assert "hf_pat_value" not in err and "hunter2" not in err
    assert tree(tmp_path) == before


# --- run over pdsh: item 12 ---------------------------------------------------------------


@pytest.fixture
def two_hosts(tmp_path) -> Path:
    hf = tmp_path / "hosts"
    hf.write_text("node1 slots=1\nnode2 slots=1\n")
    return hf


def _run(hf: Path, *launcher: str, recipe_args: tuple[str, ...] = ()) -> list[str]:
    flags = "--device cpu --no-ssh-check --dry-run".split()
    return ["run", RECIPE, "--hostfile", str(hf), *flags, *launcher, "--", *recipe_args]


@pytest.mark.parametrize(
    "addr",
    ["$(touch pwned)", "10.0.0.1;id", "10.0.0.1\n", "-oProxyCommand=x", "a b", "fe80::1%eth0"],
)
def test_master_addr_goes_through_the_host_check(tmp_path, capsys, two_hosts, addr):
    before = tree(tmp_path)
    refused(
        capsys,
        _run(two_hosts, f"--master-addr={addr}"),
        "--master-addr",
        "use the name as `hostname` or your DNS gives it",
    )
    assert tree(tmp_path) == before


def test_master_addr_takes_host_names_and_ip_addresses():
    from launcher import pdsh  # new in issue 18 (imported here: the base commit lacks it)

    for addr in ("node1", "10.0.0.1", "gpu-001.cluster.local", "fe80::1", "::1"):
        assert pdsh.check_master_addr(addr) == addr


PDSH_ARGS = {
    "command-substitution": ("--set", "run.name=$(touch pwned)"),
    "backquote": ("--out", "runs/`id`"),
    "semicolon": ("--out", "runs/x;id"),
    "quote-and-space": ("--set", 'a="b c"'),
    "newline": ("--out", "runs/x\nid"),
    "glob": ("--out", "runs/*"),
    "tilde": ("--out", "~/runs"),
    "pdsh-percent": ("--out", "runs/%n"),
    "empty": ("--resume", ""),
}


@pytest.mark.parametrize("case", PDSH_ARGS, ids=list(PDSH_ARGS))
def test_recipe_flags_with_shell_syntax_are_refused_for_a_pdsh_launch(
    tmp_path, capsys, two_hosts, case
):
    before = tree(tmp_path)
    err = refused(
        capsys, _run(two_hosts, recipe_args=PDSH_ARGS[case]), "recipe argument", "pdsh", "--no-ssh"
    )
    assert "e.g. a --set or a path without" in err or "Give a value" in err
    assert tree(tmp_path) == before


def test_a_working_directory_with_shell_syntax_is_refused_for_a_pdsh_launch(
    tmp_path, capsys, monkeypatch, two_hosts
):
    odd = tmp_path / "we$(id)rd"
    odd.mkdir()
    monkeypatch.chdir(odd)
    before = tree(tmp_path)
    refused(
        capsys,
        _run(two_hosts, recipe_args=("--out", "runs/x")),
        "the working directory",
        "holds '$'",
        "rename or move it",
    )
    assert tree(tmp_path) == before


def test_pdsh_checks_apply_only_where_a_remote_shell_runs_the_command(tmp_path):
    from launcher import pdsh  # new in issue 18 (imported here: the base commit lacks it)

    hosts = {"node1": 1, "node2": 1}
    assert pdsh.is_remote(hosts, num_nodes=None, no_ssh=False)
    assert not pdsh.is_remote(hosts, num_nodes=None, no_ssh=True)  # each node started alone
    assert not pdsh.is_remote(hosts, num_nodes=1, no_ssh=False)  # one node: a local launch
    assert not pdsh.is_remote({"node1": 8}, num_nodes=None, no_ssh=False)
    assert not pdsh.is_remote(None, num_nodes=None, no_ssh=False)
    with pytest.raises(UserError, match="the Python '/opt/my env/python' holds ' '"):
        pdsh.check_remote_command(
            recipe="r.py", recipe_args=[], cwd="/w", python="/opt/my env/python"
        )


def test_odd_values_pass_where_no_remote_shell_sees_them(tmp_path, capsys, launcher_data):
    """--no-ssh: DeepSpeed starts the ranks of this node without a shell, so a `$` in --out is
    just a character (the dry run prints the command, starts and writes nothing)."""
    hf = tmp_path / "hosts"
    hf.write_text("node1 slots=1\nnode2 slots=1\n")
    out = tmp_path / "run$(id)"
    flags = "--no-ssh --node-rank 0 --master-addr 10.0.0.1 --device cpu --dry-run".split()
    data = ["--data", str(launcher_data), "--max-steps", "2"]
    argv = ["run", RECIPE, "--hostfile", str(hf), *flags, "--", "--out", str(out), *data]
    before = tree(tmp_path)
    code, printed, err = launch(capsys, argv)
    assert code == 0, err
    assert shlex.quote(str(out)) in printed
    assert tree(tmp_path) == before


def _deepspeed_pdsh_command(tmp_path, monkeypatch, *, user_args, exports):
    """The argv DeepSpeed 0.19's PDSHRunner gives pdsh, with the remote Python replaced by a
    script that records its arguments and environment."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    record = tmp_path / "record"
    fake = tmp_path / "fakepython"
    fake.write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > {record}\nenv -0 > {record}.env\n')
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.chdir(tmp_path)
    args = types.SimpleNamespace(
        user_args=user_args,
        user_script="recipe.py",
        launcher_args="",
        ssh_port=None,
        master_addr="10.0.0.1",
        master_port=29500,
        venv_script=None,
        no_python=False,
        module=False,
        no_local_rank=False,
        save_pid=False,
        enable_each_rank_log=None,
    )
    runner = PDSHRunner(args, "e30=")
    for key, value in exports.items():
        runner.add_export(key, value)
    cmd, _, _ = runner.get_cmd({}, {"node1": 1, "node2": 1})
    remote = cmd[cmd.index("-w") + 2 :]
    return " ".join(remote), record  # pdsh joins its arguments into one shell command line


def test_deepspeed_pdsh_command_line_carries_accepted_values_unchanged(tmp_path, monkeypatch):
    """DeepSpeed's own remote command line (its quoting, not a copy of it), run by bash as
    pdsh's remote shell would: every recipe flag that pre-flight lets through, and every
    .deepspeed_env value the runner copy holds, arrives as it was; nothing injected runs."""
    from launcher import pdsh  # new in issue 18 (imported here: the base commit lacks it)

    candidates = [
        "--out",
        "runs/a b",
        "--set",
        "optim.lr=3e-4",
        "x,y:z@w+v=u",
        "caf\u00e9",
        "a  b",
        "--set=run.name=two words",
        "$(touch pwned)",
        "`touch pwned`",
        'a"b',
        "a\\b",
        "x;touch pwned",
        "a'b",
        "runs/%n",
        "",
        "*",
        "~",
        "a\tb",
    ]
    accepted = []
    for arg in candidates:
        try:
            pdsh.check_remote_command(recipe="recipe.py", recipe_args=[arg], cwd="/w", python="/p")
            accepted.append(arg)
        except UserError:
            pass
    assert accepted == candidates[:8]
    env_text = dsenv.runner_copy(
        "HF_HOME=/scratch/hf cache\nNCCL_X='quoted value'\nOMP_NUM_THREADS=8\n"
        "NCCL_BAD=$(touch pwned)\nHF_Q=it's\n"
    )
    exports = dict(line.split("=", 1) for line in env_text.splitlines())
    assert "NCCL_BAD" not in exports
    line, record = _deepspeed_pdsh_command(
        tmp_path, monkeypatch, user_args=accepted, exports=exports
    )
    subprocess.run(["bash", "-c", line], check=True, cwd=tmp_path)
    got = record.read_bytes().decode().split("\0")[:-1]
    assert got[got.index("recipe.py") + 1 :] == accepted
    env = dict(kv.split("=", 1) for kv in record.with_suffix(".env").read_text().split("\0") if kv)
    assert env["HF_HOME"] == "/scratch/hf cache" and env["NCCL_X"] == "quoted value"
    assert env["HF_Q"] == "it's" and env["OMP_NUM_THREADS"] == "8"
    assert not (tmp_path / "pwned").exists()


# --- .deepspeed_env: item 13 --------------------------------------------------------------

SECRETS = {
    "HF_PWD": "pwd-value",
    "HF_HUB_PAT": "pat-value",
    "HF_GPG_PASSPHRASE": "passphrase-value",
    "NCCL_PASS": "pass-value",
    "HF_SESSION_ID": "session-value",
    "HF_COOKIE": "cookie-value",
    "TORCH_PRIVATE_KEY_FILE": "private-value",
    "HF_CREDENTIALS": "credential-value",
    "HF_BEARER": "bearer-value",
    "HF_HUB_CREDS": "creds-value",
    "TORCH_LOGIN": "login-value",
    "HF_ENDPOINT": "https://user:hunter2@hub.example",
    "HF_MIRROR": "https://ghp_tokenvalue@mirror.example/x",
    "NCCL_PROXY": "alice:s3cret@proxy:3128",
}
HARMLESS = {
    "PYTHONPATH": "/code",
    "CUDA_PATH": "/usr/local/cuda",
    "HF_HOME": "/scratch/hf",
    "NCCL_DEBUG": "INFO",
    "HF_HUB_CACHE": "/scratch/user@corp/hub",
    "TORCH_PATH_X": "a:b",
}


def test_secrets_by_name_part_and_credentials_in_values_stay_out(tmp_path):
    values = dsenv.select({**SECRETS, **HARMLESS, "PWD": "/work", "HOME": "/root"})
    assert set(values) == set(HARMLESS)
    run = tmp_path / "run"
    run.mkdir()
    (run / ".deepspeed_env").write_text(
        "HF_PWD=hand-pwd\nexport HF_ENDPOINT='https://bob:pw@host'\nNCCL_DEBUG=WARN\n"
    )
    runner = dsenv.write(run, values)
    for path in (run / ".deepspeed_env", runner):
        text = path.read_text()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        for secret in (*SECRETS.values(), "hand-pwd", "bob:pw"):
            assert secret not in text, (path.name, secret)
    assert (
        "NCCL_DEBUG=WARN" in runner.read_text()
        and "CUDA_PATH=/usr/local/cuda" in runner.read_text()
    )


def test_env_flag_refuses_secrets_but_not_path_or_the_shell_pwd():
    environ = {**SECRETS, "PWD": "/work", "CUDA_PATH": "/usr/local/cuda"}
    names = ("HF_PWD", "HF_HUB_PAT", "HF_GPG_PASSPHRASE", "HF_SESSION_ID", "HF_BEARER")
    for name in (*names, "HF_HUB_CREDS", "TORCH_LOGIN"):
        with pytest.raises(UserError, match=f"--env {name}: looks like a secret"):
            dsenv.select(environ, [name])
    with pytest.raises(UserError, match="--env HF_ENDPOINT: .*user:password@ credential"):
        dsenv.select(environ, ["HF_ENDPOINT"])
    assert dsenv.select(environ, ["PWD"]) == {"CUDA_PATH": "/usr/local/cuda", "PWD": "/work"}


def test_the_launcher_names_what_it_left_out_never_the_values(
    tmp_path, capsys, monkeypatch, launcher_data
):
    for name, value in {**SECRETS, **HARMLESS}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    flags = "--num-gpus 1 --device cpu --dry-run".split()
    data = ["--data", str(launcher_data), "--max-steps", "2"]
    argv = ["run", RECIPE, *flags, "--", "--out", str(out), *data]
    code, printed, err = launch(capsys, argv)
    assert code == 0, err
    note = next(ln for ln in printed.splitlines() if ln.startswith("note: not passed"))
    for name in SECRETS:
        assert name in note
    for value in SECRETS.values():
        assert value not in printed + err
    assert "HF_HOME=/scratch/hf" in printed  # the .deepspeed_env it would write
    assert not out.exists()


def test_a_pdsh_launch_starts_deepspeed_without_the_secrets_it_would_export():
    environ = {
        "MLFLOW_TRACKING_PASSWORD": "x",
        "MLFLOW_TRACKING_URI": "https://u:p@mlflow",
        "NCCL_DEBUG": "INFO",
        "NCCL_X": "$(id)",
        "PYTHONPATH": "/code",
        "UCX_TLS": "tcp",
        "HOME": "/root",
        "MY_TOKEN": "kept: not exported",
        "NCCL_$(touch pwned)": "1",  # env(1) sets any name; the remote shell would run this one
    }
    env, gone = dsenv.runner_environ(environ)
    assert set(gone) == {
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_URI",
        "NCCL_X",
        "NCCL_$(touch pwned)",
    }
    assert env == {k: v for k, v in environ.items() if k not in gone}


# --- item 9 (launcher part) and other odd run values ---------------------------------------

ODD_RUNS = {
    "num-gpus-0": (["--num-gpus", "0"], ["--num-gpus 0", "at least 1", "Leave --num-gpus out"]),
    "num-gpus-negative": (["--num-gpus", "-3"], ["--num-gpus -3", "e.g. --num-gpus 2"]),
    "num-nodes-0": (["--num-nodes", "0"], ["--num-nodes 0", "at least 1"]),
    "master-port": (["--master-port", "70000"], ["--master-port 70000", "1..65535"]),
    "hostfile-missing": (
        ["--hostfile", "/nonexistent/hf"],
        ["hostfile /nonexistent/hf", "cannot read it"],
    ),
    "env-name": (["--env", "NOT A NAME"], ["--env 'NOT A NAME'", "not a variable name"]),
    "no-ssh-alone": (["--no-ssh"], ["--no-ssh starts this node only", "--node-rank"]),
    # issue 27: an empty --hostfile ran on this node alone; a long one was an OSError traceback
    "hostfile-empty": (["--hostfile", ""], ["--hostfile is empty (an unset shell variable?)"]),
    "hostfile-long": (["--hostfile", "h" * 10_000], ["--hostfile hhh", "Give a shorter path"]),
    "hostfile-not-utf8": (["--hostfile", "h\udcff"], ["--hostfile h\\udcff: not UTF-8"]),
    "master-addr-empty": (["--master-addr", ""], ["--master-addr is empty"]),
}


@pytest.mark.parametrize("case", ODD_RUNS, ids=list(ODD_RUNS))
def test_odd_run_values(tmp_path, capsys, case):
    extra, must = ODD_RUNS[case]
    before = tree(tmp_path)
    refused(
        capsys,
        [
            "run",
            RECIPE,
            "--device",
            "cpu",
            "--dry-run",
            *extra,
            "--",
            "--out",
            str(tmp_path / "run"),
            "--data",
            str(tmp_path / "data"),
        ],
        *must,
    )
    assert tree(tmp_path) == before


# --- bench/gpu.sh: item 15 ----------------------------------------------------------------

FAKE_PYTHON = r"""#!/bin/bash
# Stands in for a python whose torch works but that lacks DeepSpeed: answers gpu.sh's probes,
# "installs" wheels by marking the --target directory, and records what bench_gpu.py gets.
case "$1" in
  -c)
    if [[ $2 == *"import deepspeed"* ]]; then
      IFS=: read -ra parts <<< "${PYTHONPATH:-}"
      for p in "${parts[@]}"; do [[ -e $p/installed ]] && exit 0; done
      echo "ModuleNotFoundError: No module named 'deepspeed'"; exit 1
    fi
    echo "3.11 torch 0 (fake)";;
  -m)
    [[ $2 == pytest ]] && exit 0  # the gpu tests, which skip on --cpu-smoke
    prev=; for a in "$@"; do [[ $prev == --target ]] && t=$a; prev=$a; done
    mkdir -p "$t" && touch "$t/installed";;
  *)
    IFS=: read -ra parts <<< "$PYTHONPATH"
    for p in "${parts[@]}"; do
      printf '%s %s %s\n' "$p" "$(stat -c %a "$p")" "$(stat -c %a "$(dirname "$p")")"
    done > "$RECORD"
    echo "work $ANNEAL_BENCH_WORK" >> "$RECORD";;
esac
"""


@pytest.mark.parametrize("own_work", [False, True], ids=["default-work", "ANNEAL_BENCH_WORK"])
def test_gpu_sh_puts_only_a_private_directory_on_pythonpath(tmp_path, own_work):
    """The set-up half of gpu.sh, with a stand-in python: the pip target that goes on
    PYTHONPATH is a new mode-0700 directory (not a fixed path another user could create
    first, with a sitecustomize.py in it), and it is gone when the script exits."""
    fake, record, wheels = tmp_path / "python", tmp_path / "record", tmp_path / "wheels"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    wheels.mkdir()
    (wheels / "deepspeed-0-py3-none-any.whl").write_bytes(b"")
    tmp = tmp_path / "tmp"
    planted = tmp / "anneal-gpu-bench" / "site"
    planted.mkdir(parents=True)
    (planted / "sitecustomize.py").write_text("open('/tmp/pwned', 'w')\n")
    env = {
        "PATH": os.environ["PATH"],
        "TMPDIR": str(tmp),
        "ANNEAL_PYTHON": str(fake),
        "ANNEAL_WHEELS": str(wheels),
        "RECORD": str(record),
    }
    if own_work:
        env["ANNEAL_BENCH_WORK"] = str(tmp_path / "work")
    done = subprocess.run(
        ["bash", str(GPU_SH), "--cpu-smoke", str(tmp_path / "logs")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = record.read_text().splitlines()
    work = lines.pop().split(" ", 1)[1]
    entries = [ln.split(" ") for ln in lines]
    assert entries[0][0] == str(ROOT)
    site, mode, parent_mode = entries[1]
    assert len(entries) == 2 and Path(site).name == "site"
    scratch = Path(site).parent
    assert parent_mode == "700" and scratch.parent == tmp and scratch.name != "anneal-gpu-bench"
    assert not str(site).startswith("/tmp/anneal-gpu-bench")
    assert work == (str(tmp_path / "work") if own_work else str(scratch / "work"))
    assert not scratch.exists()  # removed on exit
    assert sorted(p.name for p in tmp.iterdir()) == ["anneal-gpu-bench"]  # the plant, untouched


# --- issue 27: empty values ---------------------------------------------------------------


def test_empty_recipe_and_hostfile_out_are_refused_by_name(tmp_path, capsys):
    """``run ''`` and ``hostfile --out ''``: one paragraph naming the argument (``--out ''``
    was taken for the working directory), nothing written."""
    before = tree(tmp_path)
    refused(capsys, ["run", "", "--device", "cpu", "--dry-run"], "RECIPE is empty")
    refused(capsys, ["hostfile", "--hosts", "a", "--out", ""], "--out is empty")
    assert tree(tmp_path) == before
