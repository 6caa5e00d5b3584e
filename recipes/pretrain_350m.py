"""Pretrain the 350m preset (Llama-style, untied embeddings) on GPUs with ZeRO and bf16.

Peak LR and global batch are GPT-3's for the nearest size (Brown et al. 2020, "Language Models are
Few-Shot Learners", Table 2.1: GPT-3 Medium, 350M: batch 0.5M tokens, LR 3.0e-4); warmup over the
first 375M tokens and cosine decay to 0.1 x peak as in its appendix B. The ds_config (what the
cluster wants) is chosen per machine; its "auto" values take these.

deepspeed --num_gpus N recipes/pretrain_350m.py --out runs/350m --data data/stdlib
"""

from anneal.cli.recipe import main
from anneal.config.run import OptimConfig, TrainConfig

RECIPE = dict(
    preset="350m",
    ds_config="zero1_bf16.json",
    optim=OptimConfig(lr=3e-4, global_batch_tokens=2**19, warmup_tokens=375_000_000),
    train=TrainConfig(max_steps=40000, val_every=1000, save_every=1000, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
