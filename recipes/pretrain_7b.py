"""Pretrain the 7b preset (Llama-style, untied embeddings) on GPUs with ZeRO and bf16.

Peak LR and global batch are GPT-3's for the nearest size (Brown et al. 2020, "Language Models are
Few-Shot Learners", Table 2.1: GPT-3 6.7B: batch 2M tokens, LR 1.2e-4); warmup over the first 375M
tokens and cosine decay to 0.1 x peak as in its appendix B. The ds_config (what the cluster wants)
is chosen per machine; its "auto" values take these.

deepspeed --num_gpus N recipes/pretrain_7b.py --out runs/7b --data data/stdlib
"""

from anneal.cli.recipe import main
from anneal.config.run import ModelConfig, OptimConfig, TrainConfig

RECIPE = dict(
    preset="7b",
    ds_config="zero3_bf16.json",
    model=ModelConfig(activation_checkpointing=True),
    optim=OptimConfig(lr=1.2e-4, global_batch_tokens=2**21, warmup_tokens=375_000_000),
    train=TrainConfig(max_steps=250000, val_every=1000, save_every=1000, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
