"""Every checkpoint file is read by torch's weights-only loader (``anneal.resilience.safeload``).

- A ``__reduce__`` payload is refused at every pickle protocol, and so are the two walks round
  issue 18's opcode scan (a dotted name through an allowed module; pickle bytes in front of the
  zip, refused before torch sees the file): none runs, each refusal names the file.
- The allow-list is exact: classes and functions named by module and qualified name, no
  module; a dotted name through the module of any of them is refused.
- What torch.save writes for Anneal's checkpoints (tensors, numpy arrays, RNG states,
  DeepSpeed's own types) loads.
- Inside ``loading()``, a ``torch.load(weights_only=False)`` of DeepSpeed's is weights-only too;
  a nested load keeps the allow-list of the outer one; the switch is put back after.
- DeepSpeed's checkpoint engine, once ``install``-ed, loads through the same loader.
"""

from __future__ import annotations

import collections
import os
import pickle
import random
import types

import numpy as np
import pytest
import torch

from anneal.errors import UserError
from anneal.resilience import safeload
from tests import planted


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def checkpoint_state() -> dict:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return {
        "module": collections.OrderedDict(w=torch.nn.Parameter(torch.randn(3, 2))),
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        },
        "arr": np.arange(5, dtype=np.uint32),
        "stage": ZeroStageEnum.weights,
        "scaler": LossScaler(1.0),
        "bf": torch.ones(2, dtype=torch.bfloat16),
    }


def test_payload_is_refused_at_every_protocol_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        f = tmp_path / f"p{proto}.pt"
        torch.save({"w": torch.ones(2), "x": Payload(marker)}, f, pickle_protocol=proto)
        with pytest.raises(UserError) as e:
            safeload.load(f)
        msg = str(e.value)
        assert str(f) in msg and "weights-only" in msg and "\n" not in msg
        # protocols 4 and 5 stop at their first FRAME, which torch's unpickler does not run
        assert ("system" if proto < 4 else "opcode 149 (FRAME)") in msg
    assert not marker.exists()


@pytest.mark.parametrize("kind", planted.KINDS)
def test_the_walks_round_the_old_scan_are_refused(kind, tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "tag").mkdir()
    f = tmp_path / "tag" / "mp_rank_00_model_states.pt"
    torch.save(checkpoint_state(), f)
    (tmp_path / "tag" / "manifest.json").write_text('{"step": 1, "files": {}}')
    planted.plant(f, kind, marker)
    with pytest.raises(UserError) as e:
        safeload.load(f)
    want = "not a zip header" if kind == "front" else "opcode 140 (SHORT_BINUNICODE)"
    assert str(f) in str(e.value) and want in str(e.value)
    with pytest.raises(UserError):
        safeload.check_checkpoint(tmp_path / "tag")
    assert not marker.exists()


def test_an_archive_after_other_bytes_or_no_archive_is_refused_before_torch(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"a": torch.ones(1)}, good)
    for name, data, why in [
        ("prefixed.pt", b"PK\x03\x04" + good.read_bytes(), "does not begin at byte 0"),
        ("raw.pt", pickle.dumps({"a": 1}), "not a zip header"),
        ("empty.pt", b"", "not a zip header"),
        ("cut.pt", good.read_bytes()[:100], "not a zip file"),
    ]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserError, match="not a torch checkpoint") as e:
            safeload.load(tmp_path / name)
        assert why in str(e.value), (name, str(e.value))


def test_the_allow_list_is_exact_and_dotted_names_are_refused(tmp_path):
    marker = tmp_path / "ran"
    listed = safeload.safe_globals()
    assert all(isinstance(g, (type, types.FunctionType, types.BuiltinFunctionType)) for g in listed)
    for g in listed:
        for walk in ("__builtins__.get", f"{g.__qualname__}.__init__.__globals__.get"):
            data = (
                b"\x80\x04"
                + planted.short_str(g.__module__)
                + planted.short_str(walk)
                + b"\x93"
                + planted.short_str("eval")
                + b"\x85R"
                + planted.short_str(planted.touch_code(marker))
                + b"\x85R."
            )
            f = tmp_path / "walk.pt"
            torch.save({}, f)
            planted.replace_pickle(f, data)
            with pytest.raises(UserError, match="weights-only loader refuses"):
                safeload.load(f)
    assert not marker.exists()


def test_what_checkpoints_hold_loads(tmp_path):
    from deepspeed.runtime.zero.config import ZeroStageEnum

    state = checkpoint_state()
    tag = tmp_path / "step00000001"
    tag.mkdir()
    torch.save(state, tag / "mp_rank_00_model_states.pt")
    safeload.check_checkpoint(tag)
    back = safeload.load(tag / "mp_rank_00_model_states.pt")
    assert torch.equal(back["module"]["w"], state["module"]["w"])
    assert back["stage"] == ZeroStageEnum.weights
    assert back["rng"]["python"] == state["rng"]["python"]
    assert np.array_equal(back["rng"]["numpy"][1], state["rng"]["numpy"][1])
    torch.save({"no module": 1}, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(UserError, match="without 'module'"):
        safeload.check_checkpoint(tag)


def test_loading_forces_weights_only_and_keeps_nested_allow_lists(tmp_path, monkeypatch):
    monkeypatch.delenv(safeload.FORCE_WEIGHTS_ONLY, raising=False)
    marker = tmp_path / "ran"
    evil, good = tmp_path / "evil.pt", tmp_path / "good.pt"
    torch.save({"x": Payload(marker)}, evil)
    torch.save(checkpoint_state(), good)
    with safeload.loading():
        with pytest.raises(pickle.UnpicklingError):
            torch.load(evil, weights_only=False)  # as DeepSpeed's universal load calls it
        safeload.load(good)  # a nested allow-list, removed on leaving ...
        back = torch.load(good, weights_only=False)  # ... leaves the outer one whole
        assert back["stage"] is not None
    assert safeload.FORCE_WEIGHTS_ONLY not in os.environ
    assert not marker.exists()


def test_the_installed_checkpoint_engine_loads_through_the_same_loader(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    torch.save({"x": Payload(marker)}, evil)
    engine = types.SimpleNamespace(checkpoint_engine=None, _config=None)
    safeload.install(engine)
    with pytest.raises(UserError, match="weights-only loader refuses"):
        engine.checkpoint_engine.load(str(evil), map_location="cpu")
    assert not marker.exists()
