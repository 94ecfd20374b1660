"""A discrete-event simulation of a training run under node failures (``python -m pipeline.plan --simulate-failures``).

Each of the run's nodes fails after a random time (Weibull with the node MTBF as its mean; shape 1 is the
exponential of pipeline.schema.goodput) and is replaced by a fresh node when it does. The run computes
``interval_s`` between saves that stall it ``save_s``; a save commits when its stall ends. A failure throws
away the work since the last committed save (and the save in progress), then the job is down for
``recover_s`` (an in-job restart on a spare node, or a requeue through SLURM) and ``load_s`` (loading and
verifying the checkpoint); a failure during that recovery starts it again. Replications draw from one
numpy generator seeded by ``seed``: the same inputs and seed give the same figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RunModel:
    """What the simulated run does, seconds."""

    work_s: float
    """Compute the run needs (steps x step time)."""
    interval_s: float
    """Compute between two saves."""
    save_s: float
    """Training stall of one save."""
    load_s: float
    """Loading (and verifying) the last checkpoint after a failure."""
    recover_s: float
    """From a failure to the job running again, before the load (restart or requeue)."""
    nodes: int
    node_mtbf_s: float
    shape: float = 1.0
    """Weibull shape of one node's time to failure (1: exponential, < 1: infant mortality)."""

    def __post_init__(self) -> None:
        if not (self.work_s > 0 and self.interval_s > 0 and self.nodes >= 1 and self.node_mtbf_s > 0):
            raise ValueError(f"{self}: work, interval and MTBF must be > 0, nodes >= 1")
        if min(self.save_s, self.load_s, self.recover_s) < 0 or self.shape <= 0:
            raise ValueError(f"{self}: save, load and recovery times must be >= 0, shape > 0")


@dataclass(frozen=True)
class SimResult:
    """Figures over the replications; the goodput's interval is a 95% confidence interval."""

    goodput: float
    """Work / mean wall time."""
    low: float
    high: float
    wall_s: float
    """Mean wall time of a run."""
    failures: float
    """Mean failures per run (those during a recovery included)."""
    lost_per_failure_s: float
    """Mean work (compute and save) thrown away per failure that hit the running job."""
    replications: int
    one_run: tuple[float, float] = (0.0, 0.0)
    """The 5th and 95th percentiles of one run's goodput: where a single measured run should fall."""


def simulate(run: RunModel, replications: int = 200, seed: int = 0) -> SimResult:
    """``replications`` runs of ``run``; the goodput's confidence interval from the wall times' (normal approximation)."""
    rng = np.random.default_rng(seed)
    walls, fails, hits, lost = (np.zeros(replications) for _ in range(4))
    for i in range(replications):
        walls[i], fails[i], hits[i], lost[i] = _one_run(run, rng)
    mean = float(walls.mean())
    half = 1.96 * float(walls.std(ddof=1)) / math.sqrt(replications) if replications > 1 else 0.0
    return SimResult(
        goodput=run.work_s / mean,
        low=run.work_s / (mean + half),
        high=run.work_s / max(mean - half, run.work_s),
        wall_s=mean,
        failures=float(fails.mean()),
        lost_per_failure_s=float(lost.sum() / hits.sum()) if hits.sum() else 0.0,
        replications=replications,
        one_run=(float(np.percentile(run.work_s / walls, 5)), float(np.percentile(run.work_s / walls, 95))),
    )


def _draw(run: RunModel, rng: np.random.Generator, n: int) -> np.ndarray:
    """Times to failure of ``n`` fresh nodes: Weibull(shape) scaled to mean node_mtbf_s."""
    scale = run.node_mtbf_s / math.gamma(1 + 1 / run.shape)
    return scale * rng.weibull(run.shape, n)


def _one_run(run: RunModel, rng: np.random.Generator) -> tuple[float, int, int, float]:
    """(wall time, failures, failures that hit the running job, work lost) of one run."""
    next_fail = _draw(run, rng, run.nodes)
    segment = run.interval_s + run.save_s
    recovery = run.recover_s + run.load_s
    t, done, failures, hits, lost = 0.0, 0.0, 0, 0, 0.0
    while True:
        remaining = run.work_s - done
        finish = remaining + math.ceil(remaining / run.interval_s - 1e-9) * run.save_s
        node = int(np.argmin(next_fail))
        failed_at = float(next_fail[node])
        if t + finish <= failed_at:
            return t + finish, failures, hits, lost
        full = math.floor((failed_at - t) / segment)  # segments committed before the failure
        done += full * run.interval_s
        lost += failed_at - t - full * segment
        t, failures, hits = failed_at, failures + 1, hits + 1
        next_fail[node] = t + _draw(run, rng, 1)[0]
        while True:  # recover; a failure during it starts the recovery again
            node = int(np.argmin(next_fail))
            if next_fail[node] >= t + recovery:
                t += recovery
                break
            t, failures = float(next_fail[node]), failures + 1
            next_fail[node] = t + _draw(run, rng, 1)[0]
