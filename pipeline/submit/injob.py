"""In-job restart (``cluster.injob_restarts``): each SLURM task of a stage's job runs its rank under this small
supervisor, which starts the rank again inside the same allocation when it dies.

    python -m pipeline.submit.injob RESTARTS PYTHON -u -m submitit.core._submit FOLDER   (submitit's srun line)

A rank killed from outside ends with a signal; the other ranks see their collectives fail (gloo/NCCL: the
peer's connections close) and exit with an error. Every task's supervisor then starts its rank again (the
job's rendezvous, its newest checkpoint: pipeline.submit.launch.run_stage resumes as after any restart), up to
RESTARTS times; no trip through the queue. A rank that knows in-job restarts are left (``INJOB_LEFT`` in its
environment, read once at its entry) records its failure and exits instead of asking SLURM for a requeue.
A signal to the task (preemption, time limit, scancel) goes to the rank, and nothing is restarted after it:
the job's own requeue handling applies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import FrameType

INJOB_ENV = "PIPELINE_INJOB_ATTEMPT"
"""The rank's in-job attempt (0: the first start in this allocation)."""
LEFT_ENV = "PIPELINE_INJOB_LEFT"
"""In-job restarts still left after this attempt."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    restarts, cmd = int(args[0]), args[1:]
    signalled: list[int] = []
    child: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if signum != signal.SIGCONT:
            signalled.append(signum)
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    rc = 1
    try:
        for attempt in range(restarts + 1):
            env = {**os.environ, INJOB_ENV: str(attempt), LEFT_ENV: str(restarts - attempt)}
            child[:] = [subprocess.Popen(cmd, env=env)]
            rc = child[0].wait()
            if rc == 0 or signalled or attempt == restarts:
                break
            print(
                f"[injob] {time.strftime('%H:%M:%S')} rank process exited with {rc}: starting it again inside "
                f"the job (in-job restart {attempt + 1} of {restarts})",
                flush=True,
            )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
