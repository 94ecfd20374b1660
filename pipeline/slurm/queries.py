"""SLURM job state queries and cancellation (``squeue``/``sacct``/``scancel``): read by status, cancel and submission.

States come from ``sacct`` (with ``squeue`` as a fallback). A job that SLURM is requeueing shows NODE_FAIL
for a few seconds before PENDING; submitit takes that as final, so we never do: requeued jobs are alive.
"""

from __future__ import annotations

import subprocess

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
    if state == "NODE_FAIL":  # out of the queue: SLURM did not requeue it (a requeued job stays queued)
        return "FAILED", "node failure, not requeued", len(rows)
    return state, rows[-1][1] if len(rows[-1]) > 1 else "", len(rows)


def slurm_job_alive(job_id: str) -> bool:
    state, reason, _ = job_state(job_id)
    if state == "PENDING" and "DependencyNeverSatisfied" in reason:
        return False
    return state in ALIVE_STATES


def cancel_jobs(job_ids: list[str]) -> None:
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=60)


def exclude_nodes(job_ids: list[str], nodes: list[str]) -> list[str]:
    """Keep pending jobs off ``nodes`` (their ExcNodeList; a running job's cannot change). Returns those set."""
    done = []
    for j in job_ids:
        r = subprocess.run(
            ["scontrol", "update", f"JobId={j}", f"ExcNodeList={','.join(nodes)}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode == 0:
            done.append(j)
    return done


def alive_jobs(job_ids: list[str]) -> set[str] | None:
    """Which of ``job_ids`` will still run: one ``squeue`` for all of them, and one ``sacct`` for those it no
    longer lists (a search polls every trial's jobs together, never one query per job). None when a query
    failed (slurmctld busy, the query killed with its caller's job): unknown is not dead."""
    ids = sorted({j for j in job_ids if j})
    if not ids:
        return set()
    out = _run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i|%T|%r"])
    if out is None:
        return None
    alive: set[str] = set()
    for line in out.splitlines():
        jid, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if state in ALIVE_STATES and "DependencyNeverSatisfied" not in reason:
            alive.add(jid)
    rest_ids = [j for j in ids if j not in alive and j not in {ln.split("|")[0] for ln in out.splitlines()}]
    if rest_ids:  # left the queue between two polls, or requeueing: sacct's last row decides
        acct = _run(["sacct", "-n", "-P", "-D", "-X", "-j", ",".join(rest_ids), "-o", "JobID,State"])
        if acct is None:
            return None
        last = {}
        for line in acct.splitlines():
            jid, _, state = line.strip().partition("|")
            last[jid] = state.split()[0] if state else ""
        alive |= {j for j, s in last.items() if s in ALIVE_STATES and s != "NODE_FAIL"}
    return alive
