"""``python -m pipeline.cancel <run_dir>``: cancel the run's queued and running jobs and mark them cancelled."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from pipeline.records.ledger import ACTIVE, CANCELLED, Ledger
from pipeline.schema.graph import STAGES


def cancel_run(run_dir: Path) -> list[str]:
    """Cancel every active stage's job; returns the stages cancelled."""
    ledger = Ledger(run_dir)
    done = []
    for s in STAGES:
        with ledger.lock():  # read and mark as one step: a job or a re-run updating the record waits
            rec = ledger.read(s)
            if not rec or rec.status not in ACTIVE:
                continue
            # ledger first: a running job stopped by the cancel sees it and neither requeues nor marks itself failed
            ledger.update(s, status=CANCELLED, ended_at=time.time(), error="cancelled by user")
        _cancel_jobs(rec.executor, rec.job_ids)
        ledger.event("cancelled", s, job_ids=rec.job_ids)
        done.append(s)
    return done


def _cancel_jobs(executor: str, job_ids: list[str]) -> None:
    if executor == "slurm":
        from pipeline.submit.slurm import cancel_jobs

        cancel_jobs(job_ids)
    elif executor == "local":
        for j in job_ids:
            if j.isdigit():
                try:
                    os.kill(int(j), signal.SIGTERM)
                except ProcessLookupError:
                    pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.cancel", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a run directory (runs/<name>-<hash>)")
    a = p.parse_args(argv)
    if not (a.run_dir / "ledger").is_dir():
        from pipeline.cli.compose import not_a_run_dir

        return not_a_run_dir(a.run_dir)
    done = cancel_run(a.run_dir)
    print(f"cancelled: {', '.join(done)}" if done else "nothing to cancel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
