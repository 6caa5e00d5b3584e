"""Pretrain the 7b preset (Llama-style, untied embeddings) on GPUs with ZeRO and bf16."""

from anneal.config import ModelConfig, TrainConfig
from anneal.recipe import main

if __name__ == "__main__":
    main(
        preset="7b",
        ds_config="zero3_bf16.json",
        model=ModelConfig(preset="7b", activation_checkpointing=True),
        train=TrainConfig(max_steps=250000, eval_every=1000, save_every=1000, log_every=10),
    )
