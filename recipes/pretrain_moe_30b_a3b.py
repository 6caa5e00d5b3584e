"""Pretrain the qwen3-30b-a3b preset on GPUs: Qwen3-30B-A3B's shape (128 experts, 8 per token;
30.5B parameters, 3.3B active), through DeepSpeed's AutoEP.

The shape is Qwen3-30B-A3B's config.json (Qwen Team 2025, "Qwen3 Technical Report", arXiv
2505.09388); the report gives no learning rate or batch for it, so those are OLMoE's at its
active size (arXiv 2409.02060: peak LR 4e-4, 4M-token batch, 10B-token warmup) and the
router's load-balancing weight is Qwen3's own router_aux_loss_coef, 0.001. Expert parallelism
over one node (8 GPUs, 16 experts each) by default is a starting point: `anneal estimate
--model qwen3-30b-a3b --gpus N --ep 8` says what fits.

deepspeed --hostfile hostfiles/h100 recipes/pretrain_moe_30b_a3b.py --out runs/a3b --data DIR
"""

from anneal.cli.recipe import main
from anneal.config.run import ModelConfig, OptimConfig, TrainConfig

RECIPE = dict(
    preset="qwen3-30b-a3b",
    ds_config="zero2_bf16.json",
    cpu_ds_config="cpu_zero2.json",  # ZeRO-3 runs too: --set ds.zero_optimization.stage=3
    model=ModelConfig(activation_checkpointing=True),
    optim=OptimConfig(lr=4e-4, global_batch_tokens=1024 * 4096, warmup_tokens=10_000_000_000),
    train=TrainConfig(max_steps=24_000, val_every=1000, save_every=1000, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
