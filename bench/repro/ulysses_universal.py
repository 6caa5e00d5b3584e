"""DeepSpeed 0.19.8: a checkpoint saved with Ulysses sequence parallelism does not convert to a
universal checkpoint. No Anneal code; a 2-layer Llama of 139K parameters, gloo on CPU, fp32,
ZeRO-2.

    deepspeed --num_gpus 2 bench/repro/ulysses_universal.py --out /tmp/ulysses_uc

What it shows (2 ranks, one sequence-parallel group of 2 from
``UlyssesSPAttentionHF.register_with_transformers``, given to ``deepspeed.initialize`` as its
``mpu``): one step and ``save_checkpoint`` work; rank 0 prints the checkpoint's
``checkpoint_parallel_dimensions`` ({'pp_degree': 1, 'tp_degree': 2}: ``parallel_state_sp``
aliases ``get_model_parallel_world_size`` to the sequence-parallel size, and the engine records
it through ``bwc_tensor_model_parallel_world_size``) and runs ``ds_to_universal``, which stops
in ``get_model_3d_descriptor_from_metadata`` with

    RuntimeError: Checkpoint model-state file count 1 does not match pp_degree=1 * tp_degree=2.

(The other way, a universal load into an engine whose mpu is ``parallel_state_sp`` stops in
``load_hp_checkpoint_state_from_checkpoint_dir``: the module has no
``get_tensor_model_parallel_world_size``.)
"""

import argparse
import os
import sys
import types

import deepspeed
import torch
from deepspeed.checkpoint import ds_to_universal
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    config._attn_implementation = "sdpa"
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=types.SimpleNamespace(config=config),
        core_attn_implementation="sdpa",
        sequence_parallel_size=2,
        micro_batch_size=2,
        seq_length=32,
        seq_length_is_variable=False,
    )
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "sequence_parallel_size": 2,
    }
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    engine, *_ = deepspeed.initialize(model=model, config=ds, mpu=mpu)
    rank = torch.distributed.get_rank()
    x = torch.randint(0, 300, (2, 32))  # the same on both ranks; each takes half the sequence
    part = slice(16 * rank, 16 * (rank + 1))
    positions = torch.arange(16 * rank, 16 * (rank + 1)).repeat(2, 1)
    logits = engine(input_ids=x[:, part], position_ids=positions).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, part].flatten())
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.out, tag="step1")
    torch.distributed.barrier()
    if rank != 0:
        return 0
    tag = os.path.join(args.out, "step1")
    state = torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), weights_only=False)
    print("checkpoint_parallel_dimensions:", state["checkpoint_parallel_dimensions"], flush=True)
    sys.argv = [sys.argv[0], "--input_folder", tag, "--output_folder", tag + "-universal"]
    sys.argv += ["--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    ds_to_universal.main(ds_to_universal.parse_arguments())
    print("converted", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
