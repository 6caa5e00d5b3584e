"""Pretrain the 125m preset (Llama-style, untied embeddings) on GPUs with ZeRO and bf16."""

from anneal.config import ModelConfig, TrainConfig
from anneal.recipe import main

if __name__ == "__main__":
    main(
        preset="125m",
        ds_config="zero1_bf16.json",
        model=ModelConfig(preset="125m", activation_checkpointing=False),
        train=TrainConfig(max_steps=20000, eval_every=1000, save_every=1000, log_every=10),
    )
