"""SLURM side of submission: the whole graph at once with ``afterok`` dependencies (queries: pipeline.slurm.queries).

States come from ``sacct`` (with ``squeue`` as a fallback). A job that SLURM is requeueing shows NODE_FAIL
for a few seconds before PENDING; submitit takes that as final, so we never do: requeued jobs are alive.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from pipeline.records import progress
from pipeline.records.ledger import ACTIVE, CANCELLED, COMPLETED, FAILED, RUNNING, Ledger
from pipeline.schema.config import PipelineConfig
from pipeline.schema.graph import upstream
from pipeline.slurm.queries import ALIVE_STATES, cancel_jobs, job_state, slurm_job_alive  # noqa: F401  (re-exported)
from pipeline.submit.launch import (
    make_executor,
    mark_submitted,
    pending_parts,
    run_stage,
    snapshot_code,
    stage_out_dir,
)


class SubmitError(RuntimeError):
    """SLURM did not take a job (no sbatch, controller unreachable, sbatch rejected it): SLURM's own message
    and the fix, in one line. Exit code ``pipeline.cli.compose.EXIT_SUBMIT``."""

    def __init__(self, message: str, submitted: int = 0) -> None:
        super().__init__(message)
        self.submitted = submitted
        """Jobs of this submission that SLURM had accepted (and that were cancelled again)."""


# SLURM message fragments -> the fix to print with them.
_FIXES = (
    ("invalid partition", "set cluster.partition to one `sinfo -s` lists (null: the cluster's default)"),
    ("invalid account", "set cluster.account to one `sacctmgr show assoc user=$USER` lists, or null"),
    ("invalid qos", "set cluster.qos to one your account may use (`sacctmgr show qos`), or null"),
    (
        "node configuration is not available",
        "ask for less per node (cluster.gpus_per_node, cpus_per_node, "
        "mem_gb, ranks_per_node) or fix cluster.constraint",
    ),
    ("time limit", "lower cluster.time_min / <stage>.time_min to the partition's limit (`sinfo -o %P,%l`)"),
    (
        "unable to contact slurm controller",
        "the controller is down or unreachable: check `scontrol ping` "
        "and SLURM_CONF, then re-run the same command",
    ),
    (
        "slurm_conf",
        "SLURM's configuration is not found: set SLURM_CONF (local cluster: source .slurm/env.sh)",
    ),
)


def fix_for(message: str) -> str:
    low = message.lower()
    for frag, fix in _FIXES:
        if frag in low:
            return fix
    return "fix the cluster profile (conf/cluster/, cluster.*) and re-run the same command"


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return " / ".join(dict.fromkeys(errors or lines[-1:])) or "no message"


def check_slurm() -> None:
    """sbatch and srun are on PATH and the controller answers; raises SubmitError (nothing written yet)."""
    for tool in ("sbatch", "srun", "sinfo"):
        if shutil.which(tool) is None:
            raise SubmitError(
                f"{tool} not found on PATH: cluster.executor=slurm needs SLURM's client commands; run on a "
                "login node (or `source .slurm/env.sh` for the local cluster), or use cluster=local"
            )
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SubmitError(f"sinfo failed ({e}): {fix_for('unable to contact slurm controller')}") from None
    if r.returncode != 0:
        msg = _one_line(r.stderr or r.stdout)
        raise SubmitError(f"SLURM says: {msg}; fix: {fix_for(msg)}")


def submit_graph(cfg: PipelineConfig, run_dir: Path, stages: list[str], *, out: TextIO = sys.stdout) -> int:
    """Submit ``stages`` (graph order) at once, each with afterok on its upstream jobs; returns at once
    unless ``run.follow``."""
    ledger = Ledger(run_dir)
    code_dir = snapshot_code(run_dir)
    jobs: dict[str, str] = {}
    spawned: list[str] = []  # the parts' jobs, cancelled with the rest should a later submission fail
    for s in stages:
        try:
            pieces = _submit_parts(cfg, run_dir, s, code_dir, jobs, ledger, stages, out, spawned)
            deps = _dependency_ids(s, jobs, ledger) + list(pieces.values())
            jobs[s] = _submit_stage(cfg, run_dir, s, code_dir, deps, ledger, pieces)
        except SubmitError as e:
            _undo(ledger, jobs, s, str(e), spawned)
            raise SubmitError(str(e), submitted=len(jobs)) from None
        print(f"[{s}] submitted job {jobs[s]}" + (f" (afterok:{':'.join(deps)})" if deps else ""), file=out)
    print(f"run directory: {run_dir}\nfollow with: python -m pipeline.status {run_dir}", file=out)
    if cfg.run.follow:
        return follow(cfg, run_dir, stages, out=out)
    return 0


def _submit_parts(
    cfg: PipelineConfig,
    run_dir: Path,
    stage: str,
    code_dir: Path,
    jobs: dict[str, str],
    ledger: Ledger,
    stages: list[str],
    out: TextIO,
    spawned: list[str],
) -> dict[str, str]:
    """Submit ``stage``'s parts (Stage.parts) that have no result for this config, each after only the stages
    it reads; a part whose stage runs again in this submission is redone. Returns {part: job id}."""
    ids: dict[str, str] = {}
    for part, reads in pending_parts(cfg, run_dir, stage, stages, out):
        deps = _dependency_ids(stage, jobs, ledger, among=reads)
        ids[part] = str(_sbatch(cfg, run_dir, stage, code_dir, deps, part).job_id)
        spawned.append(ids[part])
        ledger.event("submitted", stage, part=part, job_id=ids[part], dependency=deps)
        print(
            f"[{stage}:{part}] submitted job {ids[part]}" + (f" (afterok:{':'.join(deps)})" if deps else ""),
            file=out,
        )
    return ids


def _dependency_ids(
    stage: str, jobs: dict[str, str], ledger: Ledger, among: tuple[str, ...] | None = None
) -> list[str]:
    """Jobs ``stage`` (or one of its parts: ``among`` its reads) must wait for: its upstream stages submitted
    now, or still queued/running from before (``decide`` left those alone: a second command while the first
    one's jobs run)."""
    deps = []
    for u in upstream(stage) if among is None else among:
        rec = ledger.read(u)
        if u in jobs:
            deps.append(jobs[u])
        elif rec and rec.status in ACTIVE and rec.job_ids:
            deps.append(rec.job_ids[-1])
    return deps


def _sbatch(
    cfg: PipelineConfig, run_dir: Path, stage: str, code_dir: Path, deps: list[str], part: str | None = None
) -> Any:
    """Submit the job of ``stage`` (or of one ``part`` of it) after ``deps``; SubmitError with SLURM's message."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):  # submitit echoes sbatch's stderr: we print it once
            ex = make_executor(cfg, stage, run_dir, code_dir)
            if deps:
                ex.update_parameters(dependency="afterok:" + ":".join(deps))
            return ex.submit(run_stage, stage, cfg.to_dict(), str(run_dir), None, part)
    except (OSError, RuntimeError) as e:  # submitit's FailedJobError/FailedSubmissionError are RuntimeErrors
        msg = _one_line(str(e) or captured.getvalue() or type(e).__name__)
        what = f"stage {stage!r}" + (f" (part {part!r})" if part else "")
        raise SubmitError(f"sbatch rejected {what}: {msg}; fix: {fix_for(msg)}") from None


def _submit_stage(
    cfg: PipelineConfig,
    run_dir: Path,
    stage: str,
    code_dir: Path,
    deps: list[str],
    ledger: Ledger,
    pieces: dict[str, str] | None = None,
) -> str:
    """Submit one stage's job (cancelling a leftover of an earlier submission) and record it in the ledger,
    with the jobs of its ``pieces`` (its parts submitted now) before its own."""
    prev = ledger.read(stage)
    if prev and prev.job_ids:  # an earlier submission's (its parts' too)
        cancel_jobs([j for j in prev.job_ids if slurm_job_alive(j)])  # e.g. dependents left pending
    job = _sbatch(cfg, run_dir, stage, code_dir, deps)
    job_id = str(job.job_id)
    extra = {"code_dir": str(code_dir), "dependency": deps, "stderr": str(job.paths.stderr)}
    mark_submitted(
        cfg,
        ledger,
        stage,
        "slurm",
        job_ids=[*(pieces or {}).values(), job_id],
        log=str(job.paths.stdout),
        extra={**extra, "parts": pieces} if pieces else extra,
    )
    ledger.event("submitted", stage, job_id=job_id, dependency=deps)
    return job_id


SERVICE_MEM = "1GB"
"""Memory of a service job: enough for a search controller, and explicit, so a cluster whose default is a
whole node's memory does not block a node for it."""
SERVICE_TIMEOUTS = 100
"""How often a service job may requeue itself at its time limit (its state is on disk: each restart resumes)."""


def submit_service(
    cfg: PipelineConfig, folder: Path, name: str, setup: list[str], fn: Callable[..., Any], *args: Any
) -> str:
    """A one-CPU job running ``fn(*args)`` for as long as it has work (a search's controller): the cluster
    profile's partition, account, qos and ``time_min``; requeued by SLURM on node failure and preemption, and
    by submitit at its time limit (``fn`` a submitit Checkpointable). ``setup``: shell lines before it runs.
    Returns the job id; SubmitError with SLURM's message and the fix."""
    import submitit

    c = cfg.cluster
    ex = submitit.SlurmExecutor(folder=folder / "%j", max_num_timeout=SERVICE_TIMEOUTS)
    params: dict[str, Any] = {
        "job_name": name,
        "nodes": 1,
        "ntasks_per_node": 1,
        "cpus_per_task": 1,
        "mem": SERVICE_MEM,
        "time": c.time_min,
        "signal_delay_s": c.signal_delay_s,
        "setup": [*c.setup, *setup],
        "additional_parameters": {"requeue": True},
    }
    params |= {key: getattr(c, key) for key in ("partition", "account", "qos") if getattr(c, key)}
    ex.update_parameters(**params)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return str(ex.submit(fn, *args).job_id)
    except (OSError, RuntimeError) as e:
        msg = _one_line(str(e) or captured.getvalue() or type(e).__name__)
        raise SubmitError(f"sbatch rejected {name!r}: {msg}; fix: {fix_for(msg)}") from None


def _undo(ledger: Ledger, jobs: dict[str, str], failed: str, error: str, spawned: list[str]) -> None:
    """A stage's submission failed: cancel this submission's jobs (stages' and parts') and say so in the
    ledger, so that status reads the run directory and the same command resubmits everything."""
    cancel_jobs([*jobs.values(), *spawned])
    for s in jobs:
        ledger.update(s, status=CANCELLED, ended_at=time.time(), error=f"not run: submitting {failed} failed")
    ledger.update(failed, status=FAILED, ended_at=time.time(), error=f"submission failed: {error}")
    ledger.event("submit_failed", failed, error=error, cancelled=[*jobs.values(), *spawned])


def follow(
    cfg: PipelineConfig, run_dir: Path, stages: list[str], *, out: TextIO = sys.stdout, poll_s: float = 2.0
) -> int:
    """Wait until every stage completed or one will not, drawing progress from metrics files."""
    from pipeline.reporting.status import run_status

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
