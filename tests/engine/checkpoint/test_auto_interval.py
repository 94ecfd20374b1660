"""save_interval=auto in the checkpoint manager: the interval is pipeline.schema.goodput's, from the planner's
estimate before the first save and the measured stall after it, agreed over ranks, and recorded."""

from __future__ import annotations

from pathlib import Path

from engine.checkpoint.interval import AutoInterval
from engine.checkpoint.manager import Checkpointer
from pipeline.schema.goodput import auto_save_interval

MTBF_H, NODES = 2.0, 4  # a failure every 1,800 s


class TimedDisk(Checkpointer):
    """Saves nothing; each save 'stalls' ``stall_s`` (appended as the manager's own save does)."""

    def __init__(self, root: Path, auto: AutoInterval) -> None:
        super().__init__(root, save_interval=0, auto_interval=auto)
        self.stall_s = 0.5
        self.saved: list[int] = []

    def save(self, step, chunks, optimizer, scheduler, state, final=False, async_save=False):  # type: ignore[override]
        self.saved.append(step)
        self.save_seconds.append(self.stall_s)
        return self.root / f"iter_{step:07d}"


def run_steps(ck: Checkpointer, steps: range, step_s: float) -> None:
    for s in steps:
        ck.maybe_save(s, False, False, [], None, None, {}, step_s=step_s)


def test_auto_interval_from_the_estimate_then_the_measured_stall(tmp_path: Path) -> None:
    auto = AutoInterval(MTBF_H, NODES, estimated_stall_s=8.0)
    ck = TimedDisk(tmp_path, auto)
    first = auto_save_interval(8.0, 1.0, MTBF_H, NODES)  # 8 s stall, 1 s steps: 164 steps
    measured = auto_save_interval(0.5, 1.0, MTBF_H, NODES)  # 0.5 s stall: 42 steps
    assert (first, measured) == (164, 42)
    run_steps(ck, range(11, 11 + first + 2 * measured), 1.0)  # a run resumed at step 10
    assert ck.saved == [10 + first, 10 + first + measured, 10 + first + 2 * measured]
    assert ck.save_interval == measured
    records = auto.take_records()
    assert [(r["step"], r["interval"], r["source"]) for r in records] == [
        (11, first, "planner estimate"),
        (10 + first, measured, "measured"),
    ], "a record when the interval changes, not at every save"
    assert records[1]["stall_s"] == 0.5 and records[1]["mtbf_h"] == MTBF_H / NODES
    assert auto.take_records() == []


def test_auto_interval_agrees_over_ranks(tmp_path: Path) -> None:
    seen: list[float] = []

    def slowest(x: float) -> float:  # what all_reduce_max returns when another rank is 4x slower
        seen.append(x)
        return 4 * x

    auto = AutoInterval(MTBF_H, NODES, estimated_stall_s=8.0, agree=slowest)
    run_steps(TimedDisk(tmp_path, auto), range(1, 3), 1.0)
    assert auto.interval == auto_save_interval(32.0, 4.0, MTBF_H, NODES)
    assert seen == [8.0, 1.0], "stall and step time, once each, at the first step only"


def test_fixed_interval_unchanged(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, save_interval=3)
    saved: list[int] = []
    ck.save = lambda step, *a, **k: saved.append(step)  # type: ignore[method-assign]
    run_steps(ck, range(1, 10), 1.0)
    assert saved == [3, 6, 9]
