"""What a job process learns from, and asks of, the machine and its scheduler.

Bottom layer (imports nothing from the project): the launcher records requeues with these, the engine's
hang watchdog asks SLURM for a requeue with them, and ranks pick rendezvous ports with ``free_port``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess

RELAY_ENV = "PIPELINE_PREFORK_RELAY"
"""Set in a rank forked by a prefork server (pipeline.submit.prefork): the pid of its relay (the local
controller's child, where a plain rank would be)."""


def free_port() -> int:
    """A TCP port free on this machine now (for the local executor's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def in_slurm_job() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def requeue_self(reason: str) -> bool:
    """Ask SLURM to requeue this job (no-op outside SLURM). Returns whether the request went through."""
    job = _this_job()
    if not job:
        return False
    print(f"[requeue] asking SLURM to requeue job {job}: {reason}", flush=True)
    return _scontrol("requeue", job)


def requeue_excluding(nodes: list[str], reason: str) -> bool:
    """Requeue this job so that it never runs on ``nodes`` again: held first (a running job's ExcNodeList
    cannot change), its ExcNodeList set, then released. SIGTERM is ignored meanwhile: the hold ends this job's
    processes, this one included, and the job must not stay held. Returns whether the job is requeued."""
    job = _this_job()
    if not job:
        return False
    print(f"[requeue] job {job} without {','.join(nodes)}: {reason}", flush=True)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if not _scontrol("requeuehold", job):
            return False
        excluded = _scontrol("update", f"JobId={job}", f"ExcNodeList={','.join(nodes)}")
        return _scontrol("release", job) and excluded
    finally:
        signal.signal(signal.SIGTERM, previous)


def exclusion_blocked(nodes: list[str]) -> str | None:
    """Why this job cannot be requeued without ``nodes`` (None: it can, or SLURM could not be asked): too few
    of its partition's nodes would be left outside its ExcNodeList and ``nodes`` (SLURM would hold it pending
    forever, BadConstraints)."""
    job = _this_job()
    info = _query("scontrol", "show", "job", job) if job else None
    if not info:
        return None
    fields = dict(kv.split("=", 1) for kv in info.split() if "=" in kv)
    partition, needed = fields.get("Partition", ""), fields.get("NumNodes", "").split("-")[0]
    every = _query("sinfo", "-h", "-N", "-p", partition, "-o", "%N")
    if not every or not needed.isdigit():
        return None
    off = set(nodes) | set(_hostnames(fields.get("ExcNodeList", "(null)")))
    left = sorted(set(every.split()) - off)
    if len(left) >= int(needed):
        return None
    return (
        f"partition {partition} would have {len(left)} node(s) left ({','.join(left) or 'none'}) outside "
        f"{','.join(sorted(off))} for a job of {needed}"
    )


def _hostnames(hostlist: str) -> list[str]:
    if hostlist in ("", "(null)"):
        return []
    return (_query("scontrol", "show", "hostnames", hostlist) or "").split()


def _query(*cmd: str) -> str | None:
    """A SLURM command's output (None when it fails)."""
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def cancelled_by_scancel() -> bool:
    """Someone ran ``scancel`` on this job: its SIGTERM is no preemption, and the job must not requeue itself.
    While the job's processes are being ended slurmctld shows it only as COMPLETING; the accounting has it as
    ``CANCELLED by <uid>`` at once (a preemption: PREEMPTED, a time limit: TIMEOUT). False outside SLURM or when
    SLURM cannot be asked."""
    job = _this_job()
    if not job:
        return False
    for cmd in (["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], ["scontrol", "show", "job", job]):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        states = (
            r.stdout.split()
            if cmd[0] == "sacct"
            else [w[9:] for w in r.stdout.split() if w.startswith("JobState=")]
        )
        if r.returncode == 0 and any(s.startswith("CANCELLED") for s in states):
            return True
    return False


def _this_job() -> str | None:
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return job


def _scontrol(*args: str) -> bool:
    try:
        r = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"[requeue] scontrol {args[0]} failed: {e}", flush=True)
        return False
    if r.returncode != 0:
        print(f"[requeue] scontrol {args[0]} said: {r.stderr.strip()}", flush=True)
    return r.returncode == 0


def restart_count() -> int:
    """How many times SLURM restarted this job (0 on the first run and outside SLURM)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
