"""One trial of a search on disk: its record file, its submission, its state, and how it is stopped.

A trial is the project's ordinary command, ``python -m pipeline <base> <key=value ...>``, started in its own
session (it survives its controller), writing its own run directory. ``<sweep>/.search/trials/<n>.json``
(written atomically, before and right after the start) names the trial's run directory and process, so a
re-started controller adopts it instead of submitting it again. Its state comes from that process and the
run's ledger: local trials follow their stages, so a live process is a running trial; a SLURM trial's process
ends after submission, and its jobs are then asked about with every other trial's in one query.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.records.files import atomic_write_text
from pipeline.records.ledger import ACTIVE, COMPLETED, Ledger

RUNNING, COMPLETE, FAILED, CUT_OFF = "running", "complete", "failed", "cut off"
MAX_COMMANDS = 3
"""A trial's command is started at most this often (a command that keeps dying is a failed trial)."""
SCHEDULER_ENV = ("SLURM_", "SLURMD_", "SRUN_", "SBATCH_", "SUBMITIT_")
"""Variables of a SLURM job (the controller's) kept from the trial commands it starts (submitit's clean_env),
except ``SLURM_CONF``: where the cluster's configuration is."""
PROJECT = Path(__file__).resolve().parents[2]
"""The checkout the trial commands import ``pipeline`` from (the controller's own)."""


@dataclass
class TrialFile:
    """``.search/trials/<number>.json``: what the controller needs to adopt a trial after a restart."""

    number: int
    overrides: list[str]
    run_dir: str
    stages: list[str]
    executor: str
    pid: int | None = None
    start: float | None = None
    submitted_at: float | None = None
    ended: str | None = None
    """None while in flight; complete, failed, pruned or cancelled once the study knows."""
    pruned: dict[str, Any] = field(default_factory=dict)
    commands: int = 0
    """How often its command was started (again when a restarted controller finds it cut off mid-submission)."""

    @property
    def path_dir(self) -> Path:
        return Path(self.run_dir)


def trials_dir(sweep: Path) -> Path:
    return sweep / ".search" / "trials"


def save(sweep: Path, t: TrialFile) -> None:
    d = trials_dir(sweep)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_text(d / f"{t.number}.json", json.dumps(asdict(t), indent=1))


def load(sweep: Path, number: int) -> TrialFile | None:
    p = trials_dir(sweep) / f"{number}.json"
    if not p.is_file():
        return None
    return TrialFile(**json.loads(p.read_text()))


def load_all(sweep: Path) -> list[TrialFile]:
    d = trials_dir(sweep)
    files = sorted(d.glob("*.json"), key=lambda p: int(p.stem)) if d.is_dir() else []
    return [TrialFile(**json.loads(p.read_text())) for p in files]


def process_start(pid: int | None) -> float | None:
    """Start time of live process ``pid`` (None: gone or a zombie); a PID alone can be reused."""
    import psutil

    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(proc.create_time())
    except psutil.Error:
        return None


def alive(pid: int | None, start: float | None) -> bool:
    s = process_start(pid)
    return s is not None and start is not None and abs(s - start) < 1e-3


def submit(
    sweep: Path, t: TrialFile, prefork_socket: str | None = None, env: dict[str, str] | None = None
) -> None:
    """Start the trial's command in its own session, its output in ``.search/logs/<n>.log``; with
    ``prefork_socket`` its local ranks are forked by that (the controller's) prefork server. ``env``: the
    environment it starts from (default: this process's), the one the server was started in: libraries the
    controller imports later set import-time variables (fANOVA's scikit-learn: ``KMP_*``), which would make
    the server refuse the trial's ranks."""
    logs = sweep / ".search" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = dict(os.environ if env is None else env)
    paths = base.get("PYTHONPATH", "").split(os.pathsep)
    # the controller's own PYTHONPATH when it leads with the project: a variable the prefork server compares
    pythonpath = os.pathsep.join(paths if paths[0] == str(PROJECT) else [str(PROJECT), *paths])
    env = {**base, "PYTHONPATH": pythonpath}
    if t.executor == "slurm":  # a job submitted from a job (the controller's) must not inherit its settings
        env = {k: v for k, v in env.items() if not k.startswith(SCHEDULER_ENV) or k == "SLURM_CONF"}
    with open(logs / f"{t.number}.log", "ab") as log:
        shared = [f"cluster.prefork_socket={prefork_socket}"] if prefork_socket else []
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", *t.overrides, *shared],
            cwd=PROJECT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    t.pid, t.start, t.commands = proc.pid, process_start(proc.pid), t.commands + 1
    t.submitted_at = t.submitted_at or time.time()
    save(sweep, t)


def job_ids(t: TrialFile) -> list[str]:
    """The SLURM jobs of a trial's active stages (one query asks about every trial's together)."""
    ledger = Ledger(t.path_dir)
    return [j for r in ledger.records(t.stages).values() if r and r.status in ACTIVE for j in r.job_ids]


def state(t: TrialFile, alive_jobs: set[str] | None) -> tuple[str, str]:
    """(running | complete | failed | cut off, why) of an in-flight trial; cut off: a SLURM trial whose command
    ended before it had submitted every stage, while the submitted ones still run (its command is idempotent:
    started again, it submits the rest after those). ``alive_jobs`` None: SLURM could not be asked this poll,
    so a SLURM trial not settled by its ledger counts as running (the next poll asks again)."""
    if alive(t.pid, t.start):
        return RUNNING, ""
    records = Ledger(t.path_dir).records(t.stages)
    if all(r is not None and r.status == COMPLETED for r in records.values()):
        return COMPLETE, ""
    bad = [
        f"{s}: {r.status} ({r.error or 'no error recorded'})"
        for s, r in records.items()
        if r and r.status not in (*ACTIVE, COMPLETED)
    ]
    if bad:
        return FAILED, "; ".join(bad)
    if t.executor == "slurm":
        # its command died before submitting every stage (e.g. with a requeued controller's job): start it again
        if any(r is None for r in records.values()) and t.commands < MAX_COMMANDS:
            return CUT_OFF, ""
        if alive_jobs is None or any(j in alive_jobs for j in job_ids(t)):
            return RUNNING, ""
    return FAILED, f"the trial's command ended before its stages completed (log: .search/logs/{t.number}.log)"


def stop(t: TrialFile, kind: str, stage: str | None = None, **data: Any) -> None:
    """Stop a trial: its queued and running jobs cancelled (the ledger first, so no job requeues or marks itself
    failed), its command's session ended, and the ledger's event ``kind`` (pruned, cancelled) with ``data``."""
    from pipeline.cli.cancel import cancel_run

    ledger = Ledger(t.path_dir)
    for s in cancel_run(t.path_dir) if t.path_dir.is_dir() else []:
        ledger.update(
            s, error=f"{kind} by the search" + (f" at step {data['step']}" if "step" in data else "")
        )
    if alive(t.pid, t.start) and t.pid is not None:
        try:
            os.killpg(t.pid, signal.SIGTERM)  # the command's session: it and the local jobs it follows
        except ProcessLookupError:
            pass
    if t.path_dir.is_dir():
        ledger.event(kind, stage, trial=t.number, **data)
