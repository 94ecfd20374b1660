"""The run directory's record of what is done: one JSON file per stage (atomic) plus an append-only event log.

Layout of a run directory (``runs/<run.name>-<run_hash>``)::

    ledger/<stage>.json     status, hash, job ids, attempts, times, outputs, error (written atomically)
    events.jsonl            one line per event (submitted, started, completed, failed, skipped, ...)
    stages/<stage>/         the stage's own outputs (metrics.jsonl, checkpoints/, ...)
    jobs/<stage>/           submitit folders: job scripts, pickles, logs
    provenance/             resolved config, git commit, package versions
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.records.causes import Cause
from pipeline.records.files import atomic_write_text, locked  # noqa: F401  (atomic_write_text re-exported)

# Stage statuses. "completed" is the only one downstream stages may rely on. "stopped": saved and exited on
# a signal (re-running resumes it); "requeued": SLURM was asked to run the job again.
PENDING, SUBMITTED, RUNNING, COMPLETED, FAILED, CANCELLED, STOPPED, REQUEUED = (
    "pending",
    "submitted",
    "running",
    "completed",
    "failed",
    "cancelled",
    "stopped",
    "requeued",
)
ACTIVE = (SUBMITTED, RUNNING, REQUEUED)
WEAK_CAUSES = ("unknown", "communication")
"""Causes a later witness of the same attempt may replace (a collective's error is often another rank's echo)."""


@dataclass
class StageRecord:
    """What the ledger knows about one stage of one run."""

    stage: str
    status: str = PENDING
    hash: str = ""
    upstream: dict[str, str] = field(default_factory=dict)
    executor: str = ""
    job_ids: list[str] = field(default_factory=list)
    attempts: int = 0
    requeues: int = 0
    submitted_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    outputs: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    log: str | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    host: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    """One entry per failed attempt: attempt, cause, rule, detail, time, seen_by (pipeline.records.causes)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageRecord:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class Ledger:
    """Reads and writes a run directory's records. Safe to use from the submitter and from rank 0 of a job.

    Writers serialise on ``run_dir/ledger/.lock`` (a POSIX record lock, honoured across the nodes of a
    shared filesystem): every ``update`` is one read-modify-write under it, so two commands on one run
    directory (a re-run while ``cancel`` runs, two sweep launchers, a job's rank 0) never lose each other's
    fields. ``with ledger.lock():`` makes a longer check-then-update sequence atomic. Readers need no lock:
    records are replaced atomically.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "ledger"
        self.events_path = self.run_dir / "events.jsonl"
        self.lock_path = self.dir / ".lock"

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Exclusive hold on this run directory's ledger (re-entrant within a process)."""
        return locked(self.lock_path)

    def path(self, stage: str) -> Path:
        return self.dir / f"{stage}.json"

    def read(self, stage: str) -> StageRecord | None:
        p = self.path(stage)
        if not p.exists():
            return None
        return StageRecord.from_dict(json.loads(p.read_text()))

    def write(self, record: StageRecord) -> None:
        text = json.dumps(asdict(record), indent=2, sort_keys=True, default=str)
        with self.lock():
            atomic_write_text(self.path(record.stage), text)

    def update(self, stage: str, **fields: Any) -> StageRecord:
        for k in fields:
            if k not in StageRecord.__dataclass_fields__:
                raise KeyError(f"unknown ledger field {k!r}")
        with self.lock():
            rec = self.read(stage) or StageRecord(stage=stage)
            for k, v in fields.items():
                setattr(rec, k, v)
            self.write(rec)
        return rec

    def add_failure(
        self, stage: str, cause: Cause, seen_by: str, attempt: int | None = None, exit_code: int | None = None
    ) -> StageRecord:
        """Record why an attempt failed (default: the newest attempt). One entry per attempt: a later witness
        replaces an earlier one only when it knows more (the earlier said ``unknown`` or ``communication``,
        which is often only the echo of another rank's failure)."""
        with self.lock():
            rec = self.read(stage) or StageRecord(stage=stage)
            n = rec.attempts if attempt is None else attempt
            entry = {"attempt": n, **cause.as_dict(), "time": time.time(), "seen_by": seen_by}
            if exit_code is not None:
                entry["exit_code"] = exit_code
            old = next((f for f in rec.failures if f.get("attempt") == n), None)
            if old is None:
                rec.failures.append(entry)
            elif old.get("cause") in WEAK_CAUSES and cause.name not in WEAK_CAUSES:
                rec.failures[rec.failures.index(old)] = entry
            else:
                return rec
            self.write(rec)
        self.event("failure_cause", stage, **{k: v for k, v in entry.items() if k != "time"})
        return rec

    def event(self, kind: str, stage: str | None = None, **data: Any) -> None:
        """Append one event line (under the ledger lock, O_APPEND: concurrent writers never interleave lines)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        rec = {"time": time.time(), "event": kind, "stage": stage, "host": socket.gethostname(), **data}
        line = json.dumps(rec, default=str) + "\n"
        with self.lock():
            # mode 0666: the umask decides, as for every other file of the run
            fd = os.open(self.events_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    line = "\n" + line  # a crash cut the last line: start on a fresh one
                os.write(fd, line.encode())
            finally:
                os.close(fd)

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        out = []
        for line in self.events_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write is skipped, never fatal
        return out

    def records(self, stages: list[str]) -> dict[str, StageRecord | None]:
        return {s: self.read(s) for s in stages}

    @property
    def excluded_path(self) -> Path:
        return self.run_dir / "excluded_nodes.json"

    def excluded_nodes(self) -> dict[str, str]:
        """Nodes every job of the run keeps off (hostname -> why), from ``cluster.health.policy=exclude``."""
        p = self.excluded_path
        return dict(json.loads(p.read_text())) if p.exists() else {}

    def exclude_nodes(self, nodes: dict[str, str]) -> dict[str, str]:
        """Add ``nodes`` (hostname -> why) to the run's excluded nodes; returns them all."""
        with self.lock():
            every = {**self.excluded_nodes(), **nodes}
            atomic_write_text(self.excluded_path, json.dumps(every, indent=1, sort_keys=True))
        return every


def read_metrics(run_dir: Path, stage: str) -> list[dict[str, Any]]:
    """Every record of a stage's ``metrics.jsonl`` (a torn or foreign line is skipped)."""
    path = Path(run_dir) / "stages" / stage / "metrics.jsonl"
    out: list[dict[str, Any]] = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def accounting(run_dir: Path, stage: str) -> dict[str, Any]:
    """Fault accounting of a stage from its metrics file: resumes, steps lost, downtime, checkpoint saves."""
    records = read_metrics(run_dir, stage)
    resumes = [r for r in records if r.get("kind") == "resume"]
    saves = [float(r.get("save_s", 0.0)) for r in records if r.get("kind") == "checkpoint"]
    down = [float(r["down_s"]) for r in resumes if r.get("down_s") is not None]
    intervals = [r for r in records if r.get("kind") == "save_interval"]
    return {
        "resumes": len(resumes),
        "steps_lost": sum(int(r.get("steps_lost", 0)) for r in resumes),
        "down_s": down,
        "checkpoints": len(saves),
        "checkpoint_save_s_total": sum(saves),
        "checkpoint_save_s_max": max(saves, default=0.0),
        "save_interval": intervals[-1] if intervals else None,
        "goodput": measured_goodput(records),
    }


STEP_PARTS = ("time_data_s", "time_fwd_bwd_s", "time_optimizer_s")
"""The parts of a train line's time split that are training (engine.train.meter; checkpoint time is not)."""


def measured_goodput(records: list[dict[str, Any]]) -> float | None:
    """Training time / wall time of a stage from its metrics records (every attempt): the last train line's
    step x the median step compute time (STEP_PARTS), over the time from the first record to the last.
    Start-ups, saves, downtime and replayed steps are the rest. None before two train lines."""
    train = [r for r in records if r.get("kind") == "train" and all(p in r for p in STEP_PARTS)]
    times = [float(r["time"]) for r in records if "time" in r]
    if len(train) < 2 or len(times) < 2 or max(times) <= min(times):
        return None
    per_step = sorted(sum(float(r[p]) for p in STEP_PARTS) for r in train)
    useful = int(train[-1]["step"]) * per_step[len(per_step) // 2]
    return min(useful / (max(times) - min(times)), 1.0)
