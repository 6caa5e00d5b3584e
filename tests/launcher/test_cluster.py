"""A real cluster on this machine: DeepSpeed's pdsh runner over ssh to 127.0.0.1 and 127.0.0.2
(the user's exact `deepspeed --hostfile` command trains on both "nodes"; a rank that fails on
the second host makes `python -m launcher run` exit non-zero), and a two-node Slurm (Debian's
slurm-wlm and munge) where `python -m launcher submit` runs a job to completion, and a job sent
the preemption signal checkpoints, is requeued and resumes with the same losses as the
uninterrupted job, every sample consumed once; a job preempted on 2 nodes and resubmitted on 1
resumes through DeepSpeed's universal checkpoint, which the resubmission's pre-flight announces.

The Debian packages are installed when absent (as root); a test skips, naming the component,
only where one cannot be had. Daemons run under a temporary directory on free ports and are
stopped by their PID files at the end; what the fixtures add to ~/.ssh is removed again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from anneal.errors import UserError
from tests.conftest import (
    BIN,
    ROOT,
    SMALL,
    SMALL_OWN_BATCH,
    env,
    read_metrics,
    run_process,
    run_recipe,
    sets,
)

pytestmark = pytest.mark.slow

SSH_BLOCK = (
    "# anneal tests (removed when they end)\nHost 127.0.0.1 127.0.0.2\n"
    "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
)


def ensure(binaries: dict[str, str]) -> None:
    """Install the Debian packages that provide missing binaries, or skip naming them."""
    missing = sorted(
        {
            pkg
            for exe, pkg in binaries.items()
            if shutil.which(exe) is None and not Path(exe).exists()
        }
    )
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{', '.join(missing)} absent and not root with apt-get to install them")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]
    for cmd in (["apt-get", "update", "-qq"], install):
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        if done.returncode != 0:
            pytest.skip(f"could not install {', '.join(missing)}: {done.stderr[-500:]}")


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports."""
    for _ in range(200):
        first = random.randint(20000, 60000)
        if all(port_free(first + i) for i in range(n)):
            return first
    raise RuntimeError("no free ports")


def daemon_dir(name: str) -> Path:
    """A directory for a daemon's state and PID file, outside pytest's basetemp (which other
    pytest sessions of the same user prune while this one runs) and enterable by the munge user.
    """
    path = Path(tempfile.mkdtemp(prefix=f"anneal-test-{name}-"))
    path.chmod(0o755)
    return path


def stop_by_pid_file(path: Path, timeout_s: float = 10) -> None:
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------
# ssh + pdsh


@pytest.fixture(scope="module")
def sshd():
    ensure({"/usr/sbin/sshd": "openssh-server", "ssh": "openssh-client", "pdsh": "pdsh"})
    state = daemon_dir("sshd")
    dot = Path.home() / ".ssh"
    created: list[Path] = []
    if not dot.is_dir():
        dot.mkdir(mode=0o700)
        created.append(dot)
    key = dot / "id_ed25519"
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        created += [key, key.with_suffix(".pub")]
    pub = key.with_suffix(".pub").read_text().strip()
    auth = dot / "authorized_keys"
    auth_before = auth.read_text() if auth.exists() else None
    if pub not in (auth_before or ""):
        with auth.open("a") as f:
            f.write(pub + "\n")
        auth.chmod(0o600)
    config = dot / "config"
    config_before = config.read_text() if config.exists() else None
    if SSH_BLOCK not in (config_before or ""):
        config.write_text((config_before or "") + SSH_BLOCK)
    pid_file = state / "sshd.pid"
    started = False
    if not listening("127.0.0.1", 22) and not listening("127.0.0.2", 22):
        (state / "sshd_config").write_text(
            "Port 22\nListenAddress 127.0.0.1\nListenAddress 127.0.0.2\n"
            "HostKey /etc/ssh/ssh_host_ed25519_key\nPermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\nPasswordAuthentication no\nUsePAM no\n"
            f"PidFile {pid_file}\n"
        )
        if not Path("/etc/ssh/ssh_host_ed25519_key").exists():
            subprocess.run(["ssh-keygen", "-A"], check=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        subprocess.run(
            ["/usr/sbin/sshd", "-f", str(state / "sshd_config"), "-E", str(state / "sshd.log")],
            check=True,
        )
        started = True
    try:
        for host in ("127.0.0.1", "127.0.0.2"):
            done = subprocess.run(
                ["ssh", "-o", "BatchMode=yes", host, "true"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if done.returncode != 0:
                pytest.skip(f"ssh to {host} does not work here: {done.stderr.strip()}")
        yield state
    finally:
        if started:
            stop_by_pid_file(pid_file)
        if config_before is None:
            config.unlink(missing_ok=True)
        else:
            config.write_text(config_before)
        if auth_before is None:
            auth.unlink(missing_ok=True)
        else:
            auth.write_text(auth_before)
        for path in reversed(created):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        shutil.rmtree(state, ignore_errors=True)


def test_users_exact_deepspeed_command_through_pdsh(sshd, stdlib_data, tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    out = tmp_path / "run"
    cmd = [
        str(BIN / "deepspeed"),
        "--hostfile",
        str(hf),
        "recipes/pretrain_tiny.py",
        "--out",
        str(out),
        "--data",
        str(stdlib_data),
        "--max-steps",
        "2",
        *SMALL,
    ]
    done = run_process(cmd, timeout_s=300, cwd=ROOT, env=env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "pdsh" in done.stdout + done.stderr
    assert [r["step"] for r in read_metrics(out, "train")] == [1, 2]
    manifest = json.loads((out / "checkpoints" / "step00000002" / "manifest.json").read_text())
    assert manifest["world_size"] == 2


def test_failing_rank_on_second_host_reaches_the_user(sshd, stdlib_data, tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "run",
        "tests/scripts/fail_on_second_host.py",
        "--hostfile",
        str(hf),
        "--device",
        "cpu",
        "--master-port",
        "29731",
        "--",
        "--out",
        str(out),
        "--data",
        str(stdlib_data),
        "--max-steps",
        "20",
        *SMALL,
    ]
    done = run_process(cmd, timeout_s=300, cwd=ROOT, env=env())
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode not in (0, 2), log  # 2 would be a pre-flight refusal
    assert "injected failure" in done.stdout + done.stderr, log
    assert (out / ".deepspeed_env.runner").stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------------------------------------
# Slurm


class Slurm:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.env = {**env(), "SLURM_CONF": str(state / "slurm.conf")}

    def __call__(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(list(args), capture_output=True, text=True, env=self.env, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        text = self("scontrol", "show", "job", job_id, "-o", check=False)
        return dict(f.split("=", 1) for f in text.split() if "=" in f)


@pytest.fixture(scope="module")
def slurm():
    ensure(
        {
            "/usr/sbin/slurmctld": "slurm-wlm",
            "/usr/sbin/slurmd": "slurm-wlm",
            "/usr/sbin/munged": "munge",
        }
    )
    state = daemon_dir("slurm")
    munge_dir = state / "munge"  # munged runs as the munge user
    munge_dir.mkdir()
    shutil.chown(munge_dir, "munge", "munge")
    sock = munge_dir / "munge.sock"
    ctld, node = free_ports(1), free_ports(2)
    (state / "slurm.conf").write_text(f"""ClusterName=anneal-test
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/d-%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
NodeName=node[1-2] NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 \
Port=[{node}-{node + 1}] CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    (state / "ctld").mkdir()
    s = Slurm(state)
    pid_files = [
        state / "slurmctld.pid",
        state / "slurmd-node1.pid",
        state / "slurmd-node2.pid",
        munge_dir / "munged.pid",
    ]
    try:
        subprocess.run(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                "/usr/sbin/munged",
                f"--socket={sock}",
                f"--pid-file={munge_dir}/munged.pid",
                f"--log-file={munge_dir}/log",
                f"--seed-file={munge_dir}/seed",
            ],
            check=True,
        )
        subprocess.run(["/usr/sbin/slurmctld", "-i"], env=s.env, check=True)
        for name in ("node1", "node2"):
            subprocess.run(["/usr/sbin/slurmd", "-N", name], env=s.env, check=True)
        deadline = time.monotonic() + 60
        while "idle" not in s("sinfo", "-h", "-o", "%T", check=False):
            if time.monotonic() > deadline:
                log = (state / "slurmctld.log").read_text()[-2000:]
                pytest.fail(f"slurm did not come up: {log}")
            time.sleep(0.5)
        yield s
    finally:
        for job in s("squeue", "-h", "-o", "%i", check=False).split():
            s("scancel", job, check=False)
        s("scontrol", "shutdown", check=False)
        time.sleep(1)
        for pid_file in pid_files:
            stop_by_pid_file(pid_file)
        shutil.rmtree(state, ignore_errors=True)


def recipe_flags(run: Path, data: Path, *, max_steps: int, shape: list[str]) -> list[str]:
    """The recipe's flags of the Slurm drills (and of a local reference run beside them)."""
    return [
        "--out",
        str(run),
        "--data",
        str(data),
        "--max-steps",
        str(max_steps),
        "--val-every",
        "1000",
        "--save-every",
        "1000",
        *shape,
    ]


def submit_printed(
    slurm: Slurm,
    run: Path,
    data: Path,
    *,
    max_steps: int,
    port: int,
    nodes: int = 2,
    shape: list[str] = SMALL,
    extra: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> str:
    """What ``python -m launcher submit`` printed (its pre-flight, then sbatch's answer); the
    job inherits ``extra_env`` (sbatch passes the environment on)."""
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "submit",
        "recipes/pretrain_tiny.py",
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        "1",
        "--partition",
        "debug",
        "--time",
        "00:15:00",
        "--device",
        "cpu",
        "--grace-s",
        "60",
        "--master-port",
        str(port),
        "--",
        *recipe_flags(run, data, max_steps=max_steps, shape=shape),
        *extra,
    ]
    e = {**slurm.env, **(extra_env or {})}
    done = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def job_id(printed: str) -> str:
    return printed.split("Submitted batch job")[1].split()[0]


def submit(slurm: Slurm, run: Path, data: Path, *, max_steps: int, port: int) -> str:
    return job_id(submit_printed(slurm, run, data, max_steps=max_steps, port=port))


def wait_for(predicate, *, timeout_s: float, what: str, on_timeout=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    pytest.fail(f"{what} did not happen in {timeout_s:.0f} s\n{on_timeout()}")


def logs(run: Path) -> str:
    files = sorted((run / "logs").glob("*"))
    return "\n".join(f"== {p.name}\n{p.read_text()[-2500:]}" for p in files)


def trained(run: Path) -> int:
    """Steps in the run's metrics so far (0 before the file is there)."""
    try:
        return len(read_metrics(run, "train"))
    except (OSError, ValueError, UserError):
        return 0


def preempt_after_first_step(slurm: Slurm, run: Path, job: str) -> None:
    """Once ``job`` has trained a step: the preemption signal, then wait until the job has
    checkpointed, requeued itself and is pending again."""

    def started() -> bool:
        state = slurm.job(job).get("JobState")
        assert state not in ("FAILED", "CANCELLED", "COMPLETED"), f"job {job}: {state}" + logs(run)
        return trained(run) >= 1

    wait_for(
        started,
        timeout_s=240,
        what=f"the first step of job {job}",
        on_timeout=lambda: (
            logs(run)
            + slurm("scontrol", "show", "job", job, check=False)
            + (slurm.state / "slurmctld.log").read_text()[-2000:]
        ),
    )
    slurm("scancel", "--signal=USR1", "--batch", job)
    wait_for(
        lambda: slurm.job(job).get("Restarts") == "1",
        timeout_s=120,
        what="the requeue",
        on_timeout=lambda: logs(run),
    )
    wait_for(
        lambda: slurm.job(job).get("JobState") == "PENDING",
        timeout_s=60,
        what="the requeued job pending",
    )


def test_slurm_job_completes_and_a_preempted_job_resumes_exactly(slurm, stdlib_data, tmp_path):
    """The preempted job saves every step in the background (``train.async_save``, issue 44),
    the write of step 1 held 3 s (``save_slow``), so that the signal, sent once step 1 is
    logged, comes with a save in flight: the stop waits for it, saves its own step, and the
    requeued job resumes from there with the uninterrupted (synchronous) job's losses."""
    steps = 30
    ref, pre = tmp_path / "uninterrupted", tmp_path / "preempted"
    ref_job = submit(slurm, ref, stdlib_data, max_steps=steps, port=free_ports(1))
    pre_job = job_id(
        submit_printed(
            slurm,
            pre,
            stdlib_data,
            max_steps=steps,
            port=free_ports(1),
            # every checkpoint kept, so that the preemption's is still there at the end
            extra=("--save-every", "1", *sets("train.async_save=true", "train.keep_last=0")),
            extra_env={"ANNEAL_FAULTS": "save_slow@step=1:s=3"},
        )
    )

    preempt_after_first_step(slurm, pre, pre_job)
    # Skip the requeue's 120 s BeginTime, a little after it: slurmd refuses a job credential
    # made in the same second as the old one's revocation ("Job credential revoked").
    time.sleep(2)
    slurm("scontrol", "update", f"jobid={pre_job}", "StartTime=now")
    for job, run in ((ref_job, ref), (pre_job, pre)):
        wait_for(
            lambda job=job: slurm.job(job).get("JobState") in ("COMPLETED", "FAILED"),
            timeout_s=300,
            what=f"the end of job {job}",
            on_timeout=lambda run=run: logs(run),
        )
        info = slurm.job(job)
        assert info["JobState"] == "COMPLETED", logs(run)
    assert slurm.job(ref_job)["Restarts"] == "0"  # completed jobs are not requeued
    assert slurm.job(pre_job)["Restarts"] == "1"

    events = read_metrics(pre, "event")
    preempt = [e for e in events if e["event"] == "preempt"]
    assert len(preempt) == 1 and preempt[0]["signal"] == "SIGUSR1", events
    k = preempt[0]["step"]
    assert 1 <= k < steps
    saved = [e for e in events if e["event"] == "checkpoint" and e["step"] <= k]
    assert saved and all(e["asynchronous"] for e in saved) and saved[-1]["step"] == k
    resume = [e for e in events if e["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == k
    # Losses after the resume equal the uninterrupted job's; every step once, in order.
    ref_rows, pre_rows = read_metrics(ref, "train"), read_metrics(pre, "train")
    assert [r["step"] for r in pre_rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in pre_rows] == [r["loss"] for r in ref_rows]
    assert [r["tokens"] for r in pre_rows] == [r["tokens"] for r in ref_rows]
    # Every sample index once: the checkpoint's data position is exactly the k steps' samples,
    # and the resumed job starts there (equal losses show the order is the uninterrupted one).
    import torch

    cfg = json.loads((pre / "config.json").read_text())
    batch = cfg["ds_config"]["train_batch_size"]
    tag = pre / "checkpoints" / f"step{k:08d}"
    states = sorted(tag.glob("*mp_rank_00_model_states.pt"))
    client = torch.load(states[0], weights_only=False)
    assert client["data"]["position"] == k * batch
    assert client["step"] == k
    # The forecast check after 20 steps, in the job that ran them without a restart.
    (check,) = [e for e in read_metrics(ref, "event") if e["event"] == "forecast"]
    assert check["step"] == 20 and check["step_s"] > 0 and check["peak_memory_bytes"] > 0
    log = (pre / "logs" / f"slurm-{pre_job}.out").read_text()
    assert "requeueing job" in log and "restart 1" in log
    print(
        f"preemption checkpoint: {preempt[0]['checkpoint_bytes']:,} bytes saved in "
        f"{preempt[0]['save_s']} s"
    )


# SMALL with the global batch set instead of the accumulation: 16 samples a step on any number
# of ranks (micro-batch 4: accumulation 2 on 2 ranks, 4 on 1), as a run resumed on fewer ranks
# keeps it.
FIXED_BATCH = [*SMALL_OWN_BATCH, "--set", "ds.train_batch_size=16"]


def test_a_job_preempted_on_2_nodes_resumes_on_1_node(slurm, tiny_data, tmp_path):
    """A node lost (issue 31): a 2-node job is preempted (it checkpoints and requeues itself),
    the requeued job is cancelled and the run resubmitted on 1 node with the same flags (no
    hand edit: the global batch is the same, its split into accumulation steps is the
    layout's). The resubmission's pre-flight says the checkpoint was saved on 2 ranks
    and is converted once to DeepSpeed's universal checkpoint; the 1-node job loads that
    universal form and trains the remaining steps with the losses of the uninterrupted run at
    the original layout (a local 2-rank run beside the jobs), within 1e-5 relative, every step
    once. The first job's steps take half a second each (``slow_rank``, which only sleeps):
    unslowed, its 30 steps took 1.5 s, about as long as the signal took to come. Over 10 s:
    three launches of DeepSpeed and a conversion (43 and 63 s here, other tests running)."""
    steps = 30
    # The schedule runs to step 31 and every launch stops after 30, which spares it the
    # end-of-run report process.
    shape = [*FIXED_BATCH, "--set", f"train.stop_at_step={steps}"]
    ref, run = tmp_path / "uninterrupted", tmp_path / "run"
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(
            run_recipe,
            recipe_flags(ref, tiny_data, max_steps=steps + 1, shape=shape),
            ranks=2,
            timeout_s=300,
        )
        first = job_id(
            submit_printed(
                slurm,
                run,
                tiny_data,
                max_steps=steps + 1,
                port=free_ports(1),
                shape=shape,
                extra_env={"ANNEAL_FAULTS": "slow_rank@s=0.5"},  # the signal comes mid-run
            )
        )
        preempt_after_first_step(slurm, run, first)
        slurm("scancel", first)  # it would wait for 2 nodes: resubmit on the one left
        printed = submit_printed(
            slurm,
            run,
            tiny_data,
            max_steps=steps + 1,
            port=free_ports(1),
            nodes=1,
            shape=shape,
        )
        second = job_id(printed)
        wait_for(
            lambda: slurm.job(second).get("JobState") in ("COMPLETED", "FAILED"),
            timeout_s=300,
            what=f"the end of job {second}",
            on_timeout=lambda: logs(run),
        )
        info = slurm.job(second)
        assert info["JobState"] == "COMPLETED", logs(run)
        assert info["NumNodes"] == "1" and info["Restarts"] == "0"
        reference.result()

    [preempt] = [e for e in read_metrics(run, "event") if e["event"] == "preempt"]
    k = preempt["step"]
    assert 1 <= k < steps
    assert (
        f"resume: step{k:08d} was saved on 2 ranks, ZeRO-3; this launch is 1 rank, ZeRO-3: it "
        f"is converted once to DeepSpeed's universal checkpoint" in printed
    )
    cache = run / "checkpoints" / ".universal"
    node_log = (run / "logs" / "node0.log").read_text()
    assert f"loading its universal form {cache}/step{k:08d}-" in node_log
    [resume] = [e for e in read_metrics(run, "event") if e["event"] == "resume"]
    assert resume["step"] == k and resume["position"] == k * 16
    rows, ref_rows = read_metrics(run, "train"), read_metrics(ref, "train")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row, want in zip(rows, ref_rows, strict=True):
        assert row["loss"] == pytest.approx(want["loss"], rel=1e-5), row["step"]
        assert row["tokens"] == want["tokens"]
