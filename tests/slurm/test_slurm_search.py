"""A search on the real local SLURM cluster: the controller is a SLURM job of its own; each trial's command
submits its stage graph and returns, the controller asks SLURM about every trial's jobs together; a slot is
refilled while a long trial still runs; the controller's job requeued by SLURM resumes by itself, killed
(SIGKILL) it resumes with the same command again, and the study ends with exactly n_trials, each submitted
once; a pruned trial's job is cancelled in SLURM and recorded in its ledger."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from pipeline.records.ledger import Ledger
from pipeline.search import manage, trials
from pipeline.search.launch import controller_alive, controller_job
from pipeline.search.study import load_study
from pipeline.slurm.queries import job_state
from tests.search.test_search_local import BASE, finished, submissions, wait_for
from tests.support.slurm_helpers import pipeline
from tests.support.timing import scaled

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

SLURM = [*BASE, "cluster=slurm", "pretrain.save_interval=60"]


def launch(cluster: Any, root: Path, *args: str) -> None:
    r = pipeline(cluster, "-m", *SLURM, f"run.root={root}", *args)
    assert r.returncode == 0, r.stdout + r.stderr


def test_refill_requeue_cancel_and_resume_on_slurm(cluster: Any, tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    args = ("pretrain.iters=choice(4,5,300)", "search.n_trials=3", "search.max_concurrent=2")
    try:
        launch(cluster, root, *args)
        job = controller_job(root)
        assert job is not None and controller_alive(root)
        wait_for(
            "trial 1 to start", lambda: (t := trials.load(root, 1)) is not None and t.pid is not None, root
        )
        # requeued by SLURM (as after a node failure or preemption): the same job comes back and resumes
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=scaled(60))
        assert r.returncode == 0, r.stderr
        wait_for(
            "the job to run again", lambda: job_state(job)[2] >= 2 and job_state(job)[0] == "RUNNING", root
        )
        wait_for(
            "the requeued controller to resume",
            lambda: _lines(root, "adopted") >= 1,
            root,
            timeout=scaled(300),
        )
        # killed (SIGKILL, no chance to stop cleanly): the same command again starts a new controller job, which
        # adopts what is in flight
        r = subprocess.run(
            ["scancel", "--signal=KILL", job], capture_output=True, text=True, timeout=scaled(60)
        )
        assert r.returncode == 0, r.stderr
        wait_for("the controller to end", lambda: not controller_alive(root), root, timeout=scaled(60))
        launch(cluster, root, *args)
        assert controller_job(root) not in (None, job)
        wait_for("the study to finish", finished(root, 3), root, timeout=scaled(700))
    finally:
        if (root / ".search").is_dir():
            manage.cancel(root)
    files = {t.number: t for t in trials.load_all(root)}
    assert [t.ended for t in files.values()] == ["complete"] * 3, (
        root / ".search" / "controller.log"
    ).read_text()
    assert all(submissions(Path(t.run_dir)) == 1 for t in files.values()), "a trial was submitted twice"
    long = next(t for t in load_study(root).trials if t.params["pretrain.iters"] == 300)
    long_end = Ledger(Path(files[long.number].run_dir)).read("pretrain")
    assert long_end is not None and long_end.ended_at is not None and files[2].submitted_at is not None
    assert files[2].submitted_at < long_end.ended_at, "the third trial waited for the long one"


def test_pruned_trial_job_cancelled_on_slurm(cluster: Any, tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    # grid order (seed 0): 0.005, then 1e-7, pruned at step 2 against the first (the third point never asked)
    args = ("pretrain.lr=choice(0.004,1e-7,0.005)", "search.n_trials=2", "search.max_concurrent=1")
    try:
        launch(cluster, root, *args, "pretrain.iters=30", "search.pruner=median")
        wait_for("the study to finish", finished(root, 2), root, timeout=scaled(700))
    finally:
        if (root / ".search").is_dir():
            manage.cancel(root)
    states = {t.params["pretrain.lr"]: t.state.name for t in load_study(root).trials}
    assert states == {0.005: "COMPLETE", 1e-7: "PRUNED"}, states
    pruned = next(t for t in trials.load_all(root) if t.ended == "pruned")
    rec = Ledger(Path(pruned.run_dir)).read("pretrain")
    assert rec is not None and rec.status == "cancelled" and "pruned by the search" in str(rec.error)
    wait_for(
        "SLURM to cancel the job",
        lambda: job_state(rec.job_ids[0])[0] == "CANCELLED",
        root,
        timeout=scaled(60),
    )


def test_status_and_cancel_of_a_sweep_on_slurm(cluster: Any, tmp_path: Path) -> None:
    """``pipeline.status <sweep>`` shows the controller and the trials in flight; ``pipeline.cancel <sweep>``
    stops the controller and every trial, whose SLURM jobs end CANCELLED; the study records them failed."""
    root = tmp_path / "sweep"
    args = ("pretrain.iters=choice(100000,100001)", "search.n_trials=2", "search.max_concurrent=2")
    try:
        launch(cluster, root, *args, "pretrain.save_interval=100000")
        wait_for(
            "both trials' pretrain jobs", lambda: len(_pretrain_jobs(root)) == 2, root, timeout=scaled(300)
        )
        st = pipeline(cluster, str(root), module="pipeline.status")
        assert st.returncode == 0 and "controller: running" in st.stdout, st.stdout + st.stderr
        assert "trials: 2 (running 2)" in st.stdout, st.stdout
        c = pipeline(cluster, str(root), module="pipeline.cancel")
        assert c.returncode == 0 and "trials stopped: [0, 1]" in c.stdout, c.stdout + c.stderr
    finally:
        if (root / ".search").is_dir():
            manage.cancel(root)
    assert not controller_alive(root)
    jobs = _pretrain_jobs(root)
    wait_for(
        "SLURM to cancel every trial's job",
        lambda: all(job_state(j)[0] == "CANCELLED" for j in jobs),
        root,
        timeout=scaled(120),
    )
    assert {t.state.name for t in load_study(root).trials} == {"FAIL"}
    st = pipeline(cluster, str(root), module="pipeline.status")
    assert "controller: not running" in st.stdout and "trials: 2 (fail 2)" in st.stdout, st.stdout


def _pretrain_jobs(root: Path) -> list[str]:
    """The SLURM job of each trial's pretrain stage, once submitted."""
    out = []
    for t in trials.load_all(root):
        rec = Ledger(Path(t.run_dir)).read("pretrain") if t.run_dir else None
        if rec is not None and rec.job_ids:
            out.append(rec.job_ids[-1])
    return out


def _lines(root: Path, word: str) -> int:
    log = root / ".search" / "controller.log"
    return sum(word in ln for ln in log.read_text().splitlines()) if log.is_file() else 0
