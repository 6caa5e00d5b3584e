"""A recipe that trains like recipes/pretrain_tiny.py but whose ranks on 127.0.0.2 (pdsh's ssh
sets SSH_CONNECTION to "client port server port") raise after their first step, for the test
that a failing rank on a remote node reaches the user as a non-zero exit."""

import os
import sys

sys.path.insert(0, os.getcwd())

import anneal.train.trainer  # noqa: E402
from anneal.cli.recipe import load_recipe, main  # noqa: E402

RECIPE = load_recipe(os.path.join(os.getcwd(), "recipes", "pretrain_tiny.py"))


def failing_step(engine, stream, state, shape, *args):
    if state.step >= 1:
        raise RuntimeError("the injected failure of a rank on the second host")
    return train_step(engine, stream, state, shape, *args)


if __name__ == "__main__":
    if os.environ.get("SSH_CONNECTION", "").split()[2:3] == ["127.0.0.2"]:
        train_step = anneal.train.trainer.train_step  # the name the Trainer calls
        anneal.train.trainer.train_step = failing_step
    main(**RECIPE)
