"""Pretrain the tiny preset (a few million parameters): the CPU demo and the test workhorse.

deepspeed --num_gpus N recipes/pretrain_tiny.py --out runs/tiny --data data/stdlib
"""

from anneal.config import TrainConfig
from anneal.recipe import main

RECIPE = dict(
    preset="tiny",
    ds_config="zero3_bf16.json",
    train=TrainConfig(max_steps=300, eval_every=100, save_every=100, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
