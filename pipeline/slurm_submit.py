"""SLURM side of submission: the whole graph at once with ``afterok`` dependencies (queries: pipeline.scheduler).

States come from ``sacct`` (with ``squeue`` as a fallback). A job that SLURM is requeueing shows NODE_FAIL
for a few seconds before PENDING; submitit takes that as final, so we never do: requeued jobs are alive.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from pipeline import progress
from pipeline.config import PipelineConfig
from pipeline.graph import upstream
from pipeline.launch import make_executor, mark_submitted, run_stage, snapshot_code, stage_out_dir
from pipeline.ledger import ACTIVE, CANCELLED, COMPLETED, FAILED, RUNNING, Ledger
from pipeline.scheduler import ALIVE_STATES, cancel_jobs, job_state, slurm_job_alive  # noqa: F401  (re-exported)


def submit_graph(cfg: PipelineConfig, run_dir: Path, stages: list[str], *, out: TextIO = sys.stdout) -> int:
    """Submit ``stages`` (graph order) at once, each with afterok on its upstream jobs; returns at once
    unless ``run.follow``."""
    ledger = Ledger(run_dir)
    code_dir = snapshot_code(run_dir)
    jobs: dict[str, str] = {}
    for s in stages:
        deps = _dependency_ids(s, jobs, ledger)
        jobs[s] = _submit_stage(cfg, run_dir, s, code_dir, deps, ledger)
        print(f"[{s}] submitted job {jobs[s]}" + (f" (afterok:{':'.join(deps)})" if deps else ""), file=out)
    print(f"run directory: {run_dir}\nfollow with: python -m pipeline.status {run_dir}", file=out)
    if cfg.run.follow:
        return follow(cfg, run_dir, stages, out=out)
    return 0


def _dependency_ids(stage: str, jobs: dict[str, str], ledger: Ledger) -> list[str]:
    """Jobs ``stage`` must wait for: its upstream stages submitted now, or still queued/running from before
    (``decide`` left those alone: a second command while the first one's jobs run)."""
    deps = []
    for u in upstream(stage):
        rec = ledger.read(u)
        if u in jobs:
            deps.append(jobs[u])
        elif rec and rec.status in ACTIVE and rec.job_ids:
            deps.append(rec.job_ids[-1])
    return deps


def _submit_stage(
    cfg: PipelineConfig, run_dir: Path, stage: str, code_dir: Path, deps: list[str], ledger: Ledger
) -> str:
    """Submit one stage's job (cancelling a leftover of an earlier submission) and record it in the ledger."""
    prev = ledger.read(stage)
    if prev and prev.job_ids:
        cancel_jobs([j for j in prev.job_ids if slurm_job_alive(j)])  # e.g. dependents left pending
    ex = make_executor(cfg, stage, run_dir, code_dir)
    if deps:
        ex.update_parameters(dependency="afterok:" + ":".join(deps))
    job = ex.submit(run_stage, stage, cfg.to_dict(), str(run_dir), None)
    job_id = str(job.job_id)
    mark_submitted(
        cfg,
        ledger,
        stage,
        "slurm",
        job_ids=[job_id],
        log=str(job.paths.stdout),
        extra={"code_dir": str(code_dir), "dependency": deps, "stderr": str(job.paths.stderr)},
    )
    ledger.event("submitted", stage, job_id=job_id, dependency=deps)
    return job_id


def follow(
    cfg: PipelineConfig, run_dir: Path, stages: list[str], *, out: TextIO = sys.stdout, poll_s: float = 2.0
) -> int:
    """Wait until every stage completed or one will not, drawing progress from metrics files."""
    from pipeline.status import run_status

    followers = {
        s: progress.Follower(s, stage_out_dir(run_dir, s) / "metrics.jsonl", out=out) for s in stages
    }
    while True:
        views = {v.stage: v for v in run_status(run_dir) if v.stage in stages}
        for s, v in views.items():
            if v.state in (RUNNING, COMPLETED):
                followers[s].poll()
            if v.state in (FAILED, CANCELLED, "blocked"):
                print(f"[{s}] {v.state}: {v.detail}\n  log: {v.stderr or v.log}", file=out)
                return 1
        if all(v.state == COMPLETED for v in views.values()):
            return 0
        time.sleep(poll_s)
