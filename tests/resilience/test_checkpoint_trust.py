"""No checkpoint file is unpickled outside torch's weights-only loader (issue 27, items 1 and 2).

- The two ways round issue 18's opcode scan (``tests/planted.py``: a dotted name resolved
  through an allowed module, and pickle bytes in front of the zip), planted in a real
  checkpoint whose manifest is rewritten to match, are refused on every path that loads one:
  resume (``checkpoint.load`` after ``verified_resume``, as the trainer does), a guard rewind
  (``Guard.rewind``), a cooldown branch (the tag its ``--cooldown-from`` resolves to, then the
  load) and DeepSpeed's universal converter (run on the planted files directly, without the
  check in front of it). The marker file the payload would touch never appears, and each
  refusal is one paragraph naming the file.
- A checkpoint whose files hold another step than its manifest (a tag renamed over another,
  the manifest's step, tag and tokens edited to agree) is refused once its state is loaded,
  on the branch, ``--resume`` and rewind paths (issue 41), rather than trained from there.
- A resume on another number of ranks writes its universal conversion under the resuming run
  (the source checkpoint, another run's, hashes the same before and after); the conversion has
  a manifest, and a cached file zeroed after it was written is found and the conversion made
  again: the weights loaded are those of the real conversion.
- A fuzz: random pickles from a grammar of opcodes and globals (every module of the allow-list,
  dotted names, builtins, ``os``), each as the ``data.pkl`` of a real checkpoint file or in front
  of it, resumed: no marker ever appears, and every refusal is one paragraph.

One real engine (the tiny recipe's model, ZeRO-3, a world of one) serves every load: about 10 s
for the file, most of it building the engine and one universal conversion (the 2-rank
checkpoint is the session's shared run).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from anneal import rundir
from anneal.errors import UserError
from anneal.resilience import checkpoint, universal
from anneal.resilience.guard import Guard
from anneal.resilience.safeload import safe_globals
from tests import planted
from tests.conftest import SMALL, resolve_tiny, tree

TAG = "step00000002"
MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def engine(world_of_one, tiny_data, tmp_path_factory):
    """A real DeepSpeed engine of the tiny recipe's model (SMALL shapes, ZeRO-3, one rank)."""
    from anneal.train.engine import build_engine

    out = tmp_path_factory.mktemp("engine") / "run"
    launch = resolve_tiny(
        ["--out", str(out), "--data", str(tiny_data), "--max-steps", "4", *SMALL], world_size=1
    )
    return launch, build_engine(launch)


def copy_run(run: Path, dest: Path) -> Path:
    return Path(shutil.copytree(run, dest, symlinks=True))


def one_paragraph(e: UserError, *names: str) -> str:
    msg = str(e)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for name in names:
        assert name in msg, (name, msg)
    return msg


def resume(engine_, tag: Path, ckpt_dir: Path) -> dict:
    """What the trainer does with a ``--resume`` target: verify its hashes, then load it."""
    chosen = checkpoint.verified_resume(tag, fallback=False)
    return checkpoint.load(engine_, chosen, ckpt_dir=ckpt_dir)


@pytest.mark.parametrize("kind", planted.KINDS)
def test_a_planted_checkpoint_is_refused_on_resume_rewind_and_branch(
    kind, engine, tiny_run, tiny_data, tmp_path
):
    launch, eng = engine
    marker = tmp_path / "payload-ran"
    run = copy_run(tiny_run, tmp_path / "run")
    target = run / "checkpoints" / TAG / MODEL_FILE
    planted.plant(target, kind, marker)
    assert checkpoint.verify(target.parent) == []  # only the loader can tell
    before = tree(run)

    with pytest.raises(UserError) as e:  # --resume auto, or PATH into a new run
        resume(eng, target.parent, tmp_path / "new" / "checkpoints")
    one_paragraph(e.value, str(target), "does not fall back", "tampered")

    guard = Guard(launch.cfg.guard, run_dir=tmp_path / "new", resuming=False)
    with pytest.raises(UserError) as e:  # a spike at step 3 rewinds to step 2
        guard.load_before_spike(
            eng, run / "checkpoints", spike_step=3, spike_end=48, samples_per_step=16
        )
    one_paragraph(e.value, str(target))

    parent = _wsd(run)
    args = ["--out", str(tmp_path / "b"), "--data", str(tiny_data), *SMALL]
    args += ["--cooldown-from", str(parent), "--set", "optim.cooldown_tokens=1000"]
    branch = resolve_tiny(args, world_size=1)
    assert branch.resume_from == target.parent
    with pytest.raises(UserError) as e:
        checkpoint.load(eng, branch.resume_from, ckpt_dir=tmp_path / "b" / "checkpoints")
    one_paragraph(e.value, str(target))

    assert not marker.exists()
    del before[str(run / "config.json")]  # _wsd's edit
    after = tree(run)
    del after[str(run / "config.json")]
    assert after == before


def _wsd(run: Path) -> Path:
    """The run's config.json saying WSD, as ``--set optim.schedule=wsd`` would have written it
    (tests/resolution/test_cooldown.py's ``wsd_parent``)."""
    import json

    doc = json.loads((run / "config.json").read_text())
    doc["run"]["optim"]["schedule"] = "wsd"
    doc["ds_config"]["scheduler"]["params"]["cos_min_ratio"] = 0.0
    (run / "config.json").write_text(json.dumps(doc))
    return run


def test_a_checkpoint_whose_files_hold_another_step_is_refused_once_loaded(
    engine, tiny_run, tiny_data, tmp_path
):
    """Issue 41, point 8: a WSD parent whose step00000002 was renamed step00000001 over the
    real one, its manifest's step, tag and tokens edited to agree (the sizes and hashes still
    hold, so it is intact and verifies). A cooldown branch from it resolves to S = 1 and one
    step (train.max_steps 2); on 7ec025f the load gave step 2's state, the loop had nothing to
    train and the run exited 0. Now the load itself refuses, for the branch, for ``--resume``
    of it and for a guard rewind to it: one paragraph naming both steps; the parent unchanged."""
    _, eng = engine
    run = _wsd(copy_run(tiny_run, tmp_path / "run"))
    ckpts = run / "checkpoints"
    tag = ckpts / "step00000001"
    tokens_at_1 = checkpoint.read_manifest(tag)["tokens"]
    shutil.rmtree(tag)
    (ckpts / TAG).rename(tag)
    manifest = json.loads((tag / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["tokens"] != tokens_at_1
    manifest.update(step=1, tag=tag.name, tokens=tokens_at_1)
    (tag / "manifest.json").write_text(json.dumps(manifest))
    (ckpts / "latest").write_text(tag.name)
    assert checkpoint.verify(tag) == []
    before = tree(run)

    args = ["--out", str(tmp_path / "b"), "--data", str(tiny_data), *SMALL]
    args += ["--cooldown-from", str(run), "--set", "optim.cooldown_tokens=500"]
    branch = resolve_tiny(args, world_size=1)
    assert (branch.resume_from, branch.cooldown.step, branch.cfg.train.max_steps) == (tag, 1, 2)
    guard = Guard(branch.cfg.guard, run_dir=tmp_path / "g", resuming=False)
    loads = (
        lambda: resume(eng, branch.resume_from, tmp_path / "b" / "checkpoints"),  # the branch
        lambda: resume(eng, tag, tmp_path / "new" / "checkpoints"),  # --resume PATH
        lambda: guard.load_before_spike(eng, ckpts, spike_step=2, spike_end=32, samples_per_step=8),
    )
    for load in loads:
        with pytest.raises(UserError) as e:
            load()
        one_paragraph(e.value, str(tag), "step 1 there, 2 in the state", f"tokens {tokens_at_1}")
    assert tree(run) == before


@pytest.mark.parametrize("kind", planted.KINDS)
def test_the_universal_converter_loads_weights_only(kind, two_rank_run, tmp_path):
    """DeepSpeed's converter, run by Anneal on planted files (the check before it skipped),
    refuses them in its own loads: its child has torch's weights-only switch on."""
    marker = tmp_path / "payload-ran"
    run = copy_run(two_rank_run["out"], tmp_path / "run")
    tag = run / "checkpoints" / TAG
    planted.plant(tag / MODEL_FILE, kind, marker)
    with pytest.raises(UserError) as e:
        universal.to_universal(tag, tmp_path / "new" / "checkpoints")
    one_paragraph(e.value, str(tag), "weights-only loader refuses")
    assert not marker.exists()


def test_the_conversion_lives_in_the_resuming_run_and_is_verified(engine, two_rank_run, tmp_path):
    _, eng = engine
    source = two_rank_run["out"]
    tag = source / "checkpoints" / TAG
    before = tree(source)
    ckpt_dir = rundir.checkpoints_dir(tmp_path / "new")
    client = checkpoint.load(eng, tag, ckpt_dir=ckpt_dir)
    assert client["step"] == 2
    [made] = [p for p in (ckpt_dir / universal.CACHE).iterdir() if p.is_dir()]
    assert made.name.startswith(f"{TAG}-") and (made / "manifest.json").is_file()
    assert tree(source) == before  # nothing written into another run's checkpoint
    loaded = [p.ds_tensor.detach().clone() for p in eng.module.parameters()]

    # a cached file zeroed after the conversion: found, converted again, the same weights
    fp32 = next(made.glob("zero/*/fp32.pt"))
    state = torch.load(fp32, weights_only=True)  # {"param": tensor, ...} or the tensor
    if isinstance(state, dict):
        state["param"] = torch.zeros_like(state["param"])
    else:
        state = torch.zeros_like(state)
    torch.save(state, fp32)
    assert not universal._reusable(made, universal.source_hash(tag))
    for p in eng.module.parameters():
        p.ds_tensor.data.zero_()
    checkpoint.load(eng, tag, ckpt_dir=ckpt_dir)
    again = [p.ds_tensor.detach().clone() for p in eng.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(loaded, again, strict=True))
    assert universal._reusable(made, universal.source_hash(tag))


# --- the fuzz ------------------------------------------------------------------------------------


def _modules_and_names() -> tuple[list[str], list[str]]:
    """Every module of the allow-list (Anneal's and torch's own), modules a payload wants, and
    names: the allowed ones, dotted walks through a module's attributes, and callables."""
    from torch._weights_only_unpickler import _get_allowed_globals

    allowed = [(g.__module__, g.__qualname__) for g in safe_globals()]
    allowed += [tuple(k.rsplit(".", 1)) for k in _get_allowed_globals()]
    modules = sorted({m for m, _ in allowed})
    modules += ["deepspeed.checkpoint.constants", "os", "posix", "builtins", "__builtin__"]
    modules += ["sys", "subprocess", "__main__", "torch", "numpy", "pickle"]
    names = sorted({n for _, n in allowed})
    names += ["__builtins__.get", "__builtins__.eval", "__builtins__.exec", "eval", "exec"]
    names += ["system", "getattr", "__import__", "modules.get", "os.system", "Popen"]
    names += ["OrderedDict.__init__.__globals__.get", "Tensor.__reduce_ex__", "__class__"]
    return modules, names


class PickleGrammar:
    """Random pickles: pushes (strings, ints, containers, marks), imports of globals by GLOBAL
    and STACK_GLOBAL (names possibly dotted), calls (REDUCE, NEWOBJ, BUILD), container and memo
    operations; often an import-and-call of a payload whose argument would touch the marker."""

    def __init__(self, rng: random.Random, marker: Path):
        self.rng, self.marker = rng, marker
        self.modules, self.names = _modules_and_names()
        self.listed = sorted({g.__module__ for g in safe_globals()})
        self.args = [planted.touch_code(marker), f"touch {marker}", "eval", "os", "system"]

    def text(self) -> bytes:
        return planted.short_str(self.rng.choice(self.args + self.names + self.modules))

    def a_global(self) -> bytes:
        module, name = self.rng.choice(self.modules), self.rng.choice(self.names)
        if self.rng.random() < 0.5:
            return planted.short_str(module) + planted.short_str(name) + b"\x93"  # STACK_GLOBAL
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL

    def call(self) -> bytes:
        """An import, its argument tuple, and a call of it."""
        args = b"".join(self.text() for _ in range(self.rng.randint(0, 2)))
        tup = [b")", b"\x85", b"\x86"][min(len(args) and args.count(b"\x8c"), 2)]
        return self.a_global() + args + tup + self.rng.choice([b"R", b"\x81", b"R"])

    def op(self) -> bytes:
        r = self.rng
        return r.choice(
            [
                self.text(),
                self.a_global(),
                self.call(),
                b"K" + bytes([r.randrange(256)]),  # BININT1
                b"N",
                b"\x88",
                b")",
                b"]",
                b"}",
                b"(",
                b"t",
                b"l",
                b"d",
                b"s",
                b"a",
                b"u",
                b"e",
                b"b",
                b"R",
                b"\x85",
                b"\x86",
                b"0",
                b"2",
                b"\x94",
                b"q" + bytes([r.randrange(4)]),
                b"h" + bytes([r.randrange(4)]),
            ]
        )

    def chain(self) -> bytes:
        """The walk of issue 27: a dotted getter reached through a module of an allow-list
        (this one's, or issue 18's, which admitted all of ``deepspeed.checkpoint.constants``),
        called for ``eval`` or ``exec``, whose result is called on the marker's code."""
        r = self.rng
        module = r.choice(self.listed + ["deepspeed.checkpoint.constants"])
        getter = "__builtins__.get" if r.random() < 0.7 else r.choice(self.names)
        head = planted.short_str(module) + planted.short_str(getter) + b"\x93"
        fn = planted.short_str(r.choice(["eval", "exec"])) + b"\x85R"
        return head + fn + planted.short_str(planted.touch_code(self.marker)) + b"\x85R"

    def pickle(self) -> bytes:
        proto = bytes([0x80, self.rng.choice([2, 3, 4, 5])])
        if self.rng.random() < 1 / 3:  # well formed: the walk, then an empty dict
            return proto + self.chain() + b"0}."
        body = [self.op() for _ in range(self.rng.randint(1, 12))]
        extra = self.chain() if self.rng.random() < 0.4 else self.call()
        body.insert(self.rng.randrange(len(body) + 1), extra)
        return proto + b"".join(body) + b"."


FUZZ_CASES = 300


def test_random_pickles_in_a_real_checkpoint_never_run(engine, tiny_run, tmp_path):
    """FUZZ_CASES pickles (seeded) as the model states' ``data.pkl``, prepended to it, or in
    front of the file: every resume is refused with one paragraph naming the file, and the
    marker never appears."""
    from anneal.resilience.manifest import file_hash

    _, eng = engine
    marker = tmp_path / "payload-ran"
    grammar = PickleGrammar(random.Random(27), marker)
    run = copy_run(tiny_run, tmp_path / "run")
    tag = run / "checkpoints" / TAG
    target = tag / MODEL_FILE
    original = target.read_bytes()
    with __import__("zipfile").ZipFile(target) as z:
        [pkl] = [n for n in z.namelist() if n.endswith("/data.pkl")]
        original_pkl = z.read(pkl)
    where = {"data.pkl": 0, "prepended": 0, "front": 0}
    for case in range(FUZZ_CASES):
        data = grammar.pickle()
        place = ("data.pkl", "prepended", "front")[case % 3]
        target.write_bytes(original)
        if place == "front":
            target.write_bytes(data + original)
        else:
            planted.replace_pickle(target, data + (original_pkl if place == "prepended" else b""))
        planted.rehash(tag)
        assert file_hash(target) != file_hash(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        with pytest.raises(UserError) as e:
            resume(eng, tag, tmp_path / "new" / "checkpoints")
        one_paragraph(e.value, str(target))
        assert not marker.exists(), (case, data)
        where[place] += 1
    assert min(where.values()) >= FUZZ_CASES // 3
