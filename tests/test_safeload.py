"""The pickle scan refuses a checkpoint file that would run code, from its opcodes alone.

A ``__reduce__`` payload is refused at every pickle protocol and nothing of it runs; a
``STACK_GLOBAL`` whose names are hidden behind the memo, or behind pushes that are popped
again, is resolved to the names it would really import; what torch.save writes for tensors,
numpy arrays, RNG states and DeepSpeed's own types passes, and ``safe_globals`` lets
``torch.load(weights_only=True)`` read it.
"""

from __future__ import annotations

import collections
import os
import pickle
import random
import zipfile

import numpy as np
import pytest
import torch

from anneal.errors import UserError
from anneal.resilience.safeload import pickle_globals, safe_globals, scan_checkpoint, scan_file


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(path, obj):
    torch.save(obj, path)


def test_payload_is_refused_at_every_protocol_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        f = tmp_path / f"p{proto}.pt"
        torch.save({"w": torch.ones(2), "x": Payload(marker)}, f, pickle_protocol=proto)
        with pytest.raises(UserError) as e:
            scan_file(f)
        msg = str(e.value)
        assert str(f) in msg and "system" in msg and "trust" in msg
    assert not marker.exists()


def test_stack_global_names_hidden_by_pops_and_memo_are_found():
    # push 'os' 'system' 'torch' 'Size', POP POP, STACK_GLOBAL: imports os.system
    popped = b"\x80\x04\x8c\x02os\x8c\x06system\x8c\x05torch\x8c\x04Size00\x93\x8c\x02hi\x85R."
    assert pickle_globals(popped) == [("os", "system")]
    # names stored in the memo and fetched back
    memo = b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94\x8c\x01x0h\x00h\x01\x93\x8c\x02hi\x85R."
    assert pickle_globals(memo) == [("os", "system")]
    # names that are not plain strings cannot be told, and are refused as such
    assert pickle_globals(b"\x80\x04K\x01K\x02\x93.") == [("?", "?")]


def test_what_checkpoints_hold_passes_and_loads_weights_only(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    state = {
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
    tag = tmp_path / "step00000001"
    tag.mkdir()
    torch.save(state, tag / "mp_rank_00_model_states.pt")
    scan_checkpoint(tag)
    with torch.serialization.safe_globals(safe_globals()):
        back = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    assert torch.equal(back["module"]["w"], state["module"]["w"])
    assert back["stage"] == ZeroStageEnum.weights


def test_not_a_torch_zip_or_a_torn_pickle_is_refused(tmp_path):
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(UserError, match="not a torch checkpoint"):
        scan_file(raw)
    torn = tmp_path / "torn.pt"
    with zipfile.ZipFile(torn, "w") as z:
        z.writestr("torn/data.pkl", pickle.dumps({"a": [1, 2, 3]}, protocol=2)[:-5])
    with pytest.raises(UserError, match="not a whole pickle"):
        scan_file(torn)
