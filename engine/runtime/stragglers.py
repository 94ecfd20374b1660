"""Stragglers during training (``cluster.health.straggler_interval``): which node makes every step wait.

Each rank's *own* time per step is the time from the step's start to its entry into the gradient
synchronisation (megatron's ``finalize_model_grads``, timed by ``SyncClock``): its forward and backward
compute, before any wait for a data-parallel peer. A slow rank arrives late, the ranks it holds up wait inside.
The optimizer step after it is left out: its collectives would count a fast rank's waits as its own. Every ``straggler_interval`` steps the ranks exchange their
own time over the interval (one all-gather); each rank's score is its own time over the median of the ranks
at its pipeline stage (stages do different work), a node's score its slowest rank's. A node whose score is at
least ``1 + straggler_slower`` for ``straggler_patience`` intervals in a row is a straggler: every rank reaches
the same verdict from the same figures, so they act together (engine.train.trainer: an alarm; with
``policy=exclude`` a checkpoint at this step and ``NodesExcluded``, as the health check at job start).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.schema.sections import HealthConfig


class SyncClock:
    """Wraps megatron's ``finalize_model_grads`` (the data-parallel gradient all-reduce): adds up each rank's
    own time, from ``mark`` (a step's start) or the previous synchronisation's end to the next entry."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.own = 0.0
        self._since: float | None = None

    def mark(self) -> None:
        """A step starts: its compute counts from now."""
        self._since = time.perf_counter()

    def take(self) -> float:
        """The own time added up since the last ``take``."""
        own, self.own = self.own, 0.0
        return own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._since is not None:
            self.own += time.perf_counter() - self._since
        try:
            return self.fn(*args, **kwargs)
        finally:
            self._since = time.perf_counter()


@dataclass
class Verdict:
    """One check's figures: scores per node and rank, and the nodes found straggling (hostname -> why)."""

    step: int
    nodes: dict[str, float]
    ranks: dict[int, float]
    stragglers: dict[str, str] = field(default_factory=dict)
    leave: bool = False
    """policy exclude: the job leaves the stragglers (saves, stops, is requeued without them)."""
    blocked: str | None = None
    """Why it cannot leave them (too few nodes left in the partition): alarms only, from then on."""

    def as_record(self) -> dict[str, Any]:
        return {"kind": "straggler", "step": self.step, "nodes": self.nodes, "ranks": self.ranks}


def scores(rows: list[tuple[int, str, int, float]]) -> tuple[dict[int, float], dict[str, float]]:
    """(rank -> score, host -> score) from ``(rank, host, pipeline stage, own seconds)`` rows."""
    by_stage: dict[int, list[float]] = {}
    for _, _, stage, own in rows:
        by_stage.setdefault(stage, []).append(own)
    ranks: dict[int, float] = {}
    nodes: dict[str, float] = {}
    for rank, host, stage, own in rows:
        med = statistics.median(by_stage[stage])
        ranks[rank] = own / med if med > 0 else 1.0
        nodes[host] = max(nodes.get(host, 0.0), ranks[rank])
    return ranks, nodes


class StragglerMonitor:
    """Told when a step starts (``starting``) and ends (``observe``); every ``straggler_interval`` steps a
    collective check (all ranks call)."""

    def __init__(
        self, cfg: HealthConfig, clock: SyncClock, host: str, rank: int, pp_rank: int, exclude: bool = False
    ) -> None:
        self.cfg = cfg
        self.exclude = exclude
        """policy exclude with a requeue left: a straggler stops the job (checkpoint, NodesExcluded)."""
        self.clock = clock
        self.host, self.rank, self.pp_rank = host, rank, pp_rank
        self.own = 0.0
        self.streak: dict[str, int] = {}

    def starting(self) -> None:
        self.clock.mark()

    def observe(self, step: int) -> Verdict | None:
        """Add the step's own time; on a check step the verdict (the same on every rank), else None."""
        self.own += self.clock.take()
        if step % self.cfg.straggler_interval:
            return None
        from engine.runtime import distributed as D

        rows = D.all_gather_object((self.rank, self.host, self.pp_rank, self.own))
        self.own = 0.0
        verdict = self.judge(step, rows)
        if self.exclude and verdict.stragglers:
            from engine.runtime.health import exclusion_blocked

            verdict.blocked = exclusion_blocked(sorted(verdict.stragglers))
            verdict.leave = verdict.blocked is None
            self.exclude = verdict.leave
        return verdict

    def judge(self, step: int, rows: list[tuple[int, str, int, float]]) -> Verdict:
        ranks, nodes = scores(rows)
        limit = 1.0 + self.cfg.straggler_slower
        verdict = Verdict(step, nodes, ranks)
        for host, score in nodes.items():
            self.streak[host] = self.streak.get(host, 0) + 1 if score >= limit else 0
            if self.streak[host] >= self.cfg.straggler_patience:
                verdict.stragglers[host] = (
                    f"straggler: its ranks' own step time {score:.2f}x the median for "
                    f"{self.streak[host]} checks of {self.cfg.straggler_interval} steps (limit {limit:.2f}x)"
                )
        return verdict
