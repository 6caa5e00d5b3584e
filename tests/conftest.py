"""Shared fixtures: a prepared stdlib corpus and helpers that launch real training processes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anneal.dist import free_port  # noqa: F401 (the tests take ports through it)
from anneal.observe.metrics import read_metrics  # noqa: F401 (the tests read runs through it)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


# A hung collective or lock must cost one test, not the CI run: past this many seconds the
# session stops before its next test and says so (the suite's duration: docs/benchmarks.md,
# "The test suite").
SUITE_BUDGET_S = float(os.environ.get("ANNEAL_TEST_BUDGET_S", 3600))
_SUITE_START = time.monotonic()


def pytest_runtest_setup(item):
    elapsed = time.monotonic() - _SUITE_START
    if elapsed > SUITE_BUDGET_S:
        pytest.exit(
            f"the suite has run {elapsed:.0f} s, past its budget of {SUITE_BUDGET_S:.0f} s "
            f"(ANNEAL_TEST_BUDGET_S); stopping before {item.nodeid}. Look for tests above "
            "that failed on a timeout: something hangs.",
            returncode=1,
        )


@pytest.hookimpl(trylast=True)  # after ``-m`` has deselected: a shard splits what is selected
def pytest_collection_modifyitems(config, items):
    """The tests that read the shared runs go after the other fast tests, which run while those
    runs train in the background (``shared_runs``); the slow tests go last, on a quiet machine,
    as before. Tests marked ``gpu`` need CUDA: without it they skip, saying so."""
    items.sort(key=_order)
    shard = os.environ.get("ANNEAL_TEST_SHARD")
    if shard:
        keep = set(_shard_of(items, shard))
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = [item for item in items if item in keep]
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu); torch sees none here")
    for item in gpu:
        item.add_marker(skip)


# ``make test-all`` (tests/shards.py) runs the suite as three pytest sessions side by side, each
# process of them on one thread: on 2 cores the ranks of a run wait on each other, processes
# start, the cluster drills wait on Slurm and ssh, and a third session fills those gaps. Shard 1
# takes every fast test (and the shared runs) and the slow files that read the shared runs; the
# other slow files go, heaviest first, to the shard with the least so far, by these weights:
# seconds of each file's slow tests (`tests/shards.py 3 --durations=0` on 2026-12-07 at 20:50,
# on 5b3f785, beside other work on the machine: the sizes relative to each other are what
# counts), the fast tests together as one; a file not listed weighs DEFAULT_WEIGHT_S. The
# tests marked ``alone`` (peak memory measured against the estimate: another session's load
# moved a TP=2 rank's peak from 790 to 492 MiB) run after the shards, in a session of their own.
SHARD_WEIGHTS_S = {
    "<fast>": 386,  # the fast tests' durations together
    "test_bench_smoke.py": 662,
    "test_float8.py": 66,  # helper's run on 2026-12-07 at load 0.5-1.3, not in that make test-all
    "test_compile.py": 95,  # helper 47, 2026-12-07: 93-97 s at load 2.5-6, cold inductor cache
    "test_cluster.py": 283,
    "test_world_size.py": 236,
    "test_docs_commands.py": 207,
    "test_resume.py": 200,
    "test_eval_watch.py": 135,
    "test_bench_gpu.py": 131,
    "test_data_learning.py": 113,
    "test_eval_loop.py": 102,
    "test_export.py": 96,
    "test_muon_layouts.py": 89,
    "test_stop_mid_step.py": 85,
    "test_eval_cmd.py": 84,
    "test_wsd.py": 82,
    "test_planner.py": 80,
    "test_bad_input.py": 80,
    "test_scaling_sweep.py": 80,
    "test_tensor_parallel.py": 76,
    "test_launcher.py": 75,
    "test_moe_parallel.py": 72,
    "test_guard.py": 67,
    "test_crash_recovery.py": 66,
    "test_document_mask.py": 61,
    "test_sequence_parallel.py": 55,
    "test_async_save_drill.py": 48,
    "test_rank_death.py": 42,
    "test_bench_train.py": 41,
    "test_cooldown.py": 38,
    "test_export_every_save.py": 38,
    "test_init_from.py": 37,
    "test_recipes.py": 33,
    "test_validation_sources.py": 33,
    "test_eval_lm.py": 32,
    "test_loss.py": 26,
    "test_data_scale_slurm.py": 22,
    "test_stale_state.py": 17,
    "test_shards.py": 15,
    "test_moe_hf.py": 14,
    "test_eval_tasks.py": 6,
}
DEFAULT_WEIGHT_S = 30
# Files whose slow tests share something outside the session go to one shard together: all
# drive the local cluster (Slurm's two nodes; pdsh and ssh to this host).
SHARD_TOGETHER = [
    ("test_cluster.py", "test_launcher.py", "test_eval_watch.py", "test_data_scale_slurm.py")
]


def _shard_of(items, spec: str) -> list:
    """The items of shard ``i`` of ``n`` (``spec`` = "i/n", counted from 1), none of them marked
    ``alone``; with ``spec`` = "alone", those (tests/shards.py runs them after the shards, on a
    quiet machine)."""
    if spec == "alone":
        return [item for item in items if item.get_closest_marker("alone")]
    items = [item for item in items if not item.get_closest_marker("alone")]
    try:
        i, n = (int(x) for x in spec.split("/"))
        assert 1 <= i <= n
    except (ValueError, AssertionError):
        raise pytest.UsageError(
            f"ANNEAL_TEST_SHARD={spec!r}: expected i/n, 1 <= i <= n, or alone"
        ) from None
    slow = {}
    for item in items:
        if item.get_closest_marker("slow"):
            slow.setdefault(item.path.name, []).append(item)
    if not slow:
        return _fast_shard_of(items, i, n)
    load = [0.0] * n
    load[0] = SHARD_WEIGHTS_S["<fast>"]
    home = {}
    for name, group in slow.items():  # readers of the shared runs stay with them
        if any(map(_uses_shared_runs, group)):
            home[name] = 0
            load[0] += SHARD_WEIGHTS_S.get(name, DEFAULT_WEIGHT_S)
    units = {}  # the files that go together, each under its first name
    for name in sorted(set(slow) - set(home)):
        group = next((g for g in SHARD_TOGETHER if name in g), (name,))
        units.setdefault(group[0], []).append(name)

    def weight(unit: str) -> float:
        return sum(SHARD_WEIGHTS_S.get(name, DEFAULT_WEIGHT_S) for name in units[unit])

    for unit, shard_index in _spread(units, weight, load).items():
        home.update(dict.fromkeys(units[unit], shard_index))
    return [
        item
        for item in items
        if (home.get(item.path.name) if item.get_closest_marker("slow") else 0) == i - 1
    ]


# `make test` (tests/shards.py 2 -m "not slow") splits the fast tests over two sessions side by
# side, each process on one thread: one session keeps 2 cores about 1.36 busy (250 s of CPU in
# 184 s, 2026-12-07). Session 1 takes the shared runs (they train in its background) and every
# file that reads them; the other files go, heaviest first, to the session with the least so
# far, by these weights: seconds of each file's fast tests (`pytest -m "not slow" --durations=0`
# on a fresh clone of 2b5ee8a, 2026-12-07 22:45, alone), FAST_DEFAULT_S for a file not listed.
FAST_WEIGHTS_S = {
    # their 8 launches one after another: 69 s of CPU (23:09, load 5); on fresh clones, alone,
    # at 75 the sessions ended at 121 and 148 s (b860378), at 62 at 102 and 124 s (539c342,
    # session 1 waiting 36 s on the shared runs), so less
    "<shared runs>": 50,
    "test_bench_gpu.py": 12.1,
    "test_checkpoint_trust.py": 9.9,
    "test_data_prepare.py": 9.7,
    "test_data_scale.py": 9.4,
    "test_data_tokenizer.py": 8.2,
    "test_hostile_run.py": 8.0,
    "test_async_save.py": 7.6,
    "test_data_bad_input.py": 7.4,
    "test_eval_see.py": 6.7,
    "test_export_every_save.py": 6.5,
    "test_eval_watch.py": 5.4,
    "test_planner.py": 4.7,
    "test_hostile_data.py": 4.7,
    "test_loop.py": 4.1,
    "test_observe.py": 3.8,
    "test_data_single_file.py": 3.6,
    "test_validation_sources.py": 3.0,
    "test_export.py": 2.5,
    "test_bench_prepare.py": 2.5,
    "test_eval_tasks.py": 2.4,
    "test_layout.py": 2.3,
    "test_hostile_plot.py": 2.3,
    "test_launcher.py": 2.2,
    "test_ranks_script.py": 2.2,
    "test_moe_hf.py": 2.2,
    "test_bad_input.py": 2.0,
    "test_quiet.py": 1.6,
    "test_eval_loop.py": 1.6,
    "test_prune_universal.py": 1.5,
}
FAST_DEFAULT_S = 0.5


def _fast_shard_of(items, i: int, n: int) -> list:
    """Shard ``i`` of ``n`` of a session of fast tests only (``_shard_of``): whole files, the
    readers of the shared runs in shard 1."""
    files = {}
    for item in items:
        files.setdefault(item.path.name, []).append(item)
    load = [0.0] * n
    load[0] = FAST_WEIGHTS_S["<shared runs>"]
    home = {}
    for name, group in files.items():
        if any(map(_uses_shared_runs, group)):
            home[name] = 0
            load[0] += FAST_WEIGHTS_S.get(name, FAST_DEFAULT_S)
    rest = set(files) - set(home)
    home.update(_spread(rest, lambda f: FAST_WEIGHTS_S.get(f, FAST_DEFAULT_S), load))
    return [item for item in items if home[item.path.name] == i - 1]


def _spread(names, weight, load: list[float]) -> dict[str, int]:
    """{name: shard} for ``names``, heaviest first (by ``weight``, then name), each to the shard
    with the least ``load`` so far; ``load`` grows by what it takes."""
    home = {}
    for name in sorted(names, key=lambda n: (-weight(n), n)):
        home[name] = load.index(min(load))
        load[home[name]] += weight(name)
    return home


def _uses_shared_runs(item) -> bool:
    return "shared_runs" in getattr(item, "fixturenames", ())


def _order(item) -> int:
    """0: fast tests of their own; 1: readers of the shared runs; 2: slow tests of their own
    (list.sort is stable: each group keeps the files' order)."""
    if _uses_shared_runs(item):
        return 1
    return 2 if item.get_closest_marker("slow") else 0


# The processes run_process has started and not yet seen end (the background shared runs are
# killed through it if the session ends before them).
_LIVE: set[subprocess.Popen] = set()


def run_process(
    cmd: list[str], *, timeout_s: float, check: bool = False, **kwargs
) -> subprocess.CompletedProcess:
    """subprocess.run in its own session, whose whole process tree is killed on a timeout.

    The deepspeed runner's ranks outlive a killed runner, so killing only ``cmd`` on a hang
    would leave them holding ports and cores for the rest of the suite.
    """
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    _LIVE.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(map(str, cmd))} did not finish in {timeout_s:.0f} s and was killed; "
            f"its output ends:\n{out[-3000:]}\n{err[-3000:]}"
        )
    finally:
        _LIVE.discard(proc)
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{out[-3000:]}\n{err[-5000:]}"
        )
    return done


def tree(*roots: Path) -> dict[str, str]:
    """{path: what is there} for every entry under ``roots``, the roots included: a link's
    target (and the hash of the file it leads to), ``dir``, a file's sha256, or ``other``.
    The hostile-input tests compare it before and after a command to show that nothing
    outside the command's own output changed."""
    out: dict[str, str] = {}
    for root in map(Path, roots):
        if not (root.exists() or root.is_symlink()):
            continue
        for p in [root, *sorted(root.rglob("*"))]:
            if p.is_dir() and not p.is_symlink():
                out[str(p)] = "dir"
                continue
            what = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "other"
            out[str(p)] = f"link -> {os.readlink(p)} {what}" if p.is_symlink() else what
    return out


def signal_recipe_when(
    args: list[str], ready, signum: int, *, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, float]:
    """The tiny recipe on one rank with ``args``, sent ``signum`` once ``ready()`` holds (polled
    every 20 ms, for at most 300 s, while it runs); its result and the seconds from the signal to
    its exit. Its whole session is killed on the way out, whatever happened."""
    proc = subprocess.Popen(
        [sys.executable, "recipes/pretrain_tiny.py", *args],
        cwd=ROOT,
        env={**env(), **(extra_env or {})},
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not ready():
            time.sleep(0.02)
        proc.send_signal(signum)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=120)
        stop_s = time.monotonic() - signalled
    finally:
        kill_tree(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), stop_s


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the session a process was started in (start_new_session=True)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="session")
def stdlib_prepared(tmp_path_factory) -> tuple[Path, str, str]:
    """The embedded corpus, prepared once per test session through the command line (``anneal
    data prepare --input stdlib``, in this process; about 7 s): (its directory, what the
    command printed on stdout, on stderr). tests/data/test_data_prepare.py checks the command's
    output and result on it; the other tests train on it (``stdlib_data``)."""
    import contextlib
    import io

    from anneal.cli import main

    out = tmp_path_factory.mktemp("data") / "stdlib"
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main(["data", "prepare", "--input", "stdlib", "--out", str(out)])
    assert code == 0, errors.getvalue()
    return out, printed.getvalue(), errors.getvalue()


@pytest.fixture(scope="session")
def stdlib_data(stdlib_prepared) -> Path:
    """The embedded corpus, prepared once per test session (vocabulary 8,192)."""
    return stdlib_prepared[0]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared corpus of a few hundred kilobytes (byte-level vocabulary; half a second)."""
    from anneal.data.prepare import prepare

    src = tmp_path_factory.mktemp("src") / "text.txt"
    src.write_text(
        "\n\n".join(f"doc {i}: " + "the quick brown fox jumps " * 40 for i in range(150))
    )
    out = tmp_path_factory.mktemp("prep") / "data"
    prepare(inputs=[str(src)], out=out, vocab_size=300, progress=False)
    return out


@pytest.fixture(scope="session", autouse=True)
def _shared_runs_started(request, tmp_path_factory):
    """Starts the shared runs (``shared_runs``) in the background at the session's first test,
    when any collected test reads them: they train in their own processes while the fast tests
    of their own run here (those readers are ordered after them: ``_order``), which took the
    quick suite from about 3 min 30 s to under 3 min on 2 cores. A session that ends first
    kills what is still running."""
    if not any(map(_uses_shared_runs, request.session.items)):
        yield None
        return
    from concurrent.futures import ThreadPoolExecutor

    tmp = tmp_path_factory.mktemp("shared_runs")
    launches = shared_launches(request.getfixturevalue("tiny_data"), tmp)
    shm_before = shm_files()
    pool = ThreadPoolExecutor(1)
    runs = pool.submit(run_recipes, list(launches.values()), parallel=RUNS_AT_ONCE)
    yield tmp, launches, shm_before, runs
    if not runs.done():
        for proc in list(_LIVE):
            kill_tree(proc)
    pool.shutdown(wait=True, cancel_futures=True)


# The background runs start this many at a time: the tests of their own use the other core.
RUNS_AT_ONCE = 1


@pytest.fixture(scope="session")
def shared_runs(_shared_runs_started) -> dict:
    """The suite's shared short runs, all on ``tiny_data`` with SMALL shapes, started in the
    background at the session's first test (``_shared_runs_started``): {name: (run directory,
    its finished process)}, plus "shm_before" (/dev/shm's names before them), "lock" (the stale
    lock of the 2-rank run), "noval_data" (a corpus prepared without validation) and
    "grad_check" (what that script wrote).

    - ``two_ranks``: 2 ranks through the deepspeed runner, ZeRO-3, checkpoints at steps 1 and
      2, stopped after step 2 of 3 (as a preemption leaves a run: no last validation, plots or
      report process), started with a stale torch-extension lock in its TORCH_EXTENSIONS_DIR.
    - ``tiny_run``: the same on 1 rank, stopped after step 2 of 4.
    - ``fp32``, ``bf16``, ``ac``, ``auto``: 4 steps from the same seed (validation at steps 2
      and 4, a progress line every 2 steps): cpu.json, train.precision=bf16, activation
      checkpointing on, and the shipped zero3_bf16.json (which a CPU switches to fp32).
    - ``noval``: 2 steps with train.val_samples=0 on "noval_data".
    - ``grad_check``: tests/scripts/grad_check.py on 2 ranks (tests/scripts/ranks.py: one
      optimizer step against plain torch, ENGINE_REFERENCE_OVERRIDES), for
      tests/train/test_engine_reference.py.

    Their users are the fixtures below."""
    if _shared_runs_started is None:
        pytest.fail(
            "shared_runs: this session did not start the shared runs, as no test it collected "
            "names them: take shared_runs (or a fixture built on it) as an argument, not "
            "through request.getfixturevalue, so that the session and `make test`'s split see it"
        )
    tmp, launches, shm_before, runs = _shared_runs_started
    done = runs.result()
    return {
        **{name: (tmp / name, d) for name, d in zip(launches, done, strict=True)},
        "shm_before": shm_before,
        "lock": tmp / "torch_extensions" / "deepspeed_shm_comm" / "lock",
        "noval_data": tmp / "noval_data",
        "grad_check": json.loads((tmp / "grad_check.json").read_text()),
    }


def shared_launches(tiny_data: Path, tmp: Path) -> dict[str, dict]:
    """{name: run_recipe's arguments} for ``shared_runs``, in the order they start (the 2-rank
    launches first), after preparing what they need under ``tmp`` (the stale lock, the corpus
    without validation)."""
    from anneal.data.prepare import prepare

    lock = tmp / "torch_extensions" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    noval = tmp / "noval_data"
    text = tmp / "corpus.txt"
    text.write_text(
        "".join(f"line {i} of a small corpus, number {i * 7 % 13}\n" for i in range(4000))
    )
    prepare(inputs=[str(text)], out=noval, vocab_size=300, val_fraction=0.0, progress=False)

    stopped = ["--val-every", "0", "--save-every", "1", "--set", "train.stop_at_step=2"]
    same_seed = ["--max-steps", "4", "--val-every", "2", "--save-every", "0"]
    same_seed += [*SMALL, "--set", "train.log_every=2"]
    auto = ["--ds-config", "zero3_bf16.json", "--set", "ds.optimizer.params.torch_adam=true"]
    auto += ["--set", "ds.train_micro_batch_size_per_gpu=4"]
    auto += ["--set", "ds.gradient_accumulation_steps=2"]
    launches = {
        "two_ranks": dict(
            args=["--max-steps", "3", *stopped, *SMALL],
            ranks=2,
            runner="deepspeed",
            timeout_s=180,
            extra_env={"TORCH_EXTENSIONS_DIR": str(lock.parent.parent)},
        ),
        "tiny_run": dict(args=["--max-steps", "4", *stopped, *SMALL]),
        "fp32": dict(args=same_seed),
        "bf16": dict(args=[*same_seed, "--set", "train.precision=bf16"]),
        "ac": dict(args=[*same_seed, "--set", "model.activation_checkpointing=true"]),
        "auto": dict(args=[*same_seed, *auto]),
        "noval": dict(
            args=["--max-steps", "2", *SMALL, "--set", "train.val_samples=0"], data=noval
        ),
    }
    for name, launch in launches.items():
        data = launch.pop("data", tiny_data)
        launch["args"] = ["--out", str(tmp / name), "--data", str(data), *launch["args"]]
    grad_check = dict(
        args=[str(tmp / "grad_check.json"), str(tiny_data), str(tmp / "grad_check")]
        + ENGINE_REFERENCE_OVERRIDES,
        ranks=2,
        recipe="tests/scripts/grad_check.py",
    )
    return {"grad_check": grad_check, **launches}


# tests/train/test_engine_reference.py's step: SMALL's model, micro-batch 2 x accumulation 2 on 2
# ranks, a clip below the gradient norm and a large eps (so that the clip shows through AdamW),
# and a weight decay large enough to tell decayed from undecayed weights.
ENGINE_REFERENCE_OVERRIDES = [
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.intermediate_size=176",
    "model.num_attention_heads=4",
    "model.seq_len=64",
    "ds.train_micro_batch_size_per_gpu=2",
    "ds.gradient_accumulation_steps=2",
    "ds.scheduler.params.warmup_num_steps=2",
    "ds.gradient_clipping=0.5",
    "ds.optimizer.params.eps=0.0001",
    "ds.optimizer.params.weight_decay=0.5",
]


@pytest.fixture(scope="session")
def tiny_run(shared_runs) -> Path:
    """One real run on ``tiny_data`` (1 rank, SMALL shapes, checkpoints at steps 1 and 2, stopped
    after step 2 of 4 as a preemption leaves it), shared by the hostile-input tests of resume
    and export, which copy it before they damage it."""
    return shared_runs["tiny_run"][0]


@pytest.fixture(scope="session")
def two_rank_run(shared_runs) -> dict:
    """The 2-rank ZeRO-3 run of ``shared_runs``: {"out", "lock", "shm_before"}.
    tests/hf/test_export.py exports it; tests/train/test_stale_state.py checks that it neither
    waited on
    the stale lock nor left files in /dev/shm (nor did any shared run, nor any test before it:
    the listing before was taken before them all)."""
    out = shared_runs["two_ranks"][0]
    return {"out": out, "lock": shared_runs["lock"], "shm_before": shared_runs["shm_before"]}


def shm_files() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


@pytest.fixture(scope="session")
def same_seed_runs(shared_runs) -> dict:
    """{name: (run directory, its finished process)} for the four same-seed runs of
    ``shared_runs``: fp32, bf16, ac, auto. tests/train/test_precision.py and
    tests/train/test_activation_checkpointing.py compare them; tests/config/test_schedule.py and
    tests/observe/test_observe.py read the fp32 one."""
    return {name: shared_runs[name] for name in ("fp32", "bf16", "ac", "auto")}


def run_recipes(launches: list[dict], *, parallel: int = 2) -> list[subprocess.CompletedProcess]:
    """``run_recipe(**one)`` for each of ``launches``, ``parallel`` at a time; their results in
    order. The first failure is raised once all have ended. Each process computes on one thread
    (OMP_NUM_THREADS=1): two processes of two spinning threads each on two cores took a
    quarter more CPU time here, and these tiny runs gain nothing from a second thread."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(parallel) as pool:
        futures = [
            pool.submit(
                run_recipe,
                **{**one, "extra_env": {"OMP_NUM_THREADS": "1", **(one.get("extra_env") or {})}},
            )
            for one in launches
        ]
        return [f.result() for f in futures]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("RANK", None)
    e["PYTHONPATH"] = str(ROOT)
    return e


def run_recipe(
    args: list[str],
    *,
    ranks: int = 1,
    recipe: str = "recipes/pretrain_tiny.py",
    timeout_s: int = 300,
    check: bool = True,
    extra_env: dict[str, str] | None = None,
    runner: str = "ranks",
) -> subprocess.CompletedProcess:
    """Train through the recipe: plain python for one rank; on several, ``runner``:

    - "ranks" (the default): tests/scripts/ranks.py, which starts the ranks with the
      environment DeepSpeed's launcher gives them, one thread each, in the test's session. The
      drills whose subject is training (equal losses, resume, export, scores) take it: a
      2-rank launch of the tiny recipe took 11 s here against 16 s through the deepspeed
      runner, whose runner and launcher processes each import torch and DeepSpeed before the
      ranks start (2026-12-07). Its ranks are forked after it has imported those once: 8.1-8.6
      s and about 8.4 s of CPU against 12.6-15.2 s and about 15 s of CPU as new interpreters
      (its ``--exec``), for a 2-rank launch of 8 steps at SMALL's shape (2026-12-07).
    - "deepspeed": ``deepspeed --num_gpus N``, what users and ``python -m launcher`` run. The
      shared 2-rank run and the tests of what the runner itself does take it."""
    cmd = (
        [sys.executable, recipe, *args]
        if ranks == 1
        else launch(ranks, recipe, *args, runner=runner)
    )
    e = {**env(), **(extra_env or {})}
    return run_process(cmd, timeout_s=timeout_s, check=check, cwd=ROOT, env=e)


def launch(ranks: int, *command: str, runner: str = "ranks") -> list[str]:
    """The command that starts ``command`` (a script and its arguments; ``-m MODULE ...`` too
    with the "ranks" runner) on ``ranks`` local ranks through ``runner`` ("ranks" or
    "deepspeed": ``run_recipe`` says which test takes which)."""
    if runner == "ranks":
        return [sys.executable, str(ROOT / "tests" / "scripts" / "ranks.py"), str(ranks), *command]
    if runner == "deepspeed":
        port = str(free_port())
        return [str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", port, *command]
    raise ValueError(f"runner={runner!r}: expected 'ranks' or 'deepspeed'")


# Small shapes so that end-to-end runs take seconds of compute on CPU.
SMALL = [
    "--set",
    "model.hidden_size=64",
    "--set",
    "model.num_hidden_layers=2",
    "--set",
    "model.intermediate_size=176",
    "--set",
    "model.num_attention_heads=4",
    "--set",
    "model.seq_len=64",
    "--set",
    "train.val_samples=16",
    "--set",
    "ds.scheduler.params.warmup_num_steps=2",
    "--set",
    "ds.gradient_accumulation_steps=2",
    "--set",
    "train.log_every=1",
]
# SMALL less its pinned accumulation, for runs that set their batch another way (a global batch,
# an accumulation of their own).
SMALL_OWN_BATCH = [
    x
    for pair in zip(SMALL[::2], SMALL[1::2], strict=True)
    if pair[1] != "ds.gradient_accumulation_steps=2"
    for x in pair
]


# The parallel layouts' tests (tests/train/test_tensor_parallel.py,
# tests/train/test_sequence_parallel.py):
# SMALL's model at context 32, validated on 8 windows, micro-batch 2, PARALLEL_STEPS steps.
PARALLEL_STEPS = 10
PARALLEL_SHAPE = [
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.intermediate_size=176",
    "model.num_attention_heads=4",
    "model.seq_len=32",
    "train.val_samples=8",
    "train.log_every=1",
    "ds.scheduler.params.warmup_num_steps=2",
    "ds.train_micro_batch_size_per_gpu=2",
]


def sets(*items: str) -> list[str]:
    """``--set`` before each item."""
    return [x for item in items for x in ("--set", item)]


def assert_resumed_steps_match(resumed: dict, full: dict, steps) -> None:
    """The train rows (by step) of a resumed run against the run that never stopped: exactly
    ``steps``, each with the loss and grad norm within 1e-5 relative (the reductions ran in
    another order), the LR within 1e-9 and the tokens equal."""
    assert sorted(resumed) == list(steps)
    for step in resumed:
        for key in ("loss", "grad_norm"):
            assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-5), (step, key)
        assert resumed[step]["lr"] == pytest.approx(full[step]["lr"], rel=1e-9), step
        assert resumed[step]["tokens"] == full[step]["tokens"]


def parallel_args(
    data, out, *, layout: str, accum: int, stage: int, extra=(), save_every: int = 5
) -> list[str]:
    """PARALLEL_STEPS steps at micro-batch 2 (global batch = 2 x accum x data-parallel ranks)
    under ``layout`` (a --set item such as ``ds.tensor_parallel.autotp_size=2``), validated at
    the last, saved every ``save_every`` steps. The schedule runs to PARALLEL_STEPS + 1 and the
    run stops after PARALLEL_STEPS (``train.stop_at_step``), which spares each launch the
    end-of-run report process."""
    return [
        *("--out", str(out), "--data", str(data), "--max-steps", str(PARALLEL_STEPS + 1)),
        *("--val-every", str(PARALLEL_STEPS), "--save-every", str(save_every)),
        *sets(
            f"train.stop_at_step={PARALLEL_STEPS}",
            *PARALLEL_SHAPE,
            f"ds.gradient_accumulation_steps={accum}",
            f"ds.zero_optimization.stage={stage}",
            layout,
        ),
        *extra,
    ]


@pytest.fixture(scope="module")
def world_of_one():
    """This process as a world of one rank (gloo), for engines built in-process; the process
    group is destroyed after the module's tests."""
    import deepspeed.comm

    from anneal.dist import init_distributed, world_of_one_env

    saved = dict(os.environ)
    os.environ.update(world_of_one_env())
    init_distributed(600)
    yield
    # DeepSpeed's own call also drops the groups it cached (deepspeed.utils.groups), which
    # a later in-process engine would otherwise reuse, destroyed.
    deepspeed.comm.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def resolve_tiny(args: list[str], *, world_size: int):
    """The launch the tiny recipe resolves from ``args`` on ``world_size`` CPU ranks."""
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.resolution.resolve import resolve_launch

    tiny = ROOT / "recipes" / "pretrain_tiny.py"
    cfg, overrides = config_from_args(args, prog=str(tiny), on_cpu=True, **load_recipe(tiny))
    return resolve_launch(cfg, overrides, world_size=world_size, device_type="cpu")


def refused_tiny(args: list[str], *, world_size: int) -> str:
    """The one-paragraph error (raised on every rank) with which ``resolve_tiny`` refuses."""
    from anneal.errors import UserError

    with pytest.raises(UserError) as caught:
        resolve_tiny(args, world_size=world_size)
    assert caught.value.every_rank
    return str(caught.value)
