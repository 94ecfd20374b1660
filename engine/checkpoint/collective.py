"""The two collectives of the checkpoint protocol: run on rank 0 and share the result, gather problems."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.checkpoint.errors import CheckpointError
from engine.runtime.distributed import all_gather_object as _all_gather
from engine.runtime.distributed import broadcast_object as _broadcast
from engine.runtime.distributed import rank as _rank


def on_rank0(fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on rank 0 only and hand its result to every rank; a failure raises on every rank."""
    result, error, exc = None, None, None
    if _rank() == 0:
        try:
            result = fn()
        except Exception as e:  # re-raised below, on every rank
            error, exc = f"{what} failed on rank 0: {type(e).__name__}: {e}", e
    result, error = _broadcast((result, error))
    if error:
        raise CheckpointError(error) from exc
    return result


def gathered(mine: list[str]) -> list[str]:
    """Every rank's problems, on every rank (collective)."""
    return [p for rank_problems in _all_gather(mine) for p in rank_problems]
