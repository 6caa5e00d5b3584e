"""DeepSpeed's checkpoint files as ``anneal.resilience.ds_files`` reads their names: the ranks
that wrote a file, the ZeRO stage the names say, the files that hold the weights in rank order,
AutoEP's expert files, the key each file holds, and the universal load's twin names."""

from pathlib import Path

import pytest

from anneal.resilience import ds_files


def test_a_name_says_which_ranks_wrote_it():
    assert ds_files.writer_ranks("zero_pp_rank_3_mp_rank_01_optim_states.pt") == (3, 1)
    assert ds_files.writer_ranks("mp_rank_02_model_states.pt") == (0, 2)
    assert ds_files.writer_ranks("zero/optimizer_state.pt") == (0, 0)
    assert ds_files.names_a_tensor_parallel_rank("mp_rank_01_model_states.pt")
    assert not ds_files.names_a_tensor_parallel_rank("zero/optimizer_state.pt")


@pytest.mark.parametrize(
    ("names", "stage"),
    [
        (["zero_pp_rank_0_mp_rank_00_model_states.pt"], 3),
        (["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], 2),
        (["sub/mp_rank_00_model_states.pt"], 0),
        (["manifest.json"], None),
    ],
)
def test_the_names_say_the_zero_stage(names, stage):
    assert ds_files.stage_of_names(names) == stage
    assert ds_files.stage_of_names({n: 1 for n in names}) == stage


def test_the_weight_files_in_rank_order(tmp_path: Path):
    names = [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_10_mp_rank_00_optim_states.pt",
        "zero_pp_rank_2_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "layer_1_expert_0_mp_rank_00_model_states.pt",
        "layer_0_expert_1_mp_rank_00_model_states.pt",
        "expp_rank_0_mp_rank_00_optim_states.pt",
    ]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    model, optim = ds_files.checkpoint_files(tmp_path)
    assert [f.name for f in model] == ["mp_rank_00_model_states.pt"]
    assert [f.name for f in optim] == [names[2], names[1]]
    assert [f.name for f in ds_files.expert_files(tmp_path)] == [names[5], names[4]]
    assert ds_files.expert_file_name(1, 0) == names[4]
    assert ds_files.is_expert_file(names[4]) and not ds_files.is_expert_file(names[0])
    assert {f.name for f in ds_files.files_holding_weights(tmp_path, 2)} == set(names[:6])
    with pytest.raises(ds_files.LayoutError, match="not one zero_pp_rank_R file a rank"):
        ds_files.zero3_rank_files(tmp_path)


def test_the_key_each_file_holds_and_the_universal_twins():
    assert ds_files.states_key("mp_rank_00_model_states.pt") == "module"
    assert ds_files.states_key("zero_pp_rank_0_mp_rank_00_optim_states.pt") == (
        "optimizer_state_dict"
    )
    assert ds_files.states_key("expp_rank_1_mp_rank_00_optim_states.pt") == "optimizer"
    assert ds_files.states_key("fp32.pt") is None
    assert ds_files.universal_twin("mp_rank_00_model_states.pt") == (
        "zero_pp_rank_0_mp_rank_00_model_states.pt"
    )
    assert ds_files.universal_twin("zero_pp_rank_0_mp_rank_00_model_states.pt") == (
        "mp_rank_00_model_states.pt"
    )
    assert ds_files.universal_twin("optimizer_state.pt") is None
