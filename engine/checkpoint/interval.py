"""``<stage>.save_interval=auto``: when the next periodic save is due, re-chosen from measured costs.

The interval itself is pipeline.schema.goodput.auto_save_interval (Young/Daly), called with numbers: before
the first save the planner's estimate of the save's stall and the first measured step; after each save the
measured stall (the median of the last saves' blocking time, plus the commits of async saves) and the
median measured step, each the largest over the ranks (``agree``: all ranks must choose the same interval,
and the slowest rank's stall is the job's). Each choice that changes the interval is kept in ``records`` for the metrics file.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from pipeline.schema.goodput import auto_save_interval, system_mtbf_s

_WINDOW = 20
"""Recent steps (and 3 saves) the medians are taken over."""


class AutoInterval:
    """Due-ness of periodic saves under ``save_interval=auto`` (the final and forced saves are the Checkpointer's)."""

    def __init__(
        self,
        node_mtbf_hours: float,
        nodes: int,
        estimated_stall_s: float,
        agree: Callable[[float], float] = float,
    ) -> None:
        self.node_mtbf_hours = node_mtbf_hours
        self.nodes = nodes
        self.estimated_stall_s = estimated_stall_s
        """The planner's save time (pipeline.schema.estimates.checkpoint_estimate), used until a save is measured."""
        self.agree = agree
        """A value's maximum over the ranks (engine.runtime.distributed.all_reduce_max; collective: called by
        every rank at the same steps, the first one and each save)."""
        self.interval: int | None = None
        """Steps between saves, once chosen."""
        self.records: list[dict[str, float | int | str]] = []
        """Choices not yet written to the metrics file (the trainer takes them)."""
        self._steps: list[float] = []
        self._last_save: int | None = None

    def due(self, step: int, step_s: float | None) -> bool:
        """Whether step ``step`` (just finished, ``step_s`` seconds of compute) should save."""
        if step_s is not None and step_s > 0:
            self._steps = [*self._steps, step_s][-_WINDOW:]
        if self._last_save is None:
            self._last_save = step - 1  # the step this run started from
        if self.interval is None:
            self._choose(step, self.estimated_stall_s, "planner estimate")
        assert self.interval is not None
        return step - self._last_save >= self.interval

    def saved(self, step: int, stalls_s: list[float], commits_s: list[float]) -> None:
        """A save of step ``step`` was tried: re-choose from the measured stalls (and async commits) so far."""
        self._last_save = step
        if not stalls_s:  # no save has succeeded yet
            self._choose(step, self.estimated_stall_s, "planner estimate")
            return
        stall = statistics.median(stalls_s[-3:]) + (statistics.median(commits_s[-3:]) if commits_s else 0.0)
        self._choose(step, stall, "measured")

    def _choose(self, step: int, stall_s: float, source: str) -> None:
        stall_s = self.agree(stall_s)
        step_s = self.agree(statistics.median(self._steps) if self._steps else 0.0)
        interval = auto_save_interval(stall_s, step_s, self.node_mtbf_hours, self.nodes)
        if interval != self.interval:
            mtbf_h = system_mtbf_s(self.node_mtbf_hours, self.nodes) / 3600
            self.records.append(
                {"kind": "save_interval", "step": step, "interval": interval, "stall_s": stall_s,
                 "step_s": step_s, "mtbf_h": mtbf_h, "nodes": self.nodes, "source": source}
            )  # fmt: skip
        self.interval = interval

    def take_records(self) -> list[dict[str, float | int | str]]:
        out, self.records = self.records, []
        return out
