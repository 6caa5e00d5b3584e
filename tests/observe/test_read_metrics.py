"""`anneal.observe.metrics.read_metrics`, the one reader of metrics.jsonl (the planner, the fitter,
the scaling sweep, the demo and the tests all go through it).

Proves that it returns the rows in order, filtered by kind; that a torn last line, as a killed
run leaves it, is skipped while a damaged line anywhere else is a UserError naming the file and
line; that a missing file is a UserError saying what to give instead; and that it reads back
exactly what MetricsLogger writes, non-finite values included.
"""

from __future__ import annotations

import json
import math

import pytest

from anneal.errors import UserError
from anneal.observe.metrics import MetricsLogger, read_metrics

ROWS = [
    {"kind": "train", "step": 1, "tokens": 512, "loss": 9.0},
    {"kind": "val", "step": 1, "val_loss": 8.5},
    {"kind": "event", "step": 1, "event": "checkpoint"},
    {"kind": "train", "step": 2, "tokens": 1024, "loss": 8.0},
]


def write(run_dir, text: str) -> None:
    (run_dir / "metrics.jsonl").write_text(text)


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_rows_in_order_and_by_kind(tmp_path):
    write(tmp_path, jsonl(ROWS) + "\n")  # a blank line is not a row
    assert read_metrics(tmp_path) == ROWS
    assert read_metrics(str(tmp_path), "train") == [ROWS[0], ROWS[3]]
    assert read_metrics(tmp_path, "val") == [ROWS[1]]
    assert read_metrics(tmp_path, "spike") == []


def test_a_torn_last_line_is_skipped(tmp_path, caplog):
    write(tmp_path, jsonl(ROWS) + '{"kind": "train", "step": 3, "tok')
    assert read_metrics(tmp_path) == ROWS
    assert "torn last line 5" in caplog.text


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (jsonl(ROWS[:2]) + '{"kind": "train", "st\n' + jsonl(ROWS[2:]), 3),  # in the middle
        (jsonl(ROWS) + '{"kind": "train", "st\n', 5),  # a whole bad line, newline and all
        (jsonl(ROWS[:1]) + "[1, 2]\n", 2),  # JSON, but not an object
    ],
    ids=["middle", "last-with-newline", "not-an-object"],
)
def test_a_damaged_line_is_a_user_error_naming_file_and_line(tmp_path, text, line):
    write(tmp_path, text)
    with pytest.raises(UserError, match=rf"metrics\.jsonl, line {line}: not a JSON object"):
        read_metrics(tmp_path)


def test_a_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"metrics\.jsonl: cannot read it .*run that has trained"):
        read_metrics(tmp_path / "nonesuch")


def test_reads_back_what_the_logger_writes(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.write({"kind": "train", "step": 1, "loss": math.inf, "lr": 1e-3})
    logger.event(1, "spike", loss=12.5)
    logger.close()
    assert read_metrics(tmp_path) == [
        {"kind": "train", "step": 1, "loss": None, "lr": 1e-3, "nonfinite": ["loss"]},
        {"kind": "event", "step": 1, "event": "spike", "loss": 12.5},
    ]
