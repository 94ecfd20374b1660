"""A failed save (disk full, permission denied) is logged and retried at the next interval; several in a row stop."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.checkpoint.errors import CheckpointError
from engine.checkpoint.manager import Checkpointer


class FlakyDisk(Checkpointer):
    """Saves fail while ``failing`` is set, like a full disk; records the steps that did save."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, save_interval=2)
        self.failing = True
        self.saved: list[int] = []

    def save(self, step, chunks, optimizer, scheduler, state, final=False, async_save=False):  # type: ignore[override]
        if self.failing:
            raise OSError(28, "No space left on device")
        self.saved.append(step)
        return self.root / f"iter_{step:07d}"


def save_at(ck: Checkpointer, step: int, final: bool = False, force: bool = False) -> None:
    ck.maybe_save(step, final, force, [], None, None, {})


def test_failed_saves_are_logged_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = FlakyDisk(tmp_path)
    with caplog.at_level(logging.ERROR):
        save_at(ck, 2)
        save_at(ck, 4)
    assert ck.failures == 2 and "No space left on device" in caplog.text and "2 in a row" in caplog.text
    ck.failing = False
    save_at(ck, 6)  # retried at the next interval
    assert ck.saved == [6] and ck.failures == 0


def test_several_failures_in_a_row_stop_the_run(tmp_path: Path) -> None:
    ck = FlakyDisk(tmp_path)
    save_at(ck, 2)
    save_at(ck, 4)
    with pytest.raises(CheckpointError, match=r"giving up after 3 failed save\(s\) in a row.*No space left"):
        save_at(ck, 6)


def test_a_failed_final_or_stop_save_is_an_error_at_once(tmp_path: Path) -> None:
    for kwargs in ({"final": True}, {"force": True}):
        with pytest.raises(CheckpointError, match="giving up after 1"):
            save_at(FlakyDisk(tmp_path), 3, **kwargs)
