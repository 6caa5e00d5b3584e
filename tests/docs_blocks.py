"""The command blocks of a markdown page, and what a documented command's output must not show:
the reader of tests/house/test_docs_commands.py, which runs every command block of README.md and
docs/*.md.

A block is a fenced block (``` or ~~~) whose info string is empty, ``bash``, ``sh``, ``shell``
or ``console``, or an indented code block (four spaces after a blank line). It holds commands
when its first line that is neither blank nor a ``#`` comment starts, after ``VAR=value``
assignments, with a program a reader runs (PROGRAMS, or a path such as ``.venv/bin/anneal``);
otherwise it is output, a figure or a formula, and is not run. In a block with ``$ `` prompts,
only the prompted lines are commands (the rest is what they print). A command is one line with
its backslash continuations and any quote left open joined to it; ``#`` comment lines are
dropped.

An HTML comment on the line right before a block (before its fence, or its first indented line)
tells the test what the docs already say in words:

- ``<!-- docs-test: skip (REASON) -->``: the block is not run (a synopsis with placeholders, a
  clone, a download); the reason is required and the test reports it.
- ``<!-- docs-test: expect-exit N -->``: its commands may exit N, as the docs announce.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

COMMAND_INFOS = {"", "bash", "sh", "shell", "console"}
# Programs whose name starts a command line (a path such as .venv/bin/x or ./x counts too).
PROGRAMS = {"anneal", "bash", "cd", "deepspeed", "echo", "git", "make", "pip", "python", "sh"}
PROGRAMS |= {"python3", "python3.10", "python3.11", "python3.12", "sbatch", "srun"}

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^`\s]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
# "mfu 55.1%", "MFU 40.0%", "at MFU 40%", "mfu: 146%": the number right after the word.
_MFU = re.compile(r"\bmfu\b[^0-9%\n]{0,12}?(\d+(?:\.\d+)?)\s*%", re.IGNORECASE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
    """One code block of a page: ``line`` is the 1-based line of its first content line."""

    path: str
    line: int
    info: str
    text: str
    marker: str = ""

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Marker:
    """What a ``docs-test:`` comment says: skip (with its reason) or the exits announced."""

    skip: str = ""
    expect_exit: tuple[int, ...] = ()


def extract_blocks(markdown: str, path: str) -> list[Block]:
    """Every fenced and indented code block of ``markdown``, in order, with its marker."""
    lines = markdown.split("\n")
    blocks: list[Block] = []
    i, previous_blank = 0, True
    while i < len(lines):
        line = lines[i]
        marker = _marker_before(lines, i)
        fence = _FENCE.match(line)
        if fence:
            close = re.compile(rf"^ {{0,3}}{fence.group(2)[0]}{{{len(fence.group(2))},}}\s*$")
            j = i + 1
            while j < len(lines) and not close.match(lines[j]):
                j += 1
            body = "\n".join(lines[i + 1 : j])
            blocks.append(
                Block(path=path, line=i + 2, info=fence.group(3), text=body, marker=marker)
            )
            i, previous_blank = j + 1, False
            continue
        if previous_blank and line.startswith("    ") and line.strip():
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            body = "\n".join(x[4:] for x in lines[i:j]).rstrip("\n")
            blocks.append(Block(path=path, line=i + 1, info="", text=body, marker=marker))
            i, previous_blank = j, True
            continue
        previous_blank = not line.strip() or bool(_MARKER.match(line))
        i += 1
    return blocks


def _marker_before(lines: list[str], i: int) -> str:
    if i > 0 and (m := _MARKER.match(lines[i - 1])):
        return m.group(1)
    return ""


def parse_marker(text: str) -> Marker:
    """``skip (REASON)`` or ``expect-exit N[,M]``; anything else, or a skip without its reason,
    is a ValueError (a marker that says nothing must not quietly turn a block off)."""
    if not text:
        return Marker()
    if m := re.fullmatch(r"skip\s*\((.*\S.*)\)", text):
        return Marker(skip=m.group(1).strip())
    if m := re.fullmatch(r"expect-exit\s+(\d+(?:\s*,\s*\d+)*)", text):
        return Marker(expect_exit=tuple(int(x) for x in m.group(1).split(",")))
    raise ValueError(
        f"docs-test marker {text!r}: expected 'skip (REASON)' or 'expect-exit N' (a skip "
        "needs its reason in parentheses)"
    )


def commands(block: Block) -> list[str]:
    """The commands of ``block`` (see the module's docstring); [] for a block that is not
    commands."""
    if block.info.lower() not in COMMAND_INFOS:
        return []
    raw = block.text.split("\n")
    if any(line.startswith("$ ") for line in raw):
        prompted, taking = [], False
        for line in raw:
            if line.startswith("$ "):
                prompted.append(line[2:])
                taking = line.rstrip().endswith("\\")
            elif taking:
                prompted.append(line)
                taking = line.rstrip().endswith("\\")
        raw = prompted
    joined = _logical_lines(raw)
    if not joined or not looks_like_command(joined[0]):
        return []
    return joined


def _logical_lines(raw: list[str]) -> list[str]:
    out: list[str] = []
    pending = ""
    for line in raw:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending = f"{pending}\n{line}" if pending else line
        if pending.rstrip().endswith("\\") or _open_quote(pending):
            continue
        out.append(pending)
        pending = ""
    if pending:
        out.append(pending)
    return out


def _open_quote(text: str) -> bool:
    try:
        shlex.split(strip_comment(text))
    except ValueError:
        return True
    return False


def strip_comment(command: str) -> str:
    """``command`` without a trailing ``# comment`` (a ``#`` that starts a word outside
    quotes), and without trailing blanks."""
    quote, escaped = "", False
    for k, ch in enumerate(command):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or command[k - 1].isspace()):
            return command[:k].rstrip()
    return command.rstrip()


def words(command: str) -> list[str]:
    """The shell words of one command, its comment and line continuations removed."""
    return shlex.split(strip_comment(command).replace("\\\n", " "))


def program(command: str) -> str:
    """The program a command starts: its first word after ``VAR=value`` assignments."""
    for word in words(command):
        if not _ASSIGNMENT.match(word):
            return word
    return ""


def looks_like_command(line: str) -> bool:
    try:
        name = program(line)
    except ValueError:
        return False
    return name in PROGRAMS or name.startswith(("./", ".venv/")) or "/bin/" in name


def mfu_percentages(text: str) -> list[float]:
    """Every MFU percentage printed in ``text``."""
    return [float(m.group(1)) for m in _MFU.finditer(text)]


def problems(output: str, code: int, expected_exits: tuple[int, ...] = ()) -> list[str]:
    """What fails a documented command: a traceback in its output, an exit other than 0 or
    one the docs announce, a printed MFU over 100%."""
    found = []
    if "Traceback (most recent call last)" in output:
        found.append("a traceback")
    if code != 0 and code not in expected_exits:
        announced = f" (the docs announce {list(expected_exits)})" if expected_exits else ""
        found.append(f"exit {code}{announced}")
    over = [p for p in mfu_percentages(output) if p > 100]
    if over:
        found.append(f"MFU over 100%: {', '.join(f'{p:g}%' for p in over)}")
    return found
