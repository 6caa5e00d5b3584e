"""Runs a recipe (argv[1:]) as ``python recipes/...`` would, noting wall-clock marks on the way:
interpreter up, heavy imports done, engine build begun and ended (``build_engine`` wrapped). The
marks go to the JSON file named by $ANNEAL_BENCH_MARKS when the engine is built (the wrapper
replaces ``anneal.train.entry.build_engine``, the name ``run`` calls).

A script that part 2 of bench_checkpoint starts in place of the recipe; only the standard
library is imported before the first mark.
"""

import json
import os
import runpy
import sys
import time

marks = {"start": time.time()}


def main() -> None:
    # As from `python -c` in the repository root (the child's cwd): that directory first on
    # the path, not this script's bench/.
    sys.path[0] = os.getcwd()
    import deepspeed  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import anneal.cli.recipe  # noqa: F401
    import anneal.train

    marks["imported"] = time.time()
    build_engine = anneal.train.engine.build_engine

    def timed_build(plan):
        marks["build_start"] = time.time()
        engine = build_engine(plan)
        marks["build_end"] = time.time()
        with open(os.environ["ANNEAL_BENCH_MARKS"], "w") as f:
            json.dump(marks, f)
        return engine

    anneal.train.entry.build_engine = timed_build  # the name run() calls
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
