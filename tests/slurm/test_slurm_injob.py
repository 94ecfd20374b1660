"""In-job restart on the real local SLURM cluster (``cluster.injob_restarts``, pipeline/submit/injob.py): one
rank of a running 2-node pretrain job is killed from outside (SIGKILL of its process, its node healthy), or
hangs (an injected fault: its watchdog ends it); every rank starts again inside the same allocation from the
newest checkpoint (one SLURM run of the job, no requeue) and the stage completes. The same kill with
``injob_restarts=0`` goes through the queue (a requeue); the test prints the time from the kill to the first new
training step for both paths (``-s`` shows them)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from engine.runtime.fault_injection import ENV as FAULT_ENV
from pipeline.records.ledger import Ledger, read_metrics
from tests.support.slurm_cluster import wait_for
from tests.support.slurm_helpers import (
    TINY,
    TWO_NODES,
    events,
    fail_text,
    hostnames,
    pipeline,
    run_dirs,
    run_story,
    submitted,
    wait_sacct,
    wait_settled,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

ARGS = [*TINY, *TWO_NODES, "run.stages=[data_prep,pretrain]", "pretrain.iters=200", "pretrain.log_interval=1"]


def _rank_process(cluster: Any, node: str) -> psutil.Process | None:
    """The rank's own process on ``node`` (submitit's task process, not a supervisor around it)."""
    for pid in cluster.node_processes(node):
        try:
            proc = psutil.Process(pid)
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "submitit.core._submit" in cmd and "pipeline.submit.injob" not in cmd:
            return proc
    return None


def _run(cluster: Any, tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[Path, str]:
    r = pipeline(cluster, *ARGS, "pretrain.save_interval=10", *extra, f"run.root={tmp_path}", env=env)
    assert r.returncode == 0, fail_text(r)
    return run_dirs(r.stdout)[0], submitted(r.stdout)["pretrain"]


def _completed(run_dir: Path) -> None:
    views = wait_settled(run_dir, ["data_prep", "pretrain"], 500)
    assert views["pretrain"].state == "completed", run_story(run_dir)


def _restarted_inside_the_job(cluster: Any, run_dir: Path, job: str) -> None:
    """The stage completed in one SLURM run of its job, started twice in it, resumed from a checkpoint."""
    _completed(run_dir)
    wait_sacct(cluster, job, ["COMPLETED"], run_dir=run_dir)  # one run of the job: no trip through the queue
    starts = events(run_dir, "started", "pretrain")
    assert [(e["restarts"], e["injob"]) for e in starts] == [(0, 0), (0, 1)], starts
    assert events(run_dir, "injob_restart", "pretrain"), run_story(run_dir)
    resume = [x for x in read_metrics(run_dir, "pretrain") if x["kind"] == "resume"]
    # from the newest complete checkpoint (every 10 steps; the one being written when the fault came may not be)
    assert resume and resume[-1]["checkpoint"] and resume[-1]["from_step"] in (10, 20, 30), resume


def _kill_a_rank_at_step_20(cluster: Any, run_dir: Path, job: str) -> float:
    """SIGKILL rank 1's process once step 20 is trained; the kill's time."""

    def at_step(step: int) -> str | None:
        done = [x for x in read_metrics(run_dir, "pretrain") if x["kind"] == "train" and x["step"] >= step]
        got = cluster.run("squeue", "-h", "-j", job, "-o", "%N", check=False).stdout.strip()
        return hostnames(cluster, got)[-1] if done and got else None

    node = wait_for(lambda: at_step(20), 300, lambda: run_story(run_dir))
    victim = wait_for(lambda: _rank_process(cluster, node), 30, lambda: f"no rank process on {node}")
    killed_at = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    return killed_at


def _first_step_after(run_dir: Path, t: float) -> float:
    return (
        min(x["time"] for x in read_metrics(run_dir, "pretrain") if x["kind"] == "train" and x["time"] > t)
        - t
    )


def test_a_killed_rank_restarts_inside_the_job_faster_than_a_requeue(cluster: Any, tmp_path: Path) -> None:
    run_dir, job = _run(cluster, tmp_path / "injob", "cluster.injob_restarts=2")
    killed_at = _kill_a_rank_at_step_20(cluster, run_dir, job)
    _restarted_inside_the_job(cluster, run_dir, job)
    injob_s = _first_step_after(run_dir, killed_at)

    run_dir, job = _run(cluster, tmp_path / "requeue", "cluster.injob_restarts=0")
    killed_at = _kill_a_rank_at_step_20(cluster, run_dir, job)
    _completed(run_dir)
    # requeued by SLURM: its second run has SLURM_RESTART_COUNT 1 (accounting under load may keep one record)
    starts = events(run_dir, "started", "pretrain")
    assert [(e["restarts"], e["injob"]) for e in starts] == [(0, 0), (1, 0)], starts
    requeue_s = _first_step_after(run_dir, killed_at)
    print(
        f"\nkill of a rank -> first new training step: in-job restart {injob_s:.1f} s, requeue {requeue_s:.1f} s"
    )


def test_a_hung_rank_restarts_inside_the_job(cluster: Any, tmp_path: Path) -> None:
    """Rank 1 stops making progress at step 25; its watchdog records a hang and exits without a requeue."""
    run_dir, job = _run(
        cluster,
        tmp_path,
        "cluster.injob_restarts=2",
        "pretrain.hang_timeout_s=10",
        env={FAULT_ENV: "hang@step:25/rank=1"},
    )
    _restarted_inside_the_job(cluster, run_dir, job)
    rec = Ledger(run_dir).read("pretrain")
    assert rec is not None and "hang" in [f["cause"] for f in rec.failures], rec.failures
