"""Expert settings are checked before anything launches (issue 41, point 7): expert
parallelism (``ds.expert_parallel.autoep_size``) on a dense preset is one paragraph, raised on
every rank by the recipe's own resolution and by ``python -m launcher run`` and ``submit``
before they start anything (on 7ec025f the launch trained: its expert check returned early for
a dense model); and a top-k outside 1..experts in a model document (a run's config.json, as
``anneal estimate --model`` and export read it) names the file and the key. The Hugging Face
side (``--init-from`` a config.json with ``num_experts_per_tok`` 0 or above its experts) is in
tests/hf/test_moe_hf.py. No training: each verdict comes from resolution alone."""

from __future__ import annotations

import pytest

from anneal.errors import UserError
from anneal.model import preset_from_dict
from launcher.__main__ import main as launcher_main
from tests.conftest import refused_tiny

DENSE_EP = "expert_parallel.autoep_size is 2, but the model (tiny) is dense"


def test_expert_parallelism_on_a_dense_preset_is_refused_before_launch(tiny_data, tmp_path, capsys):
    """The tiny recipe (dense) with ``--set ds.expert_parallel.autoep_size=2``: refused on 1
    and 2 ranks by the recipe's resolution, and by ``run`` and ``submit`` (dry runs) with exit
    2 and one line on stderr; no run directory is made."""
    out = tmp_path / "run"
    args = ["--out", str(out), "--data", str(tiny_data)]
    args += ["--set", "ds.expert_parallel.autoep_size=2"]
    for ranks in (1, 2):
        message = refused_tiny(args, world_size=ranks)
        assert DENSE_EP in message and "\n" not in message
    recipe = ["recipes/pretrain_tiny.py", "--device", "cpu", "--dry-run"]
    run = ["run", *recipe, "--num-gpus", "2", "--", *args]
    submit = ["submit", *recipe, "--nodes", "1", "--gpus-per-node", "2", "--partition", "p"]
    submit += ["--time", "01:00:00", "--", *args]
    for argv in (run, submit):
        code = launcher_main(argv)
        printed = capsys.readouterr()
        assert code == 2, printed.out + printed.err
        assert printed.err.startswith("launcher: error: ") and DENSE_EP in printed.err
        assert len(printed.err.strip().splitlines()) == 1 and "Traceback" not in printed.err
        assert "deepspeed" not in printed.out
    assert not out.exists()


RUN_MODEL = {
    "name": "tiny-moe",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "seq_len": 32,
    "vocab_size": 300,
}


@pytest.mark.parametrize("top_k", [0, 9, -1, "2", True])
def test_a_top_k_outside_the_experts_names_the_file_and_key(top_k):
    """A run's ``model.moe.top_k`` of 0, above the 8 experts, negative, a string or a bool:
    one paragraph naming the file and the key; 1 and 8 are read as they stand."""
    moe = {"num_experts": 8, "top_k": top_k, "expert_intermediate_size": 32}
    with pytest.raises(UserError) as caught:
        preset_from_dict({**RUN_MODEL, "moe": moe}, source="r/config.json", prefix="model.")
    message = str(caught.value)
    assert message.startswith(f"r/config.json: model.moe.top_k is {top_k}, but ")
    assert "one of 1..8" in message and "\n" not in message
    for fine in (1, 8):
        doc = {**RUN_MODEL, "moe": {**moe, "top_k": fine}}
        assert preset_from_dict(doc, source="r/config.json").moe.top_k == fine
