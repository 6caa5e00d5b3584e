"""Pretrain the 7b preset (Llama-style, untied embeddings) on GPUs with ZeRO and bf16.

deepspeed --num_gpus N recipes/pretrain_7b.py --out runs/7b --data data/stdlib
"""

from anneal.config import ModelConfig, TrainConfig
from anneal.recipe import main

RECIPE = dict(
    preset="7b",
    ds_config="zero3_bf16.json",
    model=ModelConfig(activation_checkpointing=True),
    train=TrainConfig(max_steps=250000, eval_every=1000, save_every=1000, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
