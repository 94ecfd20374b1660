"""Environments for the subprocesses tests start: the checkout importable, and one rank of a gloo world."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def python_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with this checkout first on PYTHONPATH (so ``tests.support`` and the project import), plus
    ``extra``."""
    path = [
        str(REPO),
        *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)),
    ]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def rank_env(rank: int, world: int, port: int | None = None, **extra: str) -> dict[str, str]:
    """``python_env`` for rank ``rank`` of ``world`` meeting at 127.0.0.1:``port`` (a free port if None)."""
    if port is None:
        from engine.runtime.distributed import free_port

        port = free_port()
    return python_env(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


def module_command(script: Path) -> list[str]:
    """How to run ``script`` as a program: ``-m <module>`` for a file of this checkout (its package imports
    work), else its path."""
    path = script.resolve()
    if path.is_relative_to(REPO) and path.suffix == ".py":
        return ["-m", ".".join(path.relative_to(REPO).with_suffix("").parts)]
    return [str(path)]
