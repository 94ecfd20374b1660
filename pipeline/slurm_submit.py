"""SLURM side of submission: the whole graph at once with ``afterok`` dependencies, and job state queries.

States come from ``sacct`` (with ``squeue`` as a fallback). A job that SLURM is requeueing shows NODE_FAIL
for a few seconds before PENDING; submitit takes that as final, so we never do: requeued jobs are alive.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from pipeline import progress
from pipeline.config import PipelineConfig, stage_hashes
from pipeline.graph import dependencies, upstream
from pipeline.launch import make_executor, run_stage, snapshot_code, stage_out_dir
from pipeline.ledger import COMPLETED, FAILED, SUBMITTED, Ledger
from pipeline.plan import stage_plan

# sacct/squeue states in which a job will still run (or is running).
ALIVE_STATES = {
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "NODE_FAIL",  # transient on requeue (JobRequeue=1 / --requeue)
    "PREEMPTED",
    "STAGE_OUT",
    "SIGNALING",
}


def _run(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def job_state(job_id: str) -> tuple[str, str, int]:
    """(state, reason, runs) of a SLURM job; runs counts its executions (requeues + 1)."""
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"])
    if out and out.strip():
        state, _, reason = out.strip().splitlines()[0].partition("|")
        acct = _run(["sacct", "-n", "-P", "-D", "-X", "-j", job_id, "-o", "State"])
        runs = len([ln for ln in (acct or "").splitlines() if ln.strip()]) or 1
        return state.strip(), reason.strip(), runs
    acct = _run(["sacct", "-n", "-P", "-D", "-X", "-j", job_id, "-o", "State,Reason"])
    rows = [ln.split("|") for ln in (acct or "").splitlines() if ln.strip()]
    if not rows:
        return "UNKNOWN", "", 0
    state = rows[-1][0].split()[0]  # "CANCELLED by 0" -> CANCELLED
    return state, rows[-1][1] if len(rows[-1]) > 1 else "", len(rows)


def slurm_job_alive(job_id: str) -> bool:
    state, reason, _ = job_state(job_id)
    if state == "PENDING" and "DependencyNeverSatisfied" in reason:
        return False
    return state in ALIVE_STATES


def cancel_jobs(job_ids: list[str]) -> None:
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=60)


def submit_graph(cfg: PipelineConfig, run_dir: Path, stages: list[str], *, out: TextIO = sys.stdout) -> int:
    """Submit ``stages`` (graph order) at once, each with afterok on the ones submitted before it."""
    ledger = Ledger(run_dir)
    hashes = stage_hashes(cfg)
    code_dir = snapshot_code(run_dir)
    jobs: dict[str, str] = {}
    for s in stages:
        prev = ledger.read(s)
        if prev and prev.job_ids:
            cancel_jobs([j for j in prev.job_ids if slurm_job_alive(j)])  # e.g. dependents left pending
        ex = make_executor(cfg, s, run_dir, code_dir)
        deps = [jobs[u] for u in dependencies(s, stages) if u in jobs]
        if deps:
            ex.update_parameters(dependency="afterok:" + ":".join(deps))
        job = ex.submit(run_stage, s, cfg.to_dict(), str(run_dir), None)
        jobs[s] = str(job.job_id)
        ledger.update(
            s,
            status=SUBMITTED,
            hash=hashes[s],
            upstream={u: hashes[u] for u in upstream(s)},
            executor="slurm",
            job_ids=[jobs[s]],
            submitted_at=time.time(),
            started_at=None,
            ended_at=None,
            error=None,
            log=str(job.paths.stdout).replace("%t", "0"),
            plan=stage_plan(cfg, s).as_dict(),
            extra={"code_dir": str(code_dir), "dependency": deps},
        )
        ledger.event("submitted", s, job_id=jobs[s], dependency=deps)
        print(f"[{s}] submitted job {jobs[s]}" + (f" (afterok:{','.join(deps)})" if deps else ""), file=out)
    print(f"run directory: {run_dir}\nfollow with: python -m pipeline.status {run_dir}", file=out)
    if cfg.run.follow:
        return follow(cfg, run_dir, stages, out=out)
    return 0


def follow(
    cfg: PipelineConfig, run_dir: Path, stages: list[str], *, out: TextIO = sys.stdout, poll_s: float = 2.0
) -> int:
    """Wait until every stage completed or one failed, drawing progress from metrics files."""
    from pipeline.status import view

    ledger = Ledger(run_dir)
    followers = {
        s: progress.Follower(s, stage_out_dir(run_dir, s) / "metrics.jsonl", out=out) for s in stages
    }
    while True:
        pending = []
        for s in stages:
            rec = ledger.read(s)
            if rec and rec.started_at:
                followers[s].poll()
            v = view(rec, s)
            if v.state in (FAILED, "blocked"):
                print(f"[{s}] {v.state}: {v.detail}\n  log: {v.log}", file=out)
                return 1
            if v.state != COMPLETED:
                pending.append(s)
        if not pending:
            return 0
        time.sleep(poll_s)
