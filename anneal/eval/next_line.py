"""The task Anneal ships, ``anneal_next_line``: given the preceding lines of a function from the
run's val split, choose its true next line among four (chance 25%).

Built from the VAL split only of a prepared directory (its shards and tokenizer; never train),
deterministically: the same val split gives the same bytes, in any directory, in any process.
Each item is one Python function (``def`` or ``async def``, its extent by indentation) of a val
document: the context is its lines from the ``def`` up to a target line at most
``MAX_CONTEXT_LINES`` below it; the choices are that line and three distractors, code lines of
*other* val documents chosen among those nearest in length to it (so length alone does not
give the answer away), re-indented like it, none equal to it, to each other, or to any line of
its own document. Targets and distractors are code lines of ``MIN_CHARS`` to ``MAX_CHARS``
characters (no blank line, none with a ``#``, none in a docstring); the answer's position is
drawn per item.
``ITEMS`` items at most (one per function, functions in a seeded order); fewer when the split
holds fewer functions, and a split with fewer than ``MIN_ITEMS`` is refused.

Files, under the caller's ``work_dir`` (e.g. ``RUN/evals/tasks/``), each written atomically:
``anneal_next_line.jsonl`` (``context``, ``choices``, ``label``, ``source``, ``document``,
``line``), then ``anneal_next_line.yaml`` (an lm-eval task: multiple choice, 0-shot by default,
``acc`` and ``acc_norm``; its ``data_files`` is relative to it, and ``task_config`` makes it
absolute). The YAML's metadata records ``source_sha256`` (of the val split's entry in
meta.json, which holds each shard's sha256, of the tokenizer's hashes and of the builder's
version and settings) and the JSONL's sha256. Every build builds both again and compares them
byte for byte with the files there: equal files are kept (not rewritten), others are replaced
(said in a warning), so a file planted or edited under a run directory is never loaded (the
config handed to lm-eval is the one built in memory). Ranks that build at once write the same
bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from pathlib import Path

import numpy as np
import yaml

from anneal.data import tokenizer
from anneal.data.prepare_config import PrepareConfig
from anneal.data.prepared_dir import PreparedDir, prepare_again
from anneal.errors import UserError
from anneal.files import make_dir, read_regular, write_atomic

NAME = "anneal_next_line"
BUILDER_VERSION = 1
"""Bumped whenever the builder would write other bytes from the same val split."""
ITEMS = 200
"""Items at most: 800 requests of about 60 tokens each, a few seconds of forward passes for
the tiny preset on 2 CPU cores (the demo scores it at the start and the end of training)."""
MIN_ITEMS = 20
CHOICES = 4
MIN_CHARS = 12
MAX_CHARS = 100
MAX_CONTEXT_LINES = 8
MAX_CONTEXT_CHARS = 600
NEAREST = 24
"""Distractors are drawn among this many candidate lines nearest in length to the answer."""
SEED = 20261203

log = logging.getLogger(__name__)

_DEF = re.compile(r"^(\s*)(async\s+)?def\s")


def build(data_dir: Path, work_dir: Path, *, items: int = ITEMS) -> Path:
    """The task's YAML under ``work_dir``, built from ``data_dir``'s val split (``_write``)."""
    return _write(data_dir, work_dir, items=items)[0]


def task_config(data_dir: Path, work_dir: Path) -> dict:
    """The task's config as lm-eval's ``TaskManager.load`` takes it (a dict), from the YAML
    text built in memory (never read back from ``work_dir``), its data file made absolute (the
    YAML names it relative to itself, so that the bytes do not depend on where they lie)."""
    yaml_path, text = _write(data_dir, work_dir, items=ITEMS)
    cfg = yaml.safe_load(text)
    files = cfg["dataset_kwargs"]["data_files"]
    cfg["dataset_kwargs"]["data_files"] = {
        split: str(yaml_path.parent / name) for split, name in files.items()
    }
    return cfg


def _write(data_dir: Path, work_dir: Path, *, items: int) -> tuple[Path, str]:
    """(the YAML's path, its text): both files built every time (about 0.1 s); a file already
    there is kept only when it holds exactly the bytes built now, and any other (edited,
    planted, of other data) is replaced with a warning, so nothing under a run directory is
    loaded as it stands (lm-eval renders a YAML's templates)."""
    prepared = PreparedDir.of(data_dir)
    meta = prepared.meta(splits=("val",))
    source = _source_sha256(prepared, meta, items)
    work_dir = Path(work_dir)
    yaml_path, data_path = work_dir / f"{NAME}.yaml", work_dir / f"{NAME}.jsonl"
    docs = val_documents(prepared, meta)
    rows = make_items(docs, items=items)
    if len(rows) < MIN_ITEMS:
        fraction = meta.get("val_fraction", PrepareConfig.val_fraction)
        raise UserError(too_few_functions(prepared.path, len(rows), len(docs), fraction))
    data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    text = task_yaml(source, hashlib.sha256(data.encode()).hexdigest(), rows)
    make_dir(work_dir, flag="work_dir")
    for path, want in ((data_path, data), (yaml_path, text)):  # the data first, then its YAML
        if not _holds(path, want.encode()):
            if path.exists() or path.is_symlink():
                log.warning(
                    "%s differs from what Anneal builds from %s's val split (edited, or built "
                    "from other data): replaced",
                    path,
                    prepared.path,
                )
            write_atomic(path, want)
    return yaml_path, text


def _holds(path: Path, want: bytes) -> bool:
    """True when ``path`` is a regular file (not a link, a FIFO or a directory) of exactly the
    bytes ``want``: ``files.read_regular`` reads no more than that many, so nothing hangs or
    fills memory."""
    try:
        return read_regular(path, limit=len(want)) == want
    except (OSError, ValueError):
        return False


def task_yaml(source_sha256: str, data_sha256: str, rows: list[dict]) -> str:
    config = {
        "task": NAME,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": f"{NAME}.jsonl"}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": "",
        "metadata": {
            "version": BUILDER_VERSION,
            "items": len(rows),
            "source_sha256": source_sha256,
            "data_sha256": data_sha256,
        },
    }
    head = "# anneal_next_line: built by anneal.eval.next_line from a prepared val split.\n"
    return head + yaml.safe_dump(config, sort_keys=False)


def _source_sha256(prepared: PreparedDir, meta: dict, items: int) -> str:
    what = {
        "val": meta["splits"]["val"],
        "tokenizer": prepared.tokenizer_records(meta),
        "eos_id": meta["eos_id"],
        "dtype": meta["dtype"],
        "builder": [BUILDER_VERSION, items, CHOICES, MIN_CHARS, MAX_CHARS, SEED],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


# --- The val split's documents --------------------------------------------------------------


def too_few_functions(path: Path, found: int, documents: int, val_fraction: float) -> str:
    """Why the task cannot be built from a val split of ``documents`` documents (prepared with
    ``val_fraction``) that holds ``found`` usable functions, and the fix: a larger share held
    out where the data holds Python code (in proportion to what was found, and half again; at
    least 0.1 or twice the share where none was), a task of one's own where it holds none
    (prose: a larger share would not help)."""
    if found:
        more = min(0.5, val_fraction * 1.5 * MIN_ITEMS / found)
    else:
        more = min(0.5, max(0.1, 2 * val_fraction))
    return (
        f"{path}: its val split ({documents} documents, prepared with --val-fraction "
        f"{val_fraction:g}) holds {found} Python functions usable for {NAME} (at least "
        f"{MIN_ITEMS} are needed): the task is built from the val split's Python code. Where the "
        f"data holds Python code, prepare it again with a larger share held out for validation "
        f"(`anneal data prepare ... --val-fraction {more:.2g}`; the default is "
        f"{PrepareConfig.val_fraction:g}); where it holds none (prose, another language), score "
        f"a task of your own on it instead (a local YAML over a JSONL file: docs/evaluation.md, "
        f'"Offline").'
    )


def val_documents(prepared: PreparedDir, meta: dict) -> list[tuple[int, int, str]]:
    """(source, document, text) of every val document, decoded from its ids (documents end at
    ``eos_id``); each shard's bytes checked against the sha256 meta.json records."""
    tok = tokenizer.load(prepared.path)
    by_source: dict[int, list[np.ndarray]] = {}
    for shard in meta["splits"]["val"]["shards"]:
        path = prepared.shard_path("val", shard)
        raw = path.read_bytes()
        if "sha256" in shard and hashlib.sha256(raw).hexdigest() != shard["sha256"]:
            raise UserError(
                f"{path}: its bytes differ from the sha256 that meta.json records: the shard is "
                f"damaged. {prepare_again(prepared.path)}"
            )
        by_source.setdefault(shard.get("source", 0), []).append(np.frombuffer(raw, meta["dtype"]))
    docs = []
    for source, arrays in sorted(by_source.items()):
        ids = np.concatenate(arrays)
        for k, doc in enumerate(np.split(ids, np.flatnonzero(ids == meta["eos_id"]) + 1)):
            if doc.size and doc[doc != meta["eos_id"]].size:
                docs.append((source, k, tok.decode(doc[doc != meta["eos_id"]].tolist())))
    return docs


# --- Items ------------------------------------------------------------------------------------


def code_lines(lines: list[str]) -> list[bool]:
    """Per line: is it a code line that may be an answer or a distractor (``MIN_CHARS`` to
    ``MAX_CHARS`` characters stripped, no ``#``: no comment, which the code before cannot
    predict; not in or at a triple-quoted string)."""
    out, in_string = [], False
    for line in lines:
        quotes = line.count('"""') + line.count("'''")
        text = line.strip()
        ok = not in_string and quotes == 0 and MIN_CHARS <= len(text) <= MAX_CHARS
        out.append(ok and "#" not in text)
        in_string ^= quotes % 2 == 1
    return out


def functions(lines: list[str]) -> list[tuple[int, int]]:
    """(def line, end) of every function of a document: from its ``def`` to the first later
    non-blank line indented no deeper than it (end excluded)."""
    out = []
    for i, line in enumerate(lines):
        if not (m := _DEF.match(line)):
            continue
        depth, end = len(m.group(1)), i + 1
        while end < len(lines):
            nxt = lines[end]
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= depth:
                break
            end += 1
        out.append((i, end))
    return out


def make_items(docs: list[tuple[int, int, str]], *, items: int = ITEMS) -> list[dict]:
    """The task's rows from ``docs`` (``val_documents``): deterministic in its input."""
    rng = random.Random(SEED)
    parsed = [(source, k, text.split("\n")) for source, k, text in docs]
    pool: list[tuple[int, str]] = []  # (document position, stripped code line), by length
    candidates = []  # (document position, def line, target line)
    for pos, (_, _, lines) in enumerate(parsed):
        usable = code_lines(lines)
        pool += [(pos, lines[i].strip()) for i in range(len(lines)) if usable[i]]
        for start, end in functions(lines):
            last = min(end, start + MAX_CONTEXT_LINES + 1)
            targets = [t for t in range(start + 1, last) if usable[t]]
            targets = [t for t in targets if len("\n".join(lines[start:t])) < MAX_CONTEXT_CHARS]
            if targets:
                candidates.append((pos, start, rng.choice(targets)))
    pool = sorted(set(pool), key=lambda p: (len(p[1]), p[1], p[0]))
    lengths = np.array([len(text) for _, text in pool])
    rng.shuffle(candidates)
    rows = []
    for pos, start, target in candidates:
        if len(rows) == items:
            break
        source, k, lines = parsed[pos]
        distractors = _distractors(pool, lengths, pos, lines, lines[target].strip(), rng)
        if distractors is None:
            continue
        indent = lines[target][: len(lines[target]) - len(lines[target].lstrip())]
        choices = [lines[target], *(indent + d for d in distractors)]
        label = rng.randrange(CHOICES)
        choices[0], choices[label] = choices[label], choices[0]
        context = "".join(line + "\n" for line in lines[start:target])
        row = {"context": context, "choices": choices, "label": label}
        rows.append({**row, "source": source, "document": k, "line": target + 1})
    return rows


def _distractors(pool, lengths, pos, lines, answer, rng) -> list[str] | None:
    """Three code lines of other documents, nearest in length to ``answer``, distinct, none a
    line of the answer's own document; None when there are not enough."""
    own = {line.strip() for line in lines}
    at = int(np.searchsorted(lengths, len(answer)))
    lo, hi, near = at, at, []
    while len(near) < NEAREST and (lo > 0 or hi < len(pool)):
        below = len(answer) - lengths[lo - 1] if lo > 0 else None
        above = lengths[hi] - len(answer) if hi < len(pool) else None
        if above is None or (below is not None and below <= above):
            lo -= 1
            pick = pool[lo]
        else:
            pick = pool[hi]
            hi += 1
        if pick[0] != pos and pick[1] not in own and pick[1] not in near:
            near.append(pick[1])
    if len(near) < CHOICES - 1:
        return None
    return rng.sample(near, CHOICES - 1)
