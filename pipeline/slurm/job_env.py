"""What a job process learns from, and asks of, the machine and its scheduler.

Bottom layer (imports nothing from the project): the launcher records requeues with these, the engine's
hang watchdog asks SLURM for a requeue with them, and ranks pick rendezvous ports with ``free_port``.
"""

from __future__ import annotations

import os
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
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    if os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    print(f"[requeue] asking SLURM to requeue job {job}: {reason}", flush=True)
    try:
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"[requeue] failed: {e}", flush=True)
        return False
    if r.returncode != 0:
        print(f"[requeue] scontrol said: {r.stderr.strip()}", flush=True)
    return r.returncode == 0


def restart_count() -> int:
    """How many times SLURM restarted this job (0 on the first run and outside SLURM)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
