"""``anneal eval RUN --watch`` (anneal/eval/watch.py): which checkpoints of a run it scores, and
when. On tag directories with real manifests (``anneal.resilience.manifest.write_manifest``,
hashes and all) and a scorer that writes ``evals/step-N.json`` as the command does: each saved
checkpoint is scored once, oldest first; a save still being written is scored once its
manifest appears; a damaged one is skipped with a warning and never scored; a tag the run's
keep-last pruning deletes before it is read is skipped, and one deleted while it is scored is
read to the end from its pinned hard links; a signal lets the scoring in progress finish and
stops the watcher before the next, and a restarted watcher scores only what ``evals/`` lacks;
it ends at the run's last step (``max_steps`` of its config.json) or at ``until_step``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anneal import rundir
from anneal.eval import results, watch
from anneal.resilience.manifest import MANIFEST, write_manifest
from tests.conftest import ROOT, read_metrics
from tests.launcher.test_cluster import slurm as two_node_slurm  # noqa: F401 (the drill's fixture)

STEP_FILES = {"mp_rank_00_model_states.pt": 300, "zero_pp_rank_0_mp_rank_00_optim_states.pt": 500}


def save(run: Path, step: int, *, manifest: bool = True) -> Path:
    """A tag directory as a one-rank save leaves it (its files, then the manifest)."""
    tag = rundir.checkpoints_dir(run) / f"step{step:08d}"
    tag.mkdir(parents=True)
    for name, size in STEP_FILES.items():
        (tag / name).write_bytes(bytes([step % 251]) * size)
    if manifest:
        write_manifest(tag, step=step, client_state={"tokens": step * 1000})
    return tag


def start_run(run: Path, *, max_steps: int) -> None:
    run.mkdir(parents=True, exist_ok=True)
    rundir.write_config(run, {"run": {"train": {"max_steps": max_steps}}})


class Scorer:
    """Scores a tag as ``anneal eval`` does for the watcher: reads every file the manifest lists
    (as the engine's loader would), then writes ``evals/step-N.json`` whole. ``during``: called
    once per scoring before the result is written (a prune, a signal)."""

    def __init__(self, run: Path, during=None) -> None:
        self.run, self.during, self.seen = run, during, []

    def __call__(self, tag_dir: Path) -> None:
        manifest = json.loads((tag_dir / MANIFEST).read_text())
        assert manifest["step"] not in self.seen, f"step {manifest['step']} scored twice"
        if self.during:
            self.during(tag_dir, manifest["step"])
        for name in manifest["files"]:
            (tag_dir / name).read_bytes()
        self.seen.append(manifest["step"])
        doc = {"step": manifest["step"], "tokens": manifest["tokens"], "tasks": {}, "failed": {}}
        results.write(self.run, doc)


def no_sleep(seconds: float) -> None:
    raise AssertionError("the watcher slept though it had everything it needed")


def test_each_checkpoint_scored_once_oldest_first_and_a_restart_scores_none_again(tmp_path):
    """Three saves of a finished run: scored in step order, the watcher ends by itself at
    max_steps, leaves no pinned files; a second watcher finds everything in evals/ and scores
    nothing (it would fail without the evals/ check: the scorer records every call)."""
    run = tmp_path / "run"
    start_run(run, max_steps=30)
    for step in (10, 20, 30):
        save(run, step)
    scorer = Scorer(run)
    assert watch.Watcher(run, scorer, poll_s=5).run(sleep=no_sleep) == "finished"
    assert scorer.seen == [10, 20, 30]
    assert [d["step"] for d in rundir.read_evals(run)] == [10, 20, 30]
    assert not (rundir.evals_dir(run) / watch.READING).exists()
    again = Scorer(run)
    assert watch.Watcher(run, again, poll_s=5).run(sleep=no_sleep) == "finished"
    assert again.seen == []


def test_a_save_being_written_waits_and_is_scored_once_its_manifest_appears(tmp_path, caplog):
    """A tag without manifest.json is a save in progress: the watcher says so once, polls, and
    scores it after the save writes its manifest (here: during the watcher's sleep, as the
    training job would); the run is not finished before its last step is scored."""
    run = tmp_path / "run"
    start_run(run, max_steps=20)
    save(run, 10)
    writing = save(run, 20, manifest=False)
    sleeps = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:  # a few polls later, the save finishes
            write_manifest(writing, step=20, client_state={"tokens": 20000})

    scorer = Scorer(run)
    with caplog.at_level(logging.INFO, logger="anneal.eval.watch"):
        assert watch.Watcher(run, scorer, poll_s=2).run(sleep=sleep) == "finished"
    assert scorer.seen == [10, 20]
    said = [r.getMessage() for r in caplog.records if "step00000020" in r.getMessage()]
    assert len(said) == 1 and "no manifest.json yet" in said[0] and "still being written" in said[0]
    assert sleeps == [1.0, 1.0, 1.0, 1.0]  # two polls of 2 s, in slices of 1 s


def test_damaged_checkpoints_are_skipped_with_a_message_and_never_scored(tmp_path, caplog):
    """Same-size bit rot (only the hashes see it), a file cut short, and a manifest that is not
    JSON: each skipped with a warning naming what is wrong, none scored, and the watcher still
    ends at the run's last step (scored)."""
    run = tmp_path / "run"
    start_run(run, max_steps=40)
    rot, cut, bad = save(run, 10), save(run, 20), save(run, 30)
    save(run, 40)
    name = "mp_rank_00_model_states.pt"
    (rot / name).write_bytes(b"\xff" * STEP_FILES[name])
    (cut / name).write_bytes(b"\x00" * 10)
    (bad / MANIFEST).write_text("{not json")
    scorer = Scorer(run)
    with caplog.at_level(logging.WARNING, logger="anneal.eval.watch"):
        w = watch.Watcher(run, scorer, poll_s=5)
        assert w.run(sleep=no_sleep) == "finished"
    assert scorer.seen == [40]
    assert sorted(w.skipped) == ["step00000010", "step00000020", "step00000030"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert (
        f"step00000010: skipped, not scored: 1 file(s) differ from its manifest.json ({name})"
        in text
    )
    assert (
        "step00000020: skipped, not scored: files its manifest.json lists are missing or "
        f"cut ({name})" in text
    )
    assert "step00000030: skipped, not scored: its manifest.json is not one Anneal writes" in text
    assert len(caplog.records) == 3  # once each


def test_a_tag_pruned_before_it_is_read_is_skipped_and_one_pruned_while_scored_is_read(
    tmp_path, caplog
):
    """keep-last pruning by the run: a tag deleted after the survey listed it and before it was
    pinned is skipped with a message; a tag deleted while it is being scored is read to the end
    through its hard links and scored. (Without the pin, the scorer's reads fail.)"""
    run = tmp_path / "run"
    start_run(run, max_steps=30)
    for step in (10, 20, 30):
        save(run, step)
    ckpt = rundir.checkpoints_dir(run)

    def prune(tag_dir: Path, step: int) -> None:
        if step == 10:
            shutil.rmtree(ckpt / "step00000010")  # the one being scored
            shutil.rmtree(ckpt / "step00000020")  # listed, not yet read

    scorer = Scorer(run, during=prune)
    with caplog.at_level(logging.WARNING, logger="anneal.eval.watch"):
        w = watch.Watcher(run, scorer, poll_s=5)
        assert w.run(sleep=no_sleep) == "finished"
    assert scorer.seen == [10, 30]
    assert list(w.skipped) == ["step00000020"]
    assert (
        "step00000020: skipped, not scored: removed (the run's keep-last pruning) before it "
        "could be read" in caplog.text
    )


def test_a_signal_finishes_the_scoring_in_progress_and_a_restart_resumes(tmp_path):
    """SIGUSR1 during the first scoring: that result is written, no other scoring starts, the
    watcher returns "preempted" (the command exits 75) and its pid file is gone; a new watcher
    scores the two others only. Same for SIGTERM during a poll's sleep."""
    run = tmp_path / "run"
    start_run(run, max_steps=30)
    for step in (10, 20, 30):
        save(run, step)
    signal_once = Scorer(run, during=lambda tag, step: os.kill(os.getpid(), signal.SIGUSR1))
    stop = watch.Stop(run)
    (pid_file,) = rundir.preempt_dir(run).glob("*.pid")
    try:
        assert watch.Watcher(run, signal_once, poll_s=5).run(stop, sleep=no_sleep) == "preempted"
    finally:
        stop.close()
    assert signal_once.seen == [10] and not pid_file.exists()
    assert [d["step"] for d in rundir.read_evals(run)] == [10]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL or callable(
        signal.getsignal(signal.SIGUSR1)
    )

    rest = Scorer(run)
    assert watch.Watcher(run, rest, poll_s=5).run(sleep=no_sleep) == "finished"
    assert rest.seen == [20, 30]

    later = tmp_path / "later"
    start_run(later, max_steps=50)
    stop = watch.Stop(later)
    try:
        sleeps = []

        def sleep(seconds: float) -> None:
            sleeps.append(seconds)
            os.kill(os.getpid(), signal.SIGTERM)

        result = watch.Watcher(later, Scorer(later), poll_s=600).run(stop, sleep=sleep)
    finally:
        stop.close()
    assert result == "preempted" and sleeps == [1.0]  # woke at once, not after 600 s


def test_until_step_and_a_max_steps_raised_by_a_resume(tmp_path):
    """``until_step``: the watcher ends once the first checkpoint at or past it is scored, not
    scoring later ones. Without it, the end follows config.json: a run resumed with a larger
    --max-steps rewrites it, and the watcher goes on to the new last step."""
    run = tmp_path / "run"
    start_run(run, max_steps=40)
    for step in (10, 20, 30, 40):
        save(run, step)
    scorer = Scorer(run)
    assert watch.Watcher(run, scorer, until_step=15, poll_s=5).run(sleep=no_sleep) == "finished"
    assert scorer.seen == [10, 20]

    other = tmp_path / "other"
    start_run(other, max_steps=10)
    save(other, 10)
    scorer = Scorer(other)
    w = watch.Watcher(other, scorer, poll_s=1)
    assert w.run(sleep=no_sleep) == "finished" and scorer.seen == [10]
    start_run(other, max_steps=20)  # resumed with --max-steps 20: config.json rewritten
    assert w.run(sleep=lambda s: save(other, 20)) == "finished" and scorer.seen == [10, 20]


def test_the_watcher_waits_for_a_run_that_has_not_started(tmp_path):
    """A watch job that starts before the training job has written anything: no run directory,
    then no config.json, then no checkpoint: it polls (sleeps) rather than failing or ending."""
    run = tmp_path / "run"
    events = []

    def sleep(seconds: float) -> None:
        events.append(seconds)
        if len(events) == 1:
            start_run(run, max_steps=10)
        elif len(events) == 2:
            save(run, 10)

    scorer = Scorer(run)
    assert watch.Watcher(run, scorer, poll_s=1).run(sleep=sleep) == "finished"
    assert scorer.seen == [10] and events == [1.0, 1.0]


@pytest.mark.parametrize("hostile", ["../../outside", "/etc/passwd"])
def test_a_manifest_naming_a_file_outside_its_tag_is_damaged_and_nothing_is_linked(
    tmp_path, hostile
):
    """A manifest edited to name a file outside its directory is refused (``confined``), the
    tag skipped as damaged, and nothing outside the tag is linked or read."""
    run = tmp_path / "run"
    start_run(run, max_steps=10)
    tag = save(run, 10)
    doc = json.loads((tag / MANIFEST).read_text())
    doc["files"][hostile] = {"size": 1}
    (tag / MANIFEST).write_text(json.dumps(doc))
    w = watch.Watcher(run, Scorer(run), poll_s=5)
    assert w.run(sleep=no_sleep) == "finished"
    assert "outside" in w.skipped["step00000010"] or "absolute" in w.skipped["step00000010"]
    assert rundir.read_evals(run) == []


# --- the watch job on Slurm: launcher submit --watch-tasks, templates/eval_watch.sbatch -----


def _render_watch(**kw):
    from launcher import watch_job

    args = dict(
        job_name="anneal-eval-x",
        nodes=1,
        gpus_per_node=1,
        gpus=False,
        partition="debug",
        time="01:00:00",
        account=None,
        grace_s=120,
        run_dir=Path("/runs/x"),
        workdir=Path("/code"),
        python="/code/.venv/bin/python",
        tasks="hellaswag,arc_easy",
        limit=None,
        master_port=29501,
    )
    return watch_job.render_watch(**{**args, **kw})


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(tasks="hellaswag\ntouch /tmp/pwned"), "--watch-tasks 'hellaswag\\ntouch /tmp/pwned'"),
        (dict(tasks="a\u2028b"), "--watch-tasks"),
        (dict(tasks=" "), "--watch-tasks: no task given"),
        (dict(limit=0), "--watch-limit 0"),
        (dict(poll_s=0.0), "--watch-poll-s 0"),
        (dict(run_dir=Path("/runs/%j-x")), "holds '%'"),
        (dict(run_dir=Path("/runs/a\nb")), "--out '/runs/a\\nb'"),
        (dict(workdir=Path("/code\n#SBATCH --x")), "the working directory"),
        (dict(python="/py\rthon"), "the Python"),
        (dict(partition="gpu\n#SBATCH --x"), "--partition"),
        (dict(time="1:00:00\n#SBATCH --x"), "--time"),
        (dict(account="$(id)"), "--account"),
        (dict(grace_s=0), "--grace-s 0"),
    ],
)
def test_the_watch_script_refuses_what_the_training_script_refuses(kw, match):
    """Every value the watch job's script embeds is checked as the training script's are (the
    same checks of launcher/slurm.py), and the tasks too: one paragraph, naming the value."""
    from anneal.errors import UserError

    with pytest.raises(UserError) as e:
        _render_watch(**kw)
    assert match in str(e.value) and "\n" not in str(e.value), str(e.value)


FAKE_SCONTROL = """#!/bin/sh
echo "$@" >> "$RECORD.scontrol"
[ "$2" = hostnames ] && echo node1
[ "$2" = node ] && echo "NodeName=node1 NodeAddr=127.0.0.1"
exit 0
"""
FAKE_SRUN = '#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n'


def _fake_job(tmp_path: Path, deepspeed: str) -> tuple[Path, Path, dict]:
    """A virtual environment at a path with shell syntax in it (a fake python and
    ``deepspeed``), fake srun and scontrol on PATH; (venv bin, run dir, the job's env)."""
    venv = tmp_path / 'u"$(touch MARKER)"' / "bin"
    fake = tmp_path / "slurm"
    for d in (venv, fake, tmp_path / "code"):
        d.mkdir(parents=True)
    scripts = {
        venv / "python": "#!/bin/sh\nexit 0\n",
        venv / "deepspeed": deepspeed,
        fake / "srun": FAKE_SRUN,
        fake / "scontrol": FAKE_SCONTROL,
    }
    for path, text in scripts.items():
        path.write_text(text)
        path.chmod(0o755)
    env = {
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NODEID": "0",
        "RECORD": str(tmp_path / "record"),
    }
    return venv, tmp_path / "run x", env


def test_the_watch_job_runs_anneal_eval_watch_with_every_value_as_given(tmp_path):
    """The watch script run by bash as the batch job (fake srun and scontrol): deepspeed gets
    its own hostfile (never the training job's RUN/hostfile), its port, ``--no_local_rank
    --module anneal.cli eval RUN --watch`` and the tasks exactly, shell syntax in them and in
    the paths never runs (no MARKER), and an exit 0 is not requeued."""
    record = tmp_path / "record"
    ds = f'#!/bin/sh\nprintf "%s\\0" "$0" "$@" > {shlex.quote(str(record))}\n'
    venv, run, env = _fake_job(tmp_path, ds)
    tasks = "arc_easy,$(touch MARKER),x y.yaml"
    script = tmp_path / "eval-watch.sbatch"
    script.write_text(
        _render_watch(
            run_dir=run, workdir=tmp_path / "code", python=str(venv / "python"), tasks=tasks
        )
    )
    done = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not list(tmp_path.rglob("MARKER"))
    assert record.read_text().split("\0")[:-1] == [
        str(venv / "deepspeed"),
        *("--hostfile", f"{run}/logs/eval-hostfile", "--no_ssh", "--node_rank", "0"),
        *("--master_addr", "127.0.0.1", "--master_port", "29501", "--no_local_rank"),
        *("--module", "anneal.cli", "eval", str(run), "--watch", f"--tasks={tasks}"),
    ]
    assert "requeue" not in Path(f"{record}.scontrol").read_text()


def test_a_signalled_watch_job_stops_its_watcher_and_requeues(tmp_path):
    """SIGUSR1 to the batch shell (what Slurm's --signal=B:USR1 and ``scancel --signal=USR1
    --batch`` do): the trap finds the watcher through its pid file in RUN/preempt/ (written by
    ``watch.Stop``), the watcher exits 75, and the script calls ``scontrol requeue`` for its job.
    A pid file of another job (the training job's) in the same folder is not signalled."""
    run_dir = tmp_path / "run x"
    start_run(run_dir, max_steps=100)
    other = subprocess.Popen(["sleep", "60"])  # stands for a training rank of job 6
    from anneal.resilience import preempt

    (run_dir / "preempt").mkdir()
    line = preempt.pid_line(other.pid).replace(" -\n", " 6\n")
    (run_dir / "preempt" / f"{socket.gethostname()}.{other.pid}.pid").write_text(line)
    watcher = (
        "import sys\nfrom pathlib import Path\nfrom anneal.eval import watch\n"
        "stop = watch.Stop(Path(sys.argv[1]))\n"
        "result = watch.Watcher(Path(sys.argv[1]), print, poll_s=600).run(stop)\n"
        "stop.close()\nsys.exit(75 if result == 'preempted' else 0)\n"
    )
    ds = "#!/bin/sh\n" + (
        f"cd {shlex.quote(str(ROOT))} && exec {shlex.quote(sys.executable)} -c "
        f'{shlex.quote(watcher)} "$(dirname "$(dirname "$2")")"\n'
    )
    venv, _, env = _fake_job(tmp_path, ds)
    script = tmp_path / "eval-watch.sbatch"
    script.write_text(
        _render_watch(run_dir=run_dir, workdir=tmp_path / "code", python=str(venv / "python"))
    )
    job = subprocess.Popen(
        ["bash", str(script)],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list((run_dir / "preempt").glob("*.pid"))) < 2:
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0]
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)
        out = job.communicate(timeout=60)[0]
    finally:
        job.kill()
        other.kill()
    assert job.returncode == 0, out
    assert "the watcher exited 75" in out and "requeueing job 7" in out, out
    assert "requeue 7" in Path(f"{tmp_path}/record.scontrol").read_text()
    assert other.wait() == -signal.SIGKILL  # still alive until we killed it: never signalled


def _submit(capsys, tmp_path, data, *extra: str) -> tuple[int, str, str]:
    from launcher.__main__ import main as launcher_main

    argv = ["submit", str(ROOT / "recipes" / "pretrain_tiny.py"), "--device", "cpu"]
    argv += [*"--nodes 2 --gpus-per-node 1 --partition p --time 01:00:00".split(), *extra]
    argv += ["--", "--out", str(tmp_path / "run"), "--data", str(data)]
    code = launcher_main(argv)
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def test_submit_with_watch_tasks_renders_the_watch_job_beside_the_training_job(
    tmp_path, capsys, tiny_data
):
    """``launcher submit --watch-tasks`` (dry run): the training script as without it, and the
    watch job's script after it, on the same partition and time, one node, the next port, its
    own log and hostfile names; without --watch-tasks there is no watch script. The watch
    settings alone are refused, as are bad ones, and nothing is written."""
    code, plain, err = _submit(capsys, tmp_path, tiny_data, "--dry-run")
    assert code == 0, err
    assert "eval-watch.sbatch" not in plain
    code, out, err = _submit(
        capsys,
        tmp_path,
        tiny_data,
        "--dry-run",
        "--watch-tasks",
        "anneal_next_line",
        "--watch-limit",
        "50",
        "--watch-poll-s",
        "2.5",
    )
    assert code == 0, err
    training, watch_script = out.split(f"# {tmp_path / 'run' / 'eval-watch.sbatch'} would hold:")
    assert training == plain
    run = tmp_path / "run"
    assert "#SBATCH --job-name=anneal-eval-run" in watch_script
    assert "#SBATCH --nodes=1" in watch_script and "#SBATCH --partition=p" in watch_script
    assert f'#SBATCH --output="{run}/logs/eval-watch-%j.out"' in watch_script
    assert "--master_port 29501" in watch_script and '"$0/logs/eval-hostfile"' in watch_script
    assert f"eval {run} --watch --tasks=anneal_next_line --limit=50 --poll-s=2.5" in watch_script
    subprocess.run(["bash", "-n"], input=watch_script, text=True, check=True)
    before = sorted(tmp_path.rglob("*"))
    for extra, match in (
        (["--watch-limit", "5"], "--watch-limit: a setting of the watch job; give --watch-tasks"),
        (["--watch-tasks", "a\nb"], "--watch-tasks 'a\\nb' holds '\\n'"),
        (["--watch-tasks", "a", "--watch-nodes", "0"], "--watch-nodes 0: must be at least 1"),
    ):
        code, out, err = _submit(capsys, tmp_path, tiny_data, *extra)
        assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err
    assert sorted(tmp_path.rglob("*")) == before


def test_the_default_poll_the_help_texts_state_is_the_watchers():
    """``anneal eval --help`` and ``python -m launcher submit --help`` state the watcher's
    default poll without importing torch to build the parser; it is the one in
    anneal.eval.watch."""
    from anneal.cli import build_parser
    from launcher.__main__ import build_parser as launcher_parser

    said = f"default {watch.DEFAULT_POLL_S:g})"
    for parser, command, flag in (
        (build_parser(), "eval", "--poll-s"),
        (launcher_parser(), "submit", "--watch-poll-s"),
    ):
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        (action,) = [a for a in sub._actions if flag in a.option_strings]
        assert action.help.endswith(said), action.help


# --- the acceptance drill: a training job and a watch job side by side on a 2-node Slurm ------


def _write_task(root: Path) -> Path:
    """A local multiple-choice task over local JSONL (offline): 8 items of 4 one-word choices."""
    root.mkdir(parents=True)
    rows = [
        {"q": f"def f{i}(x):\n    return", "choices": [" x", " 0", " None", " f"], "gold": 0}
        for i in range(8)
    ]
    (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml = root / "watch_mc.yaml"
    yaml.write_text(
        "\n".join(
            [
                "task: watch_mc",
                "dataset_path: json",
                "dataset_kwargs:",
                f"  data_files: {{test: {json.dumps(str(root / 'mc.jsonl'))}}}",
                f"  cache_dir: {json.dumps(str(root / 'hf_cache'))}",
                "test_split: test",
                "output_type: multiple_choice",
                'doc_to_text: "{{q}}"',
                'doc_to_target: "{{gold}}"',
                'doc_to_choice: "{{choices}}"',
                "metric_list:",
                "  - {metric: acc, aggregation: mean, higher_is_better: true}",
            ]
        )
        + "\n"
    )
    return yaml


def _plant_damaged(run: Path, source: Path, step: int) -> Path:
    """A copy of checkpoint ``source`` as if saved at ``step``, one byte of one file flipped
    after the save (same size: only the hashes see it)."""
    tag = rundir.checkpoints_dir(run) / f"step{step:08d}"
    shutil.copytree(source, tag.with_name(".planting"))
    doc = json.loads((tag.with_name(".planting") / MANIFEST).read_text())
    doc.update(step=step, tag=tag.name)
    (tag.with_name(".planting") / MANIFEST).write_text(json.dumps(doc))
    name = sorted(doc["files"])[0]
    data = bytearray((tag.with_name(".planting") / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tag.with_name(".planting") / name).write_bytes(bytes(data))
    tag.with_name(".planting").rename(tag)  # appears whole, manifest and all
    return tag


def _submit_both(slurm, tmp_path: Path, data: Path) -> tuple[Path, str, str]:
    """``launcher submit --watch-tasks`` on the local Slurm: a training job of 12 steps (a save
    every 3, all kept) and its watch job (a local task, 4 items, a poll every second); (the run
    directory, the training job's id, the watch job's id)."""
    from tests.conftest import SMALL
    from tests.launcher.test_cluster import free_ports

    task, run = _write_task(tmp_path / "task"), tmp_path / "run"
    cmd = [sys.executable, "-m", "launcher", "submit", "recipes/pretrain_tiny.py"]
    cmd += "--nodes 1 --gpus-per-node 1 --partition debug --time 00:15:00".split()
    cmd += ["--device", "cpu", "--grace-s", "60", "--master-port", str(free_ports(2))]
    cmd += ["--watch-tasks", str(task), "--watch-limit", "4", "--watch-poll-s", "1"]
    cmd += ["--", "--out", str(run), "--data", str(data), "--max-steps", "12"]
    cmd += ["--save-every", "3", "--val-every", "1000", "--set", "train.keep_last=10", *SMALL]
    done = subprocess.run(cmd, cwd=ROOT, env=slurm.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    train_job, watch_job = [
        line.split()[-1]
        for line in done.stdout.splitlines()
        if line.startswith("Submitted batch job")
    ]
    return run, train_job, watch_job


def _all_scored_once(slurm, run: Path, jobs: list[str], first: Path, first_written: int) -> str:
    """Wait for ``jobs`` to complete; then every save (3, 6, 9, 12) has one document, the
    first one as it was first written, and no step a second metrics row. The logs."""
    from tests.launcher.test_cluster import logs, wait_for

    for job in jobs:
        wait_for(
            lambda job=job: slurm.job(job).get("JobState") in ("COMPLETED", "FAILED"),
            timeout_s=600,
            what=f"the end of job {job}",
            on_timeout=lambda: logs(run),
        )
        assert slurm.job(job)["JobState"] == "COMPLETED", logs(run)
    assert [d["step"] for d in rundir.read_evals(run)] == [3, 6, 9, 12]
    assert first.stat().st_mtime_ns == first_written  # never scored again
    rows = [r["step"] for r in read_metrics(run) if r.get("kind") == "eval"]
    assert len(rows) == len(set(rows)) and set(rows) <= {3, 6, 9, 12}, rows
    text = logs(run)
    said = (run / "logs" / "eval-node0.log").read_text().splitlines()
    said = [ln for ln in said if "watcher " in ln or "skipped, not scored" in ln]
    print("\n".join(said))  # what each watch job did, for the log of a slow run
    return text


@pytest.mark.slow
def test_a_watch_job_beside_a_training_job_on_slurm_scores_each_save_once(
    two_node_slurm,  # noqa: F811 (the fixture imported above)
    stdlib_data,
    tmp_path,
):
    """The acceptance drill on the local 2-node Slurm cluster (tests/launcher/test_cluster.py's):
    ``launcher submit --watch-tasks`` starts a training job (12 steps, a save every 3) and a
    watch job beside it. A damaged copy of a checkpoint planted mid-run is skipped with its
    message; the watch job is killed (``scancel``) once it has scored a step and submitted
    again from its script; it resumes, and in the end every save (3, 6, 9, 12) is scored once:
    one document each, the first one untouched by the restart, no step's metrics row twice.
    Slow (about 2-4 minutes on 2 cores): two Slurm jobs, two DeepSpeed starts of the watcher,
    an engine built per checkpoint."""
    from tests.launcher.test_cluster import logs, wait_for

    slurm = two_node_slurm
    run, train_job, watch_job = _submit_both(slurm, tmp_path, stdlib_data)
    ckpt = rundir.checkpoints_dir(run)
    wait_for(
        lambda: (ckpt / "step00000003" / MANIFEST).exists(),
        timeout_s=300,
        what="the first save",
        on_timeout=lambda: logs(run),
    )
    _plant_damaged(run, ckpt / "step00000003", 4)
    first = rundir.eval_path(run, 3)
    wait_for(first.exists, timeout_s=300, what="the first score", on_timeout=lambda: logs(run))
    first_written = first.stat().st_mtime_ns
    slurm("scancel", watch_job)
    wait_for(
        lambda: slurm.job(watch_job).get("JobState") in ("CANCELLED", "COMPLETED"),
        timeout_s=60,
        what="the watch job's end",
    )
    again = slurm("sbatch", str(run / "eval-watch.sbatch")).split()[-1]
    _all_scored_once(slurm, run, [train_job, again], first, first_written)
    text = (run / "logs" / "eval-node0.log").read_text()  # both watch jobs, appended
    assert "step00000004: skipped, not scored: 1 file(s) differ from its manifest.json" in text
    assert "watcher finished: scored step(s)" in text and "skipped 1" in text, text[-5000:]
    assert not rundir.eval_path(run, 4).exists()


@pytest.mark.slow
def test_a_preempted_watch_job_is_requeued_and_resumes_on_slurm(
    two_node_slurm,  # noqa: F811 (the fixture imported above)
    stdlib_data,
    tmp_path,
):
    """The watch job's own preemption on the local Slurm: ``scancel --signal=USR1 --batch``
    once it has scored a step; the trap signals the watcher, which ends the scoring in progress
    and exits 75; the script requeues the job (Restarts=1), which resumes: every save scored
    once, the first score untouched. Slow (about 1-3 minutes on 2 cores): two Slurm jobs, the
    watcher started twice, Slurm's requeue."""
    from tests.launcher.test_cluster import logs, wait_for

    slurm = two_node_slurm
    run, train_job, watch_job = _submit_both(slurm, tmp_path, stdlib_data)
    first = rundir.eval_path(run, 3)
    wait_for(first.exists, timeout_s=300, what="the first score", on_timeout=lambda: logs(run))
    first_written = first.stat().st_mtime_ns
    slurm("scancel", "--signal=USR1", "--batch", watch_job)
    wait_for(
        lambda: slurm.job(watch_job).get("Restarts") == "1",
        timeout_s=120,
        what="the requeue",
        on_timeout=lambda: logs(run),
    )
    wait_for(
        lambda: slurm.job(watch_job).get("JobState") == "PENDING",
        timeout_s=60,
        what="the requeued job pending",
    )
    time.sleep(2)  # a new credential in another second than the revoked one (test_cluster.py)
    slurm("scontrol", "update", f"jobid={watch_job}", "StartTime=now")
    text = _all_scored_once(slurm, run, [train_job, watch_job], first, first_written)
    assert "the watcher exited 75" in text and f"requeueing job {watch_job}" in text, text
    node_log = (run / "logs" / "eval-node0.log").read_text()  # both runs, appended
    assert "watcher preempted: scored step(s) 3" in node_log, node_log[-5000:]
    assert "watcher finished: scored step(s)" in node_log and "(restart 1)" in text, text


def _two_ranks(run: Path, out: Path, *extra: str) -> list[int]:
    """tests/scripts/watch_two_ranks.py on two processes of one gloo group; their exit codes."""
    from tests.conftest import env, free_port

    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "tests/scripts/watch_two_ranks.py", str(run), str(out), *extra],
            cwd=ROOT,
            env={
                **env(),
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for r in range(2)
    ]
    return [p.wait(timeout=120) for p in procs]


def test_two_ranks_score_the_same_checkpoints_and_stop_together(tmp_path):
    """The watcher on two ranks (gloo, real processes): rank 0 decides, both score the same
    tags in the same order, each once, through a collective; a signal that reaches rank 1 only
    stops both after the checkpoint in progress (exit 75 each), and the restarted pair scores
    the rest. (About 5 s: four processes that import torch.)"""
    run = tmp_path / "run"
    start_run(run, max_steps=30)
    for step in (10, 20, 30):
        save(run, step)
    out = tmp_path / "scored"
    assert _two_ranks(run, out, "signal") == [75, 75]
    assert [Path(f"{out}.{r}").read_text().split() for r in range(2)] == [["10"], ["10"]]
    assert _two_ranks(run, out) == [0, 0]
    assert [Path(f"{out}.{r}").read_text().split() for r in range(2)] == [["10", "20", "30"]] * 2
    assert [d["step"] for d in rundir.read_evals(run)] == [10, 20, 30]
