"""A user's own ``scancel`` of a running stage on the real local SLURM cluster (not ``python -m pipeline.cancel``):
a plain ``scancel`` is the user's decision, recorded as ``cancelled`` and never requeued; ``scancel
--signal=INT`` is Ctrl-C: the stage saves at its next step and stops, and the same command resumes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.records.ledger import Ledger, read_metrics
from tests.support.slurm_cluster import wait_for
from tests.support.slurm_helpers import (
    TINY,
    events,
    fail_text,
    pipeline,
    run_dirs,
    run_story,
    sacct,
    submitted,
    wait_settled,
)
from tests.support.timing import scaled

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

ARGS = [*TINY, "run.stages=[data_prep,pretrain]", "pretrain.iters=1000", "pretrain.save_interval=5000"]


def _ended(cluster: Any, run_dir: Path, job: str) -> Any:
    """Wait until pretrain's record has left the running states and its job has left the queue."""

    def ended() -> Any:
        rec = Ledger(run_dir).read("pretrain")
        queued = cluster.run("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()
        return rec if rec and rec.status not in ("submitted", "running", "requeued") and not queued else None

    return wait_for(ended, scaled(300), lambda: run_story(run_dir), interval=1.0)


def _running_at(cluster: Any, root: Path, step: int) -> tuple[Path, str]:
    """Submit the run and wait until pretrain has trained ``step`` steps; (run dir, pretrain's job id)."""
    r = pipeline(cluster, *ARGS, f"run.root={root}")
    assert r.returncode == 0, fail_text(r)
    run_dir, job = run_dirs(r.stdout)[0], submitted(r.stdout)["pretrain"]

    def trained() -> bool:
        return any(x["kind"] == "train" and x["step"] >= step for x in read_metrics(run_dir, "pretrain"))

    wait_for(trained, scaled(300), lambda: run_story(run_dir))
    return run_dir, job


def test_a_users_scancel_is_recorded_as_cancelled_and_never_requeued(cluster: Any, tmp_path: Path) -> None:
    run_dir, job = _running_at(cluster, tmp_path, 5)
    cluster.run("scancel", job)
    rec = _ended(cluster, run_dir, job)
    assert rec.status == "cancelled" and not rec.failures, run_story(run_dir)  # no failure: nothing to retry
    ev = events(run_dir, "stopped", "pretrain")
    assert [(e["reason"], e.get("by")) for e in ev] == [("cancelled", "scancel")], ev
    assert not events(run_dir, "requeued", "pretrain"), run_story(run_dir)
    assert sacct(cluster, job) == ["CANCELLED"] or all(s.startswith("CANCELLED") for s in sacct(cluster, job))


def test_scancel_signal_int_is_ctrl_c_and_the_same_command_resumes(cluster: Any, tmp_path: Path) -> None:
    run_dir, job = _running_at(cluster, tmp_path, 5)
    cluster.run("scancel", "--signal=INT", job)
    rec = _ended(cluster, run_dir, job)
    assert rec.status == "stopped" and [f["cause"] for f in rec.failures] == ["interrupted"], rec.failures
    saved = rec.extra.get("stopped_at_step")
    assert saved and saved >= 5, rec.extra
    assert not events(run_dir, "requeued", "pretrain"), run_story(run_dir)
    again = pipeline(cluster, *ARGS, f"run.root={tmp_path}")  # the same command: resumes the stage
    assert again.returncode == 0 and list(submitted(again.stdout)) == ["pretrain"], fail_text(again)
    views = wait_settled(run_dir, ["data_prep", "pretrain"], scaled(400))
    assert views["pretrain"].state == "completed", run_story(run_dir)
    resume = [x for x in read_metrics(run_dir, "pretrain") if x["kind"] == "resume"]
    assert [(x["from_step"], x["steps_lost"]) for x in resume] == [(saved, 0)], resume
