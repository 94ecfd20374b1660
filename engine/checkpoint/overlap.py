"""Verification of a checkpoint overlapped with its load: hashed while the load plans, gated before tensor reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.checkpoint.collective import gathered, on_rank0
from engine.checkpoint.errors import CorruptCheckpoint
from engine.checkpoint.integrity import check_share, marker_check, share, verify_collective
from engine.runtime.distributed import rank as _rank
from engine.runtime.distributed import world_size as _world


class OverlappedCheck:
    """Verification of a checkpoint overlapped with its load; collective (every rank makes one).

    Made before the load starts: every file but the tensor files (``.distcp``: the marker, torch's
    ``.metadata``, megatron's common and metadata files, the RNG files; small) is checked now and the
    ranks agree (``CorruptCheckpoint`` if one is bad); the tensor files of this rank's ``share`` are hashed
    by a background thread (xxhash and hashlib free the GIL) while the load plans. ``gate`` is called where
    torch's reader starts reading tensor data: it waits for the thread and the ranks agree on the verdict;
    bad files raise there, so no tensor of a bad checkpoint is ever copied into the model. Hashing first
    also leaves the files in the page cache, so the reads that follow cost little more.
    """

    def __init__(self, path: Path, mode: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.path, self.agreed = path, False
        self.problems: list[str] = []
        meta, problems = on_rank0(lambda: marker_check(path), f"reading the marker of {path}")
        mine = share(meta["files"], _rank(), _world()) if meta is not None else []
        tensors = [e for e in mine if e[0].endswith(".distcp")]
        problems += gathered(check_share(path, [e for e in mine if not e[0].endswith(".distcp")], mode))
        if meta is None or problems:
            raise CorruptCheckpoint(path, problems)
        pool = ThreadPoolExecutor(1, thread_name_prefix="verify")
        self.future = pool.submit(check_share, path, tensors, mode)
        pool.shutdown(wait=False)

    def gate(self) -> None:
        """Wait for this rank's hashes and agree with the other ranks (collective; once); raise when bad."""
        if not self.agreed:
            self.problems, self.agreed = gathered(self.future.result()), True
        if self.problems:
            raise CorruptCheckpoint(self.path, self.problems)

    def wait(self) -> None:
        """Let this rank's hashing finish (a failed load leaves no thread reading)."""
        self.future.exception()


def gated_reads(check: OverlappedCheck | None) -> Any:
    """A context in which megatron's torch_dist loads call ``check.gate`` before reading tensor data."""
    import contextlib

    from megatron.core.dist_checkpointing.strategies import torch as strategy

    @contextlib.contextmanager
    def gated() -> Any:
        factory = strategy._get_filesystem_reader

        def reader(*args: Any, **kwargs: Any) -> Any:
            found = factory(*args, **kwargs)
            read = found.read_data

            def read_data(plan: Any, planner: Any) -> Any:
                check.gate()  # type: ignore[union-attr]
                return read(plan, planner)

            found.read_data = read_data
            return found

        strategy._get_filesystem_reader = reader
        try:
            yield
        finally:
            strategy._get_filesystem_reader = factory

    return gated() if check is not None else contextlib.nullcontext()


def overlapped_check(path: Path, mode: str | None) -> OverlappedCheck | None:
    """The check ``load`` overlaps with reading (None: nothing to hash). Where megatron's reader cannot be
    gated (another version), ``path`` is verified here instead, before anything is read."""
    if mode is None or mode == "sizes":
        return None
    from megatron.core.dist_checkpointing.strategies import torch as strategy

    if not hasattr(strategy, "_get_filesystem_reader"):
        problems = verify_collective(path, mode)
        if problems:
            raise CorruptCheckpoint(path, problems)
        return None
    return OverlappedCheck(path, mode)
