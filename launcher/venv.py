"""The launcher and the project's virtual environment: ``run`` and ``submit`` need torch and
DeepSpeed (pre-flight resolves the launch with them), which a bare ``python`` outside ``.venv``
most likely lacks. ``python -m launcher`` then says which Python it is and the fix, in one
paragraph with exit 2, not a ModuleNotFoundError traceback; ``hostfile`` needs none of them (the
sbatch script runs it before anything else)."""

from __future__ import annotations

import sys

NEEDS = ("torch", "deepspeed", "numpy", "transformers", "sentencepiece")
"""Packages of requirements.txt that ``run`` and ``submit`` import: a ModuleNotFoundError for
one of them means the wrong Python, not a bug."""


def missing_package(name: str) -> str:
    """One paragraph for a Python that cannot import ``name``: which Python this is, and the
    fix (the virtual environment's Python, which ``make setup`` creates)."""
    return (
        f"this Python ({sys.executable}) cannot import {name}, which pre-flight and training "
        f"need: run the launcher with the project's virtual environment, `.venv/bin/python -m "
        f"launcher ...` (or `source .venv/bin/activate` first). No .venv yet? `make setup` "
        f"creates it (torch, DeepSpeed and the rest of requirements.txt)."
    )
