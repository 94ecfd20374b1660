"""The checkpoint interval from the failure rate, and the goodput it buys. Pure arithmetic (no torch).

Failures of a stage's nodes come as a Poisson process: one node fails every ``cluster.node_mtbf_hours`` on
average, a stage on n nodes every M = node MTBF / n (any node's failure stops the job). A save stalls
training for C seconds; after a failure the job is down for R seconds (restart or requeue, then the load of
the last checkpoint) and redoes the work since that checkpoint.

- The interval (the compute time between two saves): Daly 2006, "A higher order estimate of the optimum
  checkpoint interval for restart dumps": ``tau = sqrt(2 C M) (1 + sqrt(C / (2M)) / 3 + C / (18 M)) - C``
  for C < 2M, else M; its first term is Young's (1974) ``sqrt(2 C M)``.
- The expected goodput (useful compute / wall time) of an interval, in the same model: a segment of
  tau + C seconds must run without a failure to commit; each failure costs the segment's progress and a
  recovery of R that a failure may interrupt too, which gives the expected wall time of one segment
  ``M e^(R/M) (e^((tau + C)/M) - 1)`` (Daly 2006) and the goodput tau / that.

``auto_save_interval`` is what ``<stage>.save_interval=auto`` runs in the engine with its measured stall
and step time; the planner calls the same functions with its estimates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def system_mtbf_s(node_mtbf_hours: float, nodes: int) -> float:
    """Mean seconds between failures of a job on ``nodes`` nodes (any one failing stops it)."""
    return node_mtbf_hours * 3600.0 / max(nodes, 1)


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: sqrt(2 C M) seconds of compute between saves."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between saves, seconds (M when the save costs 2M or more)."""
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = save_s / mtbf_s
    return young_interval_s(save_s, mtbf_s) * (1 + math.sqrt(ratio / 2) / 3 + ratio / 18) - save_s


def auto_save_interval(stall_s: float, step_s: float, node_mtbf_hours: float, nodes: int) -> int:
    """``save_interval=auto``: Daly's interval in whole steps (at least 1) for a save that stalls training for
    ``stall_s``, steps of ``step_s`` seconds and ``nodes`` nodes of ``node_mtbf_hours`` MTBF each."""
    tau = daly_interval_s(stall_s, system_mtbf_s(node_mtbf_hours, nodes))
    return max(1, round(tau / step_s)) if step_s > 0 else 1


def expected_goodput(interval_s: float, save_s: float, recover_s: float, mtbf_s: float) -> float:
    """Useful compute / wall time for ``interval_s`` of compute per save (module docstring: Daly 2006)."""
    if interval_s <= 0:
        return 0.0
    segment = mtbf_s * math.exp(recover_s / mtbf_s) * math.expm1((interval_s + save_s) / mtbf_s)
    return interval_s / segment


def lost_per_failure_s(interval_s: float, save_s: float, mtbf_s: float) -> float:
    """Expected seconds of a segment (compute and save) a failure throws away: E[X | X < tau + C], X ~ Exp(M)."""
    t = interval_s + save_s
    return mtbf_s - t / math.expm1(t / mtbf_s)


@dataclass(frozen=True)
class IntervalRow:
    """One row of the planner's goodput table."""

    steps: int
    interval_s: float
    goodput: float
    lost_s: float
    """Expected work lost per failure (compute and save time redone), seconds."""
    mark: str = ""
    """auto (Daly's optimum) and/or configured."""


def interval_table(
    step_s: float, save_s: float, recover_s: float, mtbf_s: float, configured: int | None = None
) -> list[IntervalRow]:
    """Goodput for Daly's interval, fractions and multiples of it, and the configured interval (if a number)."""
    best = max(1, round(daly_interval_s(save_s, mtbf_s) / step_s))
    steps = {max(1, round(best * f)) for f in (0.125, 0.25, 0.5, 2.0, 4.0, 8.0)} | {best}
    if configured is not None:
        steps.add(configured)
    rows = []
    for n in sorted(steps):
        marks = [m for m, hit in (("auto", n == best), ("configured", n == configured)) if hit]
        tau = n * step_s
        rows.append(
            IntervalRow(
                n,
                tau,
                expected_goodput(tau, save_s, recover_s, mtbf_s),
                lost_per_failure_s(tau, save_s, mtbf_s),
                ", ".join(marks),
            )
        )
    return rows
