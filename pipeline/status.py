"""``python -m pipeline.status <run_dir>``: each stage's state from the ledger and the scheduler.

Shows pending / running / completed / failed / requeued (with count), where the logs are, and why a stage
failed (or which upstream failure keeps it from running).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import STAGES
from pipeline.ledger import ACTIVE, COMPLETED, FAILED, Ledger, StageRecord

TERMINAL_BAD = {"FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@dataclass
class StageView:
    """One stage's state as a user should see it."""

    stage: str
    state: str
    detail: str = ""
    requeues: int = 0
    log: str | None = None
    job_ids: str = ""


def view(rec: StageRecord | None, stage: str) -> StageView:
    """Merge the ledger record with the scheduler's view of its job."""
    if rec is None:
        return StageView(stage, "not run")
    v = StageView(stage, rec.status, rec.error or "", rec.requeues, rec.log, ",".join(rec.job_ids))
    if rec.executor != "slurm" or rec.status not in ACTIVE or not rec.job_ids:
        return v
    from pipeline.slurm_submit import job_state

    state, reason, runs = job_state(rec.job_ids[-1])
    v.requeues = max(v.requeues, runs - 1)
    if state == "PENDING" and "DependencyNeverSatisfied" in reason:
        v.state, v.detail = "blocked", "will not run: an upstream stage failed"
    elif state == "PENDING":
        v.state, v.detail = ("requeued" if runs > 1 else "pending"), reason
    elif state in ("REQUEUED", "NODE_FAIL", "PREEMPTED", "REQUEUE_HOLD"):
        v.state, v.detail = "requeued", state
    elif state in TERMINAL_BAD:
        v.state, v.detail = "failed", f"SLURM state {state}" + (f" ({reason})" if reason else "")
    elif state == "RUNNING":
        v.state = "running"
    elif state == "COMPLETED" and rec.status != COMPLETED:
        v.state, v.detail = "failed", "job ended without completing the stage"
    return v


def run_status(run_dir: Path) -> list[StageView]:
    ledger = Ledger(run_dir)
    return [view(ledger.read(s), s) for s in STAGES if ledger.read(s) is not None]


def format_status(run_dir: Path, views: list[StageView]) -> str:
    lines = [f"run directory: {run_dir}", f"{'stage':<10} {'state':<10} {'job':<10} {'requeues':>8}  detail"]
    for v in views:
        lines.append(f"{v.stage:<10} {v.state:<10} {v.job_ids:<10} {v.requeues:>8}  {v.detail}")
        if v.state in ("failed", FAILED) and v.log:
            lines.append(f"{'':<10} log: {v.log}")
    failed = [v.stage for v in views if v.state in ("failed", FAILED)]
    if failed:
        lines.append(f"failed stage: {failed[0]} (re-run the same command to resubmit it and its dependents)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.status", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a run directory (runs/<name>-<hash>)")
    p.add_argument("--watch", type=float, default=0, help="refresh every N seconds until nothing is active")
    a = p.parse_args(argv)
    if not (a.run_dir / "ledger").is_dir():
        print(f"error: {a.run_dir} is not a run directory (no ledger/ inside)", file=sys.stderr)
        return 2
    while True:
        views = run_status(a.run_dir)
        print(format_status(a.run_dir, views), flush=True)
        if not a.watch or not any(v.state in ("submitted", "pending", "running", "requeued") for v in views):
            return 1 if any(v.state in ("failed", FAILED) for v in views) else 0
        time.sleep(a.watch)


if __name__ == "__main__":
    sys.exit(main())
