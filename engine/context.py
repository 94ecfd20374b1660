"""What a stage job receives besides its config: where to write, what it reads, how it is laid out."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.schema.layout import ParallelPlan


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job (torch.distributed's rendezvous: what torchrun's variables say)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


STAGE_EVENTS = "events"
"""Key of a stage's result holding its own events (a list of dicts, each with an ``event`` name): the launcher
appends them to the run's events.jsonl, before the stage's ``completed`` event, and keeps them out of the
ledger's outputs."""


@dataclass
class StageContext:
    """Arguments of ``stages.<name>.main(cfg, ctx)``; built by the job runner (pipeline.submit.launch)."""

    run_dir: Path
    """The run directory (shared by all nodes)."""
    stage: str
    """This stage's name."""
    out_dir: Path
    """run_dir/stages/<stage>: the stage writes only here."""
    inputs: dict[str, Path] = field(default_factory=dict)
    """out_dir of each completed upstream stage, by stage name."""
    plan: ParallelPlan | None = None
    """The derived parallel layout of this stage."""
    attempt: int = 0
    """The stage's attempt number from the ledger on rank 0 (1 = first start); 0 on the other ranks and
    outside the launcher (the resume record of the trainer says which attempt resumed)."""
    restarts: int = 0
    """How many times the scheduler restarted this job (SLURM_RESTART_COUNT, read by the launcher)."""
    may_requeue: bool = False
    """The job runs under SLURM with requeues left (``restarts < cluster.max_requeues``): a hung rank may ask
    for a requeue (engine.runtime.signals.Watchdog)."""
    injob_left: int = 0
    """In-job restarts left after this attempt (cluster.injob_restarts, pipeline/submit/injob.py): a hung rank
    exits without a requeue, its task's supervisor starts every rank again inside the job."""
    on_hang: tuple[Callable[[], None], ...] = ()
    """Called by a firing hang watchdog just before the rank exits (the local launcher ends the job's other
    ranks: pipeline.submit.launch.end_local_job)."""
    dist: DistEnv | None = None
    """This rank's place in the job, from the launcher's job environment; None outside the launcher (one
    process, or torch.distributed's own env rendezvous: engine.runtime.distributed.env_from_os)."""
    faults: str = ""
    """Fault-injection specs for tests and drills (engine.runtime.fault_injection; the launcher reads
    ``PIPELINE_FAULT``); empty: none."""
    part: str | None = None
    """The one piece of the stage this job runs (pipeline.schema.graph ``Stage.parts``; eval: one model of
    ``eval.models``), its result going to pipeline.records.parts; None: the stage's own job."""

    @property
    def rank(self) -> int:
        """This process's global rank (0 outside the launcher)."""
        return self.dist.rank if self.dist else 0

    @property
    def world_size(self) -> int:
        """The job's number of ranks (1 outside the launcher)."""
        return self.dist.world_size if self.dist else 1

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"


class MetricsWriter:
    """Appends one JSON object per line to a stage's metrics file (rank 0 only writes)."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"time": time.time(), **record}
        line = json.dumps(record, default=float) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # mode: the umask decides
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
