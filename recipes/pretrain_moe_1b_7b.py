"""Pretrain the olmoe-1b-7b preset on GPUs: OLMoE-1B-7B's shape (64 experts, 8 per token; 6.9B
parameters, 1.3B active) as a Qwen3-MoE decoder, through DeepSpeed's AutoEP.

Hyperparameters are OLMoE's (Muennighoff et al. 2024, "OLMoE: Open Mixture-of-Experts Language
Models", arXiv 2409.02060, section 2 and Table 12): peak LR 4e-4, global batch 4M tokens (1,024
sequences of 4,096), warmup 10B tokens (2,500 steps), load-balancing loss 0.01, router z-loss
0.001, AdamW weight decay 0.1; cosine to 0.1 x peak here (OLMoE decays to 4e-5 = 0.1 x peak
too). Its 5.1T-token run is 1.2M steps; max_steps below is a first 100B tokens. Experts
are shared out over groups of 8 GPUs (one node) by default: `--set
ds.expert_parallel.autoep_size=N` with N dividing 64 and the GPU count.

deepspeed --hostfile hostfiles/h100 recipes/pretrain_moe_1b_7b.py --out runs/olmoe --data DIR
"""

from anneal.cli.recipe import main
from anneal.config.run import ModelConfig, OptimConfig, TrainConfig

RECIPE = dict(
    preset="olmoe-1b-7b",
    ds_config="zero2_bf16.json",
    cpu_ds_config="cpu_zero2.json",  # ZeRO-3 runs too: --set ds.zero_optimization.stage=3
    model=ModelConfig(activation_checkpointing=True),
    optim=OptimConfig(lr=4e-4, global_batch_tokens=1024 * 4096, warmup_tokens=10_000_000_000),
    train=TrainConfig(max_steps=24_000, val_every=1000, save_every=1000, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
