"""The reader of documentation pages (tests/docs_blocks.py) on a made-up page: which code blocks
it finds, which of them are commands and how their lines join, what a docs-test marker says, and
what fails a documented command (a traceback, an exit the docs do not announce, an MFU over
100%). tests/house/test_docs_commands.py runs the real pages' commands through it."""

import pytest

from tests import docs_blocks as db

PAGE = """# A page

Run it:

```
.venv/bin/anneal data prepare --input stdlib \\
    --out data/x        # a comment
# a comment line
PYTHONPATH=. .venv/bin/python bench/b.py --arm "a=1:x # not a comment"
echo '{"a": 1,
  "b": 2}' > f.json
```

It prints:

```
step    1/2 | loss 5.1 | mfu 55.1%
```

<!-- docs-test: skip (a synopsis: RUN is a placeholder) -->
```bash
anneal plot RUN [--dark]
```

<!-- docs-test: expect-exit 1 -->
~~~sh
anneal report runs/x --strict
~~~

    $ anneal plan --gpus 8 --hours 1   # an indented block
    plan: compute-optimal
      steps  5

```python
import anneal
```
"""


def test_the_reader_finds_each_block_its_line_and_its_marker():
    """Fenced blocks (``` and ~~~, any info string) and an indented block, each with the
    1-based line of its first content line and the docs-test comment right before it."""
    blocks = db.extract_blocks(PAGE, "p.md")
    got = [(b.line, b.info, b.marker, b.text.split("\n")[0]) for b in blocks]
    assert got == [
        (6, "", "", ".venv/bin/anneal data prepare --input stdlib \\"),
        (17, "", "", "step    1/2 | loss 5.1 | mfu 55.1%"),
        (22, "bash", "skip (a synopsis: RUN is a placeholder)", "anneal plot RUN [--dark]"),
        (27, "sh", "expect-exit 1", "anneal report runs/x --strict"),
        (30, "", "", "$ anneal plan --gpus 8 --hours 1   # an indented block"),
        (35, "python", "", "import anneal"),
    ]
    assert blocks[0].name == "p.md:6"


def test_commands_are_joined_lines_and_output_blocks_hold_none():
    """Continuations and an open quote join lines, comment lines drop; an output block, a
    python block and the output under a ``$`` prompt are no commands."""
    blocks = db.extract_blocks(PAGE, "p.md")
    assert db.commands(blocks[0]) == [
        ".venv/bin/anneal data prepare --input stdlib \\\n    --out data/x        # a comment",
        'PYTHONPATH=. .venv/bin/python bench/b.py --arm "a=1:x # not a comment"',
        'echo \'{"a": 1,\n  "b": 2}\' > f.json',
    ]
    assert db.commands(blocks[1]) == [] and db.commands(blocks[5]) == []
    assert db.commands(blocks[4]) == ["anneal plan --gpus 8 --hours 1   # an indented block"]
    assert db.strip_comment(db.commands(blocks[0])[1]).endswith('# not a comment"')
    assert db.program(db.commands(blocks[0])[1]) == ".venv/bin/python"


def test_a_marker_says_skip_with_its_reason_or_the_exits_announced():
    """A skip carries its reason; expect-exit its codes; a bare skip or an unknown word is an
    error, so that no block is turned off by a marker that says nothing."""
    assert db.parse_marker("skip (needs 8 GPUs)") == db.Marker(skip="needs 8 GPUs")
    assert db.parse_marker("expect-exit 2") == db.Marker(expect_exit=(2,))
    assert db.parse_marker("expect-exit 1, 2") == db.Marker(expect_exit=(1, 2))
    assert db.parse_marker("") == db.Marker()
    for bad in ("skip", "skip ()", "skip because", "expect-exit", "run"):
        with pytest.raises(ValueError, match="docs-test marker"):
            db.parse_marker(bad)


def test_the_checks_catch_a_traceback_an_unannounced_exit_and_mfu_over_100():
    """What fails a command: a traceback, an exit the docs do not announce, an MFU over 100%
    in any of the formats Anneal prints; 100% itself and an announced exit pass."""
    assert db.problems("ok\n", 0) == []
    trace = "Traceback (most recent call last):\n  File x\nModuleNotFoundError: torch\n"
    assert db.problems(trace, 1) == ["a traceback", "exit 1"]
    assert db.problems("usage: ...\n", 2, (2,)) == []
    assert db.problems("", 2, (1,)) == ["exit 2 (the docs announce [1])"]
    printed = "mfu 55.1% | MFU 146.2% (x) | at MFU 198% of 0.02 TFLOP/s | mfu: 100%"
    assert db.mfu_percentages(printed) == [55.1, 146.2, 198.0, 100.0]
    assert db.problems(printed, 0) == ["MFU over 100%: 146.2%, 198%"]
    assert db.mfu_percentages("mfu_from 3% | 40% of peak") == []
