"""Pretrain the 350m preset (Llama-style, untied embeddings) on GPUs with ZeRO and bf16.

deepspeed --num_gpus N recipes/pretrain_350m.py --out runs/350m --data data/stdlib
"""

from anneal.config import TrainConfig
from anneal.recipe import main

RECIPE = dict(
    preset="350m",
    ds_config="zero1_bf16.json",
    train=TrainConfig(max_steps=40000, eval_every=1000, save_every=1000, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
