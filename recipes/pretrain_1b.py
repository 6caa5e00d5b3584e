"""Pretrain the 1b preset (Llama-style, untied embeddings) on GPUs with ZeRO and bf16.

deepspeed --num_gpus N recipes/pretrain_1b.py --out runs/1b --data data/stdlib
"""

from anneal.config import ModelConfig, TrainConfig
from anneal.recipe import main

RECIPE = dict(
    preset="1b",
    ds_config="zero2_bf16.json",
    model=ModelConfig(activation_checkpointing=True),
    train=TrainConfig(max_steps=60000, eval_every=1000, save_every=1000, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
