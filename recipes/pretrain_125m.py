"""Pretrain the 125m preset (Llama-style, untied embeddings) on GPUs with ZeRO and bf16.

deepspeed --num_gpus N recipes/pretrain_125m.py --out runs/125m --data data/stdlib
"""

from anneal.config import TrainConfig
from anneal.recipe import main

RECIPE = dict(
    preset="125m",
    ds_config="zero1_bf16.json",
    train=TrainConfig(max_steps=20000, eval_every=1000, save_every=1000, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
