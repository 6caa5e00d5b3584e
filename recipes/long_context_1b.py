"""Pretrain the 1b preset on 32K-token sequences, each split over the 8 GPUs of a node (Ulysses
sequence parallelism, ds_configs/zero3_sp8_bf16.json; docs/parallelism.md).

- Context 32,768 tokens with RoPE base 500,000: Llama 3 raised the base from Llama 2's 10,000 to
  500,000, which Xiong et al. (2023) found effective up to 32,768 tokens (Dubey et al. 2024,
  "The Llama 3 Herd of Models", section 3.1); Code Llama raised it to 1,000,000 for 16,384
  (Roziere et al. 2023, section 2.4).
- Sequence parallelism 8 (``sequence_parallel_size``): each GPU holds 4,096 tokens of every
  sequence, so the step runs without recomputing activations: `anneal estimate --model 1b --seq
  32768 --ds-config zero3_sp8_bf16.json` puts the peak at 9.96 GiB per H100 without activation
  checkpointing (52.89 GiB at SP=1; 8.92 GiB at SP=1 with checkpointing, which recomputes each
  layer's forward). The world must be a multiple of 8 GPUs: one data-parallel replica per
  group of 8, and a group inside a node, as its all-to-alls run every layer.
- ZeRO-3 in bf16, micro-batch 1 (one 32K sequence per group at a time).
- Peak LR, global batch (1M tokens: 32 sequences a step) and warmup are recipes/pretrain_1b.py's
  (GPT-3 XL's, Brown et al. 2020, Table 2.1).

deepspeed --num_gpus 8 recipes/long_context_1b.py --out runs/1b-32k --data data/long
"""

from anneal.cli.recipe import main
from anneal.config.run import ModelConfig, OptimConfig, TrainConfig

RECIPE = dict(
    preset="1b",
    ds_config="zero3_sp8_bf16.json",
    model=ModelConfig(seq_len=32768, rope_theta=500_000.0),
    optim=OptimConfig(lr=2e-4, global_batch_tokens=2**20, warmup_tokens=375_000_000),
    train=TrainConfig(max_steps=60000, val_every=1000, save_every=1000, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
