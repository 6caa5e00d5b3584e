"""bench_prepare's record: each part says which run it came from, and ``--only`` keeps the other.

Before, a ``--only throughput`` run rewrote bench/results/prepare.json whole and dropped the
memory run it had not repeated.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_prepare  # noqa: E402
import prepare_record  # noqa: E402

from anneal.data import tokenizer as toklib  # noqa: E402


def _part(command, **figures):
    return {"command": command, "date": "2026-11-30T10:00:00Z", **figures}


def test_a_run_replaces_its_own_part_and_keeps_the_other_that_names_its_run():
    old = {"throughput": _part("earlier --only throughput", rows=[1]), "memory": _part("a", mb=9)}
    record, dropped = prepare_record.merge_record(old, {"memory": _part("now", mb=1)})
    assert record == {"throughput": old["throughput"], "memory": _part("now", mb=1)}
    assert dropped == []

    both = {"throughput": _part("now", rows=[2]), "memory": _part("now", mb=2)}
    assert prepare_record.merge_record(old, both) == (both, [])
    assert prepare_record.merge_record(None, {"memory": _part("now")}) == (
        {"memory": _part("now")},
        [],
    )


def test_parts_that_do_not_say_which_run_they_came_from_are_dropped_and_named():
    # The layout before parts carried their own command and date: one command for the file.
    old = {"machine": {}, "input_mb": 24.0, "throughput": [{"workers": 1}], "memory": {"mb": 9}}
    record, dropped = prepare_record.merge_record(old, {"throughput": _part("now", rows=[])})
    assert record == {"throughput": _part("now", rows=[])}
    assert dropped == ["memory", "input_mb", "machine"]


def test_the_recorded_command_leaves_out_where_the_report_went():
    cmd = prepare_record.recorded_command
    assert cmd(["--mb", "24", "--report", "/tmp/x.md", "--workers", "2"]) == (
        "bench/bench_prepare.py --mb 24 --workers 2"
    )
    assert cmd(["--report=/tmp/x.md", "--only", "memory"]) == "bench/bench_prepare.py --only memory"
    assert cmd([]) == "bench/bench_prepare.py"


def test_only_memory_keeps_the_recorded_throughput_part(tmp_path):
    work = tmp_path / "work"
    (work / "tok").mkdir(parents=True)
    # A small tokenizer where the script looks for one, so that it does not train its own.
    texts = bench_prepare.stdlib_texts()[:60]
    toklib.train_sentencepiece(texts, vocab_size=512, out_path=work / "tok" / "tokenizer.model")
    record = tmp_path / "prepare.json"
    kept = _part("bench/bench_prepare.py --only throughput", input_mb=24.0, rows=[{"x": 1}])
    record.write_text(json.dumps({"throughput": kept, "memory": _part("old", mb=1.0)}))
    frag = tmp_path / "frag.md"
    args = ["--only", "memory", "--memory-cap-mb", "0.5", "--mb", "0.1", "--workdir", str(work)]
    args += ["--json", str(record), "--report", str(frag)]
    proc = subprocess.run(
        [sys.executable, "bench/bench_prepare.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    out = json.loads(record.read_text())
    assert out["throughput"] == kept
    memory = out["memory"]
    assert memory["command"] == " ".join(["bench/bench_prepare.py", *args[:-2]])  # no --report
    assert memory["date"] != "2026-11-30T10:00:00Z" and memory["machine"]["cores"] >= 1
    assert 5.0 < memory["mb"] < 5.5 and memory["cap_mib"] == 0.5 and memory["tokens"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frag.md", "prepare.json", "work"]

    md = frag.read_text()
    assert memory["command"] in md and "Memory: 5 MB of JSON Lines (10.0x a 0.5 MiB cap)" in md
    assert "encode alone" not in md  # the fragment shows this run's part only
