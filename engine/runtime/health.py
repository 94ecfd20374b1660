"""Node health at job start (``cluster.health.policy=warn``): a GEMM and a collective on every rank, named nodes.

Every rank times a square fp32 matmul on its device and an all-reduce of ``allreduce_mb`` across the job's
ranks (gloo on CPU, NCCL on GPU), the median of ``repeats`` after one warm-up (a node slowed part of the time still shows); a failing check is caught and
reported, never raised here. Rank 0 gathers the figures; a node's figure is its slowest rank's. ``judge`` names
each node whose matmul time exceeds ``slow_factor`` x the median of the other nodes', or whose check failed,
by hostname (the all-reduce time is reported per node; see ``JUDGED``). Each timed all-reduce starts after a barrier, so a fast rank's time does not include
waiting for a slow one. The caller (engine.run) logs it, writes a ``health`` line and a ``slow_node`` alarm;
with ``policy=exclude`` every rank then raises ``NodesExcluded``, and the job's launcher requeues the job with
those nodes excluded (pipeline.submit.launch).
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.schema.sections import HealthConfig

FIGURES = ("matmul_s", "allreduce_s")
JUDGED = ("matmul_s",)
"""Figures that name a slow node. The all-reduce is reported, not judged: a collective's waiting lands on the
ranks that wait for the slow one (their time grows, the slow rank's does not), so it cannot name a node by
itself; a failing all-reduce still names its node (the check's error)."""


class NodesExcluded(RuntimeError):
    """``cluster.health.policy=exclude`` named slow or sick nodes: the job stops before training, to be requeued
    without them."""

    def __init__(self, nodes: dict[str, str]) -> None:
        self.nodes = dict(nodes)
        """Hostname -> why it was named."""
        super().__init__("health check: " + "; ".join(f"node {h}: {why}" for h, why in sorted(nodes.items())))


def exclusion_blocked(nodes: list[str]) -> str | None:
    """Why the job cannot leave ``nodes`` (too few left in its partition; None: it can), asked by rank 0 of
    SLURM and the same on every rank."""
    from engine.runtime import distributed as D
    from pipeline.slurm.job_env import exclusion_blocked as ask

    return D.broadcast_object(ask(nodes) if D.rank() == 0 else None)


@dataclass
class NodeFigures:
    host: str
    ranks: list[int] = field(default_factory=list)
    matmul_s: float = 0.0
    allreduce_s: float = 0.0
    error: str | None = None

    def figures(self) -> dict[str, float]:
        return {"matmul_s": self.matmul_s, "allreduce_s": self.allreduce_s}


@dataclass
class HealthReport:
    nodes: list[NodeFigures]
    slow: dict[str, str]
    """Hostname -> why it was named (which figure, how many times the median, or the error)."""

    def as_record(self) -> dict[str, Any]:
        return {
            "kind": "health",
            "nodes": {n.host: {"ranks": n.ranks, **n.figures(), "error": n.error} for n in self.nodes},
            "slow": self.slow,
        }


def _timed(fn: Any, repeats: int, sync: Any, before: Any = None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rank_check(cfg: HealthConfig, rank: int, host: str) -> dict[str, Any]:
    """This rank's figures: matmul and all-reduce seconds (an exception becomes ``error``)."""
    import torch
    import torch.distributed as dist

    from engine.runtime import distributed as D

    out: dict[str, Any] = {"host": host, "rank": rank, "matmul_s": 0.0, "allreduce_s": 0.0}
    try:
        dev = D.device()
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        a = torch.randn(cfg.matmul_size, cfg.matmul_size, device=dev)
        out["matmul_s"] = _timed(lambda: a @ a, cfg.repeats, sync)
        buf = torch.ones(int(cfg.allreduce_mb * 2**20) // 4, device=dev)
        if dist.is_initialized() and dist.get_world_size() > 1:  # after a barrier: the time is the transfer,
            out["allreduce_s"] = _timed(
                lambda: dist.all_reduce(buf), cfg.repeats, sync, dist.barrier
            )  # no wait
    except Exception as e:  # a sick node's error is a finding, not a crash of the check
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def by_node(per_rank: list[dict[str, Any]]) -> list[NodeFigures]:
    """Each node's figures: its slowest rank's (the one the job waits for)."""
    nodes: dict[str, NodeFigures] = {}
    for r in per_rank:
        n = nodes.setdefault(r["host"], NodeFigures(r["host"]))
        n.ranks.append(int(r["rank"]))
        n.matmul_s = max(n.matmul_s, float(r["matmul_s"]))
        n.allreduce_s = max(n.allreduce_s, float(r["allreduce_s"]))
        n.error = n.error or r.get("error")
    return list(nodes.values())


def judge(nodes: list[NodeFigures], slow_factor: float, min_gap_s: float = 0.0) -> dict[str, str]:
    """Hostname -> why: a failed check, or a figure above ``slow_factor`` x the median of the other nodes' (with
    two nodes the other one's: the slow one cannot pull its own reference up) and by more than ``min_gap_s``."""
    slow = {n.host: f"health check failed: {n.error}" for n in nodes if n.error}
    ok = [n for n in nodes if not n.error]
    for key in JUDGED:
        for n in ok:
            others = [m.figures()[key] for m in ok if m is not n]
            med = statistics.median(others) if others else 0.0
            v = n.figures()[key]
            if med > 0 and v > slow_factor * med and v - med > min_gap_s and n.host not in slow:
                slow[n.host] = (
                    f"{key} {v * 1e3:.2f} ms = {v / med:.1f}x the other nodes' median {med * 1e3:.2f} ms"
                )
    return slow


def node_check(cfg: HealthConfig, host: str | None = None) -> HealthReport | None:
    """Run the check on every rank (a collective: all ranks call it); the report on rank 0, None elsewhere.
    ``host``: the name this rank reports (default: its hostname)."""
    from engine.runtime import distributed as D

    figures = D.gather_object(rank_check(cfg, D.rank(), host or socket.gethostname()))
    if D.rank() != 0:
        return None
    nodes = by_node(figures)
    return HealthReport(nodes, judge(nodes, cfg.slow_factor, cfg.min_gap_ms / 1e3))
