"""The one rank helper. Library code asks here, never the environment."""

from __future__ import annotations

import logging

import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    return rank() == 0


def print0(*args: object) -> None:
    """Print on rank 0 only (console summaries; use logging elsewhere)."""
    if is_main_process():
        print(*args, flush=True)


def setup_logging(level: int = logging.INFO) -> None:
    """Rank 0 logs at ``level``; other ranks only warnings and errors."""
    logging.basicConfig(
        level=level if is_main_process() else logging.WARNING,
        format=f"%(asctime)s [rank{rank()}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
