"""Pretrain the tiny preset (a few million parameters): the CPU demo and the test workhorse."""

from anneal.config import TrainConfig
from anneal.recipe import main

if __name__ == "__main__":
    main(
        preset="tiny",
        ds_config="zero3_bf16.json",
        train=TrainConfig(max_steps=300, eval_every=100, save_every=100, log_every=10),
    )
