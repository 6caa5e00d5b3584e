"""DeepSpeed 0.19.8: an AutoTP checkpoint saved at ZeRO-3 does not convert to a universal
checkpoint. No Anneal code; a 2-layer Llama of 139K parameters, gloo on CPU, fp32.

    deepspeed --num_gpus 2 bench/repro/autotp_zero3_universal.py --out /tmp/autotp_z3

What it shows (2 ranks, tensor_parallel.autotp_size 2, the model built under zero.Init): one
training step and ``save_checkpoint`` work; then rank 0 runs ``ds_to_universal`` on the
checkpoint, which stops in ``merge_tp_slices`` with

    ValueError: Rank 0 supplied a shard of 64 elements, but the map describes 0. ...

The AutoTP map in the saved ``universal_checkpoint_info`` gives every parameter AutoTP leaves
whole (the RMSNorm weights, the embeddings) ``logical_shape [0]``: it is
``collect_autotp_universal_checkpoint_info`` (module_inject/layers.py) recording
``tuple(param.shape)``, which under ZeRO-3 is the partitioned placeholder's empty shape, not
``param.ds_shape``. The script prints those entries before converting. With ``--stage 2`` the
same script converts (the map's shapes are right) and exits 0.
"""

import argparse
import os
import sys

import deepspeed
import torch
from deepspeed.checkpoint import ds_to_universal
from deepspeed.utils import groups
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "tensor_parallel": {"autotp_size": 2},
    }
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    groups._init_tp_mesh_device(tensor_model_parallel_size=2)  # both ranks: one TP group
    if args.stage == 3:
        LlamaForCausalLM(config)  # import transformers' model code before zero.Init
        dp_group = groups.get_data_parallel_group()  # partitioned as the engine will
        with deepspeed.zero.Init(config_dict_or_path=ds, data_parallel_group=dp_group, mpu=groups):
            model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    engine, *_ = deepspeed.initialize(model=model, config=ds, mpu=groups)
    x = torch.randint(0, 300, (2, 32))  # the same on both ranks (seed 0), as AutoTP needs
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.out, tag="step1")
    torch.distributed.barrier()
    if torch.distributed.get_rank() != 0:
        return 0
    tag = os.path.join(args.out, "step1")
    name = "mp_rank_00_model_states.pt"
    name = f"zero_pp_rank_0_{name}" if args.stage == 3 else name
    info = torch.load(os.path.join(tag, name), weights_only=False)["universal_checkpoint_info"]
    for pattern, entry in info["affine_map"]["params"].items():
        if "norm" in pattern or "embed" in pattern:
            print(f"{pattern}: logical_shape {entry['logical_shape']}", flush=True)
    sys.argv = [sys.argv[0], "--input_folder", tag, "--output_folder", tag + "-universal"]
    sys.argv += ["--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    ds_to_universal.main(ds_to_universal.parse_arguments())
    print("converted", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
