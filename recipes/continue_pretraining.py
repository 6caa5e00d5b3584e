"""Continue pretraining a Hugging Face model (Llama, Qwen2, Mistral) on your data: --init-from DIR.

The model is DIR's (architecture, weights, context, tokenizer: prepare the data with it first);
the numbers below are the schedule's, for a 7B-class model and a few billion new tokens:
- peak LR 3e-5, a tenth of the 3e-4 Llama 2 7B and 13B were pretrained with (Touvron et al.
  2023, section 2.2): re-warming to a lower peak forgets less of the original data at some cost
  in adaptation (Ibrahim et al. 2024, arXiv 2403.08763).
- warmup over 1% of the run: the re-warmup's length barely changed the final loss in Gupta et
  al. 2023 (arXiv 2308.04014), so it is kept short.
- WSD, the peak held and a 20% (1 - sqrt) cooldown to 0 at the end (Haegele et al. 2024, arXiv
  2405.18392): the run can be extended, and cooled down on the best data ("annealing").
- 4M tokens per step, Llama 2's batch (section 2.2); 2,400 steps are 10B tokens, a budget and
  no published number: set --max-steps to your train split's tokens / 4M.
- ZeRO-3 in bf16 with activation checkpointing: a 7B model's weights, gradients and Adam states
  (16 bytes a parameter, 112 GB) fit no single GPU, and released contexts are 4k-32k tokens.

anneal data prepare --input corpus/ --tokenizer MODEL_DIR --out data/mine
deepspeed --num_gpus 8 recipes/continue_pretraining.py --init-from MODEL_DIR --data data/mine
"""

from anneal.cli.recipe import main
from anneal.config.run import ModelConfig, OptimConfig, TrainConfig
from anneal.model import PRETRAINED

RECIPE = dict(
    preset=PRETRAINED,
    ds_config="zero3_bf16.json",
    model=ModelConfig(activation_checkpointing=True),
    optim=OptimConfig(
        lr=3e-5,
        global_batch_tokens=2**22,
        warmup_tokens=100_000_000,
        warmup_max_share=0.01,
        schedule="wsd",
        decay_share=0.2,
        decay_shape="1-sqrt",
        min_lr_ratio=0.0,
    ),
    train=TrainConfig(max_steps=2400, val_every=200, save_every=200, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
