"""Every command block of README.md and docs/*.md works as written: run on CPU in a scratch copy
of the checkout prepared as a fresh clone, shrunk only by documented flags, no documented
command prints a traceback, exits non-zero where the docs do not announce it, or prints (or
writes into a run's metrics.jsonl) an MFU over 100%.

How a block is recognised as commands, and the markers a page may put before a block (``skip``
with its reason, ``expect-exit``): tests/docs_blocks.py. What this file adds is CI's side, in
one table, RULES: per documented command (matched with its ``.venv/bin/`` and ``VAR=value``
prefixes removed), the documented flags that shrink it, what the scratch clone holds before it
runs (GIVENS: the embedded corpus prepared, a user's own files made up), or why it is not run
here (hardware, a download, minutes of benchmark). A command that no rule names runs verbatim.
Every skip, a page's or the table's, is a skipped test whose reason pytest's summary lists.

The scratch clone: the checkout's files (``git ls-files``: tracked and new, not ignored), a
``.venv`` link to the checkout's venv, ``PYTHONPATH`` at the clone (a fresh clone's editable
install points at itself; a shared venv's may point elsewhere), and a ``PATH`` without the venv:
a fresh shell, the venv not activated, as README's commands are typed. Each block gets its own
clone; its commands run in order, in one ``bash``, each on its own, and stop at the first that
fails. ``python tests/house/test_docs_commands.py`` prints every block and command as this test sees
it: run (and as what), skipped (and why), or not commands.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import docs_blocks as db
from tests.conftest import ROOT, SMALL, SMALL_OWN_BATCH, free_port, run_process

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
COMMAND_TIMEOUT_S = 240


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """What CI does with the documented commands that ``pattern`` matches (re.search on the
    command with its comment dropped, continuations joined, and ``VAR=value`` and
    ``.venv/bin/`` prefixes removed)."""

    pattern: str
    add: tuple[str, ...] = ()  # documented flags; before the first ` -- ` (launcher), else last
    last: tuple[str, ...] = ()  # documented flags at the end (the recipe's, after a launcher's --)
    given: tuple[str, ...] = ()  # keys of GIVENS: what the scratch clone holds first
    skip: str = ""  # not run here, and why (its program and repository paths are still checked)


# A run of two optimizer steps at the suite's small shapes (tests/conftest.py's SMALL).
TRAIN = ("--max-steps", "2", *SMALL)
# The same for a command that sets its batch by optim.global_batch_tokens, which SMALL's pinned
# accumulation would contradict (README's continued pretraining on a CPU).
TRAIN_OWN_BATCH = ("--max-steps", "2", *SMALL_OWN_BATCH)
# The fit from 64 grid starts and 4 bootstrap resamples (documented in docs/planning.md).
FIT = ("--starts", "64", "--bootstrap", "4")
STDLIB = ("data/stdlib",)
# The launcher prints the deepspeed command, its environment and the forecast, and starts
# nothing; `run` without the ssh check of the hostfile's hosts (gpu001, ... are not here).
DRY = ("--dry-run",)
RUN_DRY = ("--dry-run", "--no-ssh-check")
# Pre-flight checks the free disk for two checkpoints even on a dry run: the 1b and 7b presets
# (about 30 and 195 GiB) at one layer of their width, which fits a CI machine's disk.
BIG = r".*recipes/pretrain_(7b|1b)\.py"
ONE_LAYER = ("--set", "model.num_hidden_layers=1")
BENCH = (
    "a benchmark, minutes by design (docs/benchmarks.md gives each one's time); "
    "tests/bench/test_bench_smoke.py runs every bench/ script in its --smoke mode, "
    "tests/bench/test_bench_gpu.py runs gpu.sh --cpu-smoke"
)
RULES = [
    Rule(
        pattern=r"^make (demo|test)\b",
        skip="`make test` is this suite (it would run itself); `make demo` trains 320 steps, "
        "about 5 minutes: tests/bench/test_bench_smoke.py runs its scripts/demo.py for 2 steps",
    ),
    Rule(pattern=r"^anneal fit --csv ", given=("runs.csv",), add=FIT),
    Rule(pattern=r"^anneal fit ", given=("sweep",), add=FIT),
    Rule(pattern=r"^anneal data prepare --input web\.jsonl", given=("web.jsonl, code/",)),
    Rule(
        pattern=r"^anneal data prepare .*--tokenizer models/",
        skip="needs models/Qwen2.5-7B, a Hugging Face download; tests/hf/test_init_from.py "
        "prepares data with a small model's tokenizer",
    ),
    Rule(pattern=r"^anneal data verify data/stdlib", given=STDLIB),
    Rule(
        pattern=r"^anneal export runs/qwen-papers ",
        skip="exports the run of the command before it (8 GPUs, a download); "
        "tests/hf/test_export.py exports runs",
    ),
    Rule(
        pattern=r"^python recipes/pretrain_tiny\.py --out .*optim\.global_batch_tokens",
        given=STDLIB,
        add=TRAIN_OWN_BATCH,
    ),
    Rule(pattern=r"^python recipes/pretrain_tiny\.py --out ", given=STDLIB, add=TRAIN),
    Rule(
        pattern=r"^python recipes/pretrain_moe_tiny\.py --out ", given=STDLIB, add=TRAIN_OWN_BATCH
    ),
    Rule(
        pattern=r"^deepspeed --num_gpus 2 recipes/pretrain_moe_tiny\.py ",
        given=STDLIB,
        add=TRAIN_OWN_BATCH,
    ),
    Rule(
        pattern=r"^python recipes/continue_pretraining\.py --init-from models/tiny",
        add=("--max-steps", "2"),
    ),
    Rule(
        pattern=r"^deepspeed --num_gpus 8 recipes/continue_pretraining\.py ",
        skip="8 GPUs and models/Qwen2.5-7B, a download; tests/hf/test_init_from.py trains from "
        "a small Hugging Face model",
    ),
    Rule(
        pattern=r"^deepspeed --num_gpus 8 ",
        skip="8 GPUs (on CPU, 8 ranks of a 1B model); the recipe's own path runs above as "
        "`python recipes/pretrain_tiny.py`",
    ),
    Rule(
        pattern=r"^deepspeed --hostfile hostfiles/h100 ",
        skip="the two H100 nodes of hostfiles/h100; `python -m launcher run --hostfile "
        "hostfiles/h100 ...` pre-flights the same launch here (--dry-run)",
    ),
    Rule(pattern=rf"^python -m launcher run {BIG}", given=STDLIB, add=RUN_DRY, last=ONE_LAYER),
    Rule(pattern=r"^python -m launcher run ", given=STDLIB, add=RUN_DRY),
    Rule(pattern=rf"^python -m launcher submit {BIG}", given=STDLIB, add=DRY, last=ONE_LAYER),
    Rule(pattern=r"^python -m launcher submit ", given=STDLIB, add=DRY),
    Rule(pattern=r"(^| )(bash )?bench/", skip=BENCH),
    Rule(pattern=r"^python -m pytest ", skip="a test of this suite: CI runs it in its session"),
]


def normalized(command: str) -> str:
    """``command`` as RULES match it: one line, no comment, no ``VAR=value`` prefix, the
    program without ``.venv/bin/``."""
    text = " ".join(db.strip_comment(command).replace("\\\n", " ").split())
    while (first := text.split(" ", 1)[0]) and re.fullmatch(r"[A-Za-z_]\w*=\S*", first):
        text = text.split(" ", 1)[1] if " " in text else ""
    return text.removeprefix(".venv/bin/")


def rule_for(command: str) -> Rule | None:
    text = normalized(command)
    return next((r for r in RULES if re.search(r.pattern, text)), None)


def shrunk(command: str, rule: Rule | None) -> str:
    """The command CI runs: the documented one with ``rule.add`` before its first ``--`` word
    (the launcher's flags) or at its end, and ``rule.last`` at its end. A deepspeed command
    that names no port gets a free ``--master_port``: its default, 29500, is the Slurm
    drills' in the other session of `make test-all` (it failed once with EADDRINUSE)."""
    text = db.strip_comment(command)
    ds = re.match(r"(\S*/)?deepspeed(?=\s)", text)
    if ds and "--master_port" not in text:
        text = f"{ds.group(0)} --master_port {free_port()}{text[ds.end() :]}"
    if rule and rule.add:
        add = shlex.join(rule.add)
        m = re.search(r"(?<=\s)--(?=\s)", text)
        text = f"{text[: m.start()]}{add} {text[m.start() :]}" if m else f"{text} {add}"
    return f"{text} {shlex.join(rule.last)}" if rule and rule.last else text


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One documented command (or a page's skipped block, ``index`` 0) as a test."""

    block: db.Block
    index: int
    command: str = ""

    @property
    def id(self) -> str:
        return f"{self.block.name}#{self.index}"


def all_blocks() -> list[db.Block]:
    return [b for page in PAGES for b in db.extract_blocks((ROOT / page).read_text(), page)]


def cases() -> list[Case]:
    """A case per command of every block that holds commands; one per skipped block."""
    out = []
    for block in all_blocks():
        found = db.commands(block)
        if not found:
            continue
        if db.parse_marker(block.marker).skip:
            out.append(Case(block=block, index=0))
            continue
        out += [Case(block=block, index=k, command=c) for k, c in enumerate(found, start=1)]
    return out


CASES = cases()


# --- What the scratch clone holds before a block runs ---------------------------------------


def _law(params: float, tokens: float) -> float:
    """A known scaling law (tests/planning/test_planner.py's TRUTH): the made-up runs' final
    losses."""
    return 1.8 + 400.0 / params**0.34 + 1500.0 / tokens**0.37


SWEEP_GRID = [(n, d) for n in (1e6, 3e6, 1e7) for d in (1e7, 4e7)]


def _given_sweep(clone: Path, _stdlib: Path) -> None:
    """What recipes/scaling_sweep.py leaves in its default --out: six finished runs (made up
    from a known law: config.json's model.params, metrics.jsonl's last train and val rows, what
    `anneal fit` reads) and the sweep's own fit.json, fit.png and sweep.json."""
    sweep = clone / "runs" / "scaling_sweep"
    for params, tokens in SWEEP_GRID:
        run = sweep / f"n{params:.0e}_d{tokens:.0e}"
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"model": {"params": params}}))
        rows = [
            {"kind": "train", "step": 10, "tokens": tokens, "loss": _law(params, tokens) + 0.1},
            {"kind": "val", "step": 10, "val_loss": _law(params, tokens)},
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (sweep / "fit.json").write_text(json.dumps({"format": "anneal-chinchilla-fit"}))
    (sweep / "fit.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (sweep / "sweep.json").write_text(json.dumps({"grid": "test", "runs": []}))


def _given_csv(clone: Path, _stdlib: Path) -> None:
    """A user's runs.csv: params,tokens,loss of the same made-up runs."""
    rows = [f"{n:g},{d:g},{_law(n, d):.6f}\n" for n, d in SWEEP_GRID]
    (clone / "runs.csv").write_text("params,tokens,loss\n" + "".join(rows))


def _given_blend(clone: Path, _stdlib: Path) -> None:
    """A user's web.jsonl (the docs' paragraphs, one document each) and code/ (the library's
    Python files): the two sources of README's blend."""
    paragraphs = [p for page in PAGES for p in (clone / page).read_text().split("\n\n")]
    with open(clone / "web.jsonl", "w") as f:
        f.writelines(json.dumps({"text": p}) + "\n" for p in paragraphs if p.strip())
    shutil.copytree(clone / "anneal", clone / "code", ignore=shutil.ignore_patterns("__py*"))


def _given_stdlib(clone: Path, stdlib: Path) -> None:
    """data/stdlib as `make demo` leaves it (the session's prepared corpus, copied)."""
    shutil.copytree(stdlib, clone / "data" / "stdlib")


GIVENS = {
    "data/stdlib": _given_stdlib,
    "sweep": _given_sweep,
    "runs.csv": _given_csv,
    "web.jsonl, code/": _given_blend,
}


@functools.cache
def clone_files() -> tuple[str, ...]:
    """The checkout's files as a fresh clone has them: tracked and new (git's list, not the
    ignored ones), or, without git, every file but the venv, runs, data and caches."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
        names = [n for n in listed.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "runs", "data", "__pycache__"}
        names = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if not skip & set(p.relative_to(ROOT).parts)
        ]
    return tuple(n for n in names if n != ".venv" and (ROOT / n).is_file())


def fresh_shell_env(clone: Path) -> dict[str, str]:
    """The environment of a fresh shell in ``clone``: no venv on PATH, the clone's code."""
    venv_bins = {os.path.realpath(ROOT / ".venv" / "bin"), os.path.realpath(sys.prefix + "/bin")}
    path = [p for p in os.environ.get("PATH", "").split(":") if p]
    path = [p for p in path if os.path.realpath(p) not in venv_bins]
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "RANK", "LOCAL_RANK"}}
    env.update(PATH=":".join(path), PYTHONPATH=str(clone))
    return env


# --- Running a block -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    """What became of one command of a block: skipped (why), not reached, or run."""

    ran: str = ""
    skip: str = ""
    code: int = 0
    output: str = ""
    seconds: float = 0.0
    problems: tuple[str, ...] = ()


class BlockRuns:
    """Each block run once per session, in its own scratch clone; the outcome of every command
    (the block's tests share it)."""

    def __init__(self, tmp_path_factory, stdlib: Path):
        self.tmp, self.stdlib = tmp_path_factory, stdlib
        self.done: dict[str, list[Outcome]] = {}

    def of(self, block: db.Block) -> list[Outcome]:
        if block.name not in self.done:
            self.done[block.name] = self._run(block)
        return self.done[block.name]

    def _clone(self, block: db.Block) -> Path:
        clone = self.tmp.mktemp(re.sub(r"\W", "_", block.name)) / "anneal"
        for name in clone_files():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
        (clone / ".venv").symlink_to((ROOT / ".venv").resolve())
        return clone

    def _run(self, block: db.Block) -> list[Outcome]:
        clone = self._clone(block)
        found = db.commands(block)
        rules = [rule_for(c) for c in found]
        for key in dict.fromkeys(g for r in rules if r and not r.skip for g in r.given):
            GIVENS[key](clone, self.stdlib)
        expected = db.parse_marker(block.marker).expect_exit
        outcomes: list[Outcome] = []
        failed = ""
        for k, (command, rule) in enumerate(zip(found, rules, strict=True), start=1):
            if rule and rule.skip:
                outcomes.append(Outcome(skip=rule.skip))
            elif failed:
                outcomes.append(Outcome(skip=f"not reached: {failed} failed"))
            else:
                outcomes.append(run_one(shrunk(command, rule), clone, expected))
                if outcomes[-1].problems:
                    failed = f"{block.name}#{k}"
        return outcomes


def run_one(command: str, clone: Path, expected: tuple[int, ...]) -> Outcome:
    """``command`` in a fresh bash in ``clone``; its problems, and any MFU over 1 in the
    metrics.jsonl files under the clone's runs/."""
    start = time.monotonic()
    try:
        done = run_process(
            ["bash", "-c", f"set -o pipefail\n{command}"],
            timeout_s=COMMAND_TIMEOUT_S,
            cwd=clone,
            env=fresh_shell_env(clone),
        )
    except pytest.fail.Exception as e:  # run_process's timeout, the process tree killed
        return Outcome(ran=command, code=-9, output=str(e), problems=("a timeout",))
    output = done.stdout + done.stderr
    found = db.problems(output, done.returncode, expected) + written_mfu_over_100(clone)
    return Outcome(
        ran=command,
        code=done.returncode,
        output=output,
        seconds=time.monotonic() - start,
        problems=tuple(found),
    )


def written_mfu_over_100(clone: Path) -> list[str]:
    """Each metrics.jsonl under ``clone``/runs whose train rows hold an MFU over 1 (100%)."""
    found = []
    for metrics in sorted((clone / "runs").rglob("metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        over = [r["mfu"] for r in rows if isinstance(r.get("mfu"), int | float) and r["mfu"] > 1]
        if over:
            where = metrics.relative_to(clone)
            found.append(f"MFU over 100% in {where}: {', '.join(f'{x:.0%}' for x in over)}")
    return found


@pytest.fixture(scope="session")
def block_runs(tmp_path_factory, stdlib_data) -> BlockRuns:
    """The blocks' runs of this session, each block run once (its first command's test)."""
    return BlockRuns(tmp_path_factory, stdlib_data)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_documented_command_works_as_written(case, block_runs):
    """The documented command, shrunk by RULES, run on CPU in a scratch clone after the
    commands before it in its block: no traceback, no exit the docs do not announce, no MFU
    over 100% printed or written. A page's skipped block, a command RULES skips, and a command
    after one that failed are skipped tests with their reason. The whole parametrization took
    181 s here (2 cores shared with other jobs' tests, 69 s of CPU; 2026-12-03, with every
    command passing but two): the embedded corpus prepared once for the givens and once by
    README's own command, one training run of 2 steps at SMALL shapes (about a third of it),
    six launcher dry runs, the planner, the fit and the data commands."""
    marker = db.parse_marker(case.block.marker)
    if marker.skip:
        pytest.skip(f"{case.block.name}: {marker.skip}")
    outcome = block_runs.of(case.block)[case.index - 1]
    if outcome.skip:
        pytest.skip(f"{case.id} {db.strip_comment(case.command)[:60]!r}: {outcome.skip}")
    if outcome.problems:
        pytest.fail(
            f"{case.id}: {'; '.join(outcome.problems)}\n$ {outcome.ran}\n(exit {outcome.code}, "
            f"{outcome.seconds:.0f} s) its output ends:\n{outcome.output[-4000:]}",
            pytrace=False,
        )


# --- What a command names, checked without running it ----------------------------------------

BUILTINS = {"cd", "echo"}


def missing(commands: list[str], clone: Path, path_var: str) -> list[list[str]]:
    """For each command of one block, what it names that ``clone`` (set up: its ``.venv``
    made) lacks: its program (a path in the clone, a shell builtin, or found on ``path_var``),
    and each word that is a path into the clone's own folders (recipes/, hostfiles/, ...)
    unless the block writes it (an ``--out``, of this command or an earlier one)."""
    folders = {n.split("/")[0] for n in clone_files() if "/" in n}
    written: list[str] = []
    out = []
    for command in commands:
        lacking = []
        name = db.program(command)
        if "/" in name:
            found = (clone / name).exists()
        else:
            found = name in BUILTINS or shutil.which(name, path=path_var) is not None
        if not found:
            lacking.append(f"program {name!r}")
        ws = db.words(command)
        written += [b for a, b in zip(ws, ws[1:], strict=False) if a == "--out"]
        for word in (w.split("=", 1)[-1] for w in ws):
            if word.split("/")[0] not in folders or re.search(r"[*?\[$]", word):
                continue
            made = any(word == w or word.startswith(w.rstrip("/") + "/") for w in written)
            if not made and not (clone / word).exists():
                lacking.append(f"path {word!r}")
        out.append(lacking)
    return out


STATIC = [c for c in CASES if c.command]


@pytest.mark.parametrize("case", STATIC, ids=lambda c: c.id)
def test_documented_command_names_a_program_and_files_that_exist(case):
    """Fast, for every documented command (those RULES skips included): its program exists for
    a fresh shell (no venv on PATH; ``.venv/bin/...`` as setup makes it) and every path it names
    in the repository's own folders exists (an earlier command of its block may write it): a
    renamed script or hostfile fails here before anything runs."""
    lacking = missing(db.commands(case.block), ROOT, fresh_shell_env(ROOT)["PATH"])
    new = lacking[case.index - 1]
    assert not new, f"{case.id} {db.strip_comment(case.command)!r} names what is not there: {new}"


# --- The table and the static check, on made-up commands ----------------------------------


def test_rules_shrink_by_adding_flags_before_the_launchers_dashes_or_at_the_end():
    """The table's flags go before the first ``--`` word (the launcher's own) or at the end,
    after the comment is dropped; rules match with ``.venv/bin/`` and ``VAR=`` removed."""
    rule = Rule(pattern="x", add=("--dry-run",))
    launch = ".venv/bin/python -m launcher run recipes/a.py --num-gpus 8 -- \\\n    --set a=1 # c"
    assert shrunk(launch, rule) == (
        ".venv/bin/python -m launcher run recipes/a.py --num-gpus 8 --dry-run -- \\\n    --set a=1"
    )
    assert (
        shrunk("python recipes/a.py --out r  # one", rule)
        == "python recipes/a.py --out r --dry-run"
    )
    assert shrunk("anneal x --set a=--b", None) == "anneal x --set a=--b"
    assert normalized("PYTHONPATH=. .venv/bin/python  a.py \\\n  -x  # c") == "python a.py -x"
    assert rule_for(".venv/bin/python -m launcher submit r.py -- --out x").add == ("--dry-run",)
    both = Rule(pattern="x", add=("--dry-run",), last=("--set", "a=1"))
    assert shrunk("python -m launcher run r.py -- --out x", both) == (
        "python -m launcher run r.py --dry-run -- --out x --set a=1"
    )
    assert rule_for("deepspeed --num_gpus 8 recipes/pretrain_1b.py").skip
    assert rule_for("anneal plan --gpus 8") is None
    ported = shrunk(".venv/bin/deepspeed --num_gpus 2 r.py --out x", None).split()
    assert ported[:2] == [".venv/bin/deepspeed", "--master_port"] and ported[2].isdigit()
    assert ported[3:] == ["--num_gpus", "2", "r.py", "--out", "x"]
    assert shrunk("deepspeed --master_port 7 r.py", None) == "deepspeed --master_port 7 r.py"
    assert shrunk("python deepspeed_notes.py", None) == "python deepspeed_notes.py"


def test_missing_names_an_absent_program_and_path_but_not_what_the_block_writes(tmp_path):
    """The static check: an unknown program and a renamed script are reported; a path that an
    earlier command of the block writes (``--out``) and a glob are not."""
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "a.py").write_text("")
    block = [
        "python recipes/a.py --out recipes/made",
        "nosuchprogram recipes/made/x recipes/b.py 'recipes/*.py'",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys.modules[__name__], "clone_files", lambda: ("recipes/a.py",))
        got = missing(block, tmp_path, os.environ["PATH"])
    assert got == [[], ["program 'nosuchprogram'", "path 'recipes/b.py'"]]


def test_an_mfu_over_100_written_into_a_runs_metrics_is_found(tmp_path):
    """The written half of the MFU check: a train row with mfu 1.46 (146%) in any run under
    runs/ is reported, 1.0 and a row without mfu are not."""
    run = tmp_path / "runs" / "a" / "b"
    run.mkdir(parents=True)
    rows = [{"kind": "train", "mfu": 1.0}, {"kind": "val"}, {"kind": "train", "mfu": 1.46}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert written_mfu_over_100(tmp_path) == ["MFU over 100% in runs/a/b/metrics.jsonl: 146%"]
    (run / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert written_mfu_over_100(tmp_path) == []


# --- The docs as they are ---------------------------------------------------------------------


def test_every_marker_in_the_docs_parses_and_every_rule_is_used():
    """Each docs-test comment in README.md and docs/*.md is one the reader knows (a skip with
    its reason), and every rule of RULES matches a documented command (a stale rule, left
    behind by a renamed command, fails here)."""
    blocks = all_blocks()
    assert sum(bool(db.commands(b)) for b in blocks) >= 20, "the reader found too few blocks"
    for block in blocks:
        db.parse_marker(block.marker)
    documented = [normalized(c) for b in blocks for c in db.commands(b)]
    unused = [r.pattern for r in RULES if not any(re.search(r.pattern, c) for c in documented)]
    assert not unused, f"rules that match no documented command: {unused}"
    assert {g for r in RULES for g in r.given} <= set(GIVENS)


def listing() -> str:
    """Every block of the pages as the test sees it (``python
    tests/house/test_docs_commands.py``)."""
    lines = []
    for block in all_blocks():
        found = db.commands(block)
        marker = db.parse_marker(block.marker)
        if not found:
            lines.append(f"{block.name}: not commands ({block.info or 'output, figure'})")
        elif marker.skip:
            lines.append(f"{block.name}: skipped: {marker.skip}")
        else:
            for k, command in enumerate(found, start=1):
                rule = rule_for(command)
                if rule and rule.skip:
                    lines.append(
                        f"{block.name}#{k}: skipped: {rule.skip}\n    {db.strip_comment(command)}"
                    )
                else:
                    given = f" (given: {', '.join(rule.given)})" if rule and rule.given else ""
                    lines.append(f"{block.name}#{k}: runs{given}\n    {shrunk(command, rule)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(listing())
