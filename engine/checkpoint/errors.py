"""What a failed checkpoint save or load raises."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException

WRITE_FAILURES: tuple[type[BaseException], ...] = (Exception, _CheckpointException)
"""What a failed write raises: torch's CheckpointException (a full disk in the writers) is a BaseException."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed or loaded. The message names the path and what failed."""


class CorruptCheckpoint(CheckpointError):
    """Files of a checkpoint do not match its marker (``problems`` names each file and what failed); raised
    by ``load(verify=...)`` before any of its tensors reached the model or the optimizer."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        super().__init__(f"refusing to load {path}: " + "; ".join(problems))
        self.problems = problems
