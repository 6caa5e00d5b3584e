"""Pretrain the tiny preset (a few million parameters): the CPU demo and the test workhorse.

No published table covers a model this small. The global batch is nanoGPT's character-level
Shakespeare config (64 sequences of 256 tokens, 16,384 tokens; warmup of 100 such steps); the
peak LR of 3e-3 is higher than its 1e-3 because it learned fastest here on the stdlib corpus
(tiny models tolerate high rates: GPT-3's table rises from 1.2e-4 at 6.7B to 6e-4 at 125M).
64 sequences divide across every data-parallel size in hostfiles/ (1, 2, 16 ranks) at the
shipped micro-batches; at other sizes the global batch rounds up to a multiple of micro-batch x
ranks (saying so), so this recipe is also the smoke test of any new cluster, up to 512 ranks.

deepspeed --num_gpus N recipes/pretrain_tiny.py --out runs/tiny --data data/stdlib
"""

from anneal.cli.recipe import main
from anneal.config.run import OptimConfig, TrainConfig

RECIPE = dict(
    preset="tiny",
    ds_config="zero3_bf16.json",
    optim=OptimConfig(lr=3e-3, global_batch_tokens=64 * 256, warmup_tokens=100 * 64 * 256),
    train=TrainConfig(max_steps=200, val_every=50, save_every=50, log_every=10),
)

if __name__ == "__main__":
    main(**RECIPE)
