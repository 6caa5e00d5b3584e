"""Pretrain the tiny-moe preset (a Qwen3-MoE decoder of 8 experts, 2 per token): the sparse
model's CPU demo and test workhorse, trained through DeepSpeed's AutoEP.

Its peak LR and warmup steps are the tiny dense recipe's (recipes/pretrain_tiny.py: 3e-3, 100
steps); its batch is twice that recipe's 64 x 256 tokens, 128 sequences, which divide over 1, 2
and 16 ranks at zero2_bf16.json's micro-batch of 8 (the sparse recipes ship ZeRO-2, whose
micro-batch is 8; the dense tiny recipe's ZeRO-3 config has 4; a sparse model trains at ZeRO-3
too, ``--ds-config zero3_bf16.json``). The comparison with the
dense model at equal active parameters and tokens is bench/bench_moe_dense.py
(docs/benchmarks.md). The router's
load-balancing loss weighs 0.01 (Switch Transformer, Fedus et al. 2021, and OLMoE) and its
z-loss 0.001 (ST-MoE, Zoph et al. 2022): ``--set model.moe_aux_loss_coef=...`` and
``model.moe_z_loss_coef`` change them. Expert parallelism: ``--set
ds.expert_parallel.autoep_size=N`` (N divides the 8 experts and the ranks).

deepspeed --num_gpus N recipes/pretrain_moe_tiny.py --out runs/tiny-moe --data data/stdlib
"""

from anneal.cli.recipe import main
from anneal.config.run import OptimConfig, TrainConfig

RECIPE = dict(
    preset="tiny-moe",
    ds_config="zero2_bf16.json",
    cpu_ds_config="cpu_zero2.json",  # ZeRO-3 runs too: --set ds.zero_optimization.stage=3
    optim=OptimConfig(lr=3e-3, global_batch_tokens=128 * 256, warmup_tokens=100 * 128 * 256),
    train=TrainConfig(max_steps=200, val_every=50, save_every=50, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
