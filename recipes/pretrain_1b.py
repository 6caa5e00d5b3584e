"""Pretrain the 1b preset (Llama-style, untied embeddings) on GPUs with ZeRO and bf16."""

from anneal.config import ModelConfig, TrainConfig
from anneal.recipe import main

if __name__ == "__main__":
    main(
        preset="1b",
        ds_config="zero2_bf16.json",
        model=ModelConfig(preset="1b", activation_checkpointing=True),
        train=TrainConfig(max_steps=60000, eval_every=1000, save_every=1000, log_every=10),
    )
