"""A search end to end with the local executor on the tiny model: the submitting command returns at once, the
controller refills a slot as soon as a trial ends (no barrier), prunes on live valid losses, survives a
``kill -9`` (the same command again: exactly n_trials, none twice, none lost), and status/cancel see it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipeline.records.ledger import Ledger
from pipeline.search import manage, trials
from pipeline.search.launch import controller_alive
from pipeline.search.study import load_study
from tests.support.env import REPO
from tests.support.timing import scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BASE = [
    "experiment=tiny",
    "search=optuna",
    "run.stages=[data_prep,pretrain]",
    "pretrain.min_lr=0",
    "pretrain.eval_interval=2",
    "pretrain.eval_iters=1",
    "search.poll_s=0.5",
    "search.sampler=grid",
    "search.seed=0",
    "search.pruner=none",
]


def launch(root: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "-m", *BASE, f"run.root={root}", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"sweep directory: {root}" in r.stdout or "already runs" in r.stdout, r.stdout
    return r


def wait_for(what: str, cond: Callable[[], bool], root: Path, timeout: float = scaled(400)) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            log = root / ".search" / "controller.log"
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text() if log.is_file() else ''}")
        time.sleep(0.2)


def finished(root: Path, n: int) -> Callable[[], bool]:
    def cond() -> bool:
        if controller_alive(root) or not (root / ".search" / "journal.log").is_file():
            return False
        return len(load_study(root).get_trials(deepcopy=False)) == n

    return cond


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    r = tmp_path / "sweep"
    yield r
    if (r / ".search").is_dir():  # nothing outlives the test: the controller and any trial still in flight
        manage.cancel(r)


def submissions(run_dir: Path) -> int:
    return sum(
        1 for e in Ledger(run_dir).events() if e.get("event") == "submitted" and e.get("stage") == "pretrain"
    )


def test_async_refill_no_barrier(root: Path) -> None:
    """Grid order (seed 0) starts with the 60-step trial: a short trial's slot goes to the third while the long
    one runs. The controller's prefork server forks every trial's ranks, also those submitted after two trials
    completed (the study's fANOVA importances then import scikit-learn, which sets ``KMP_*`` variables)."""
    launch(root, "pretrain.iters=choice(4,5,6,60)", "search.n_trials=4", "search.max_concurrent=2")
    wait_for("the study to finish", finished(root, 4), root)
    files = {t.number: t for t in trials.load_all(root)}
    assert [t.ended for t in files.values()] == ["complete"] * 4
    study = load_study(root)
    long = next(t for t in study.trials if t.params["pretrain.iters"] == 60)
    third = files[2]
    assert third.submitted_at is not None and files[long.number].submitted_at is not None
    long_end = files[long.number].submitted_at + long.user_attrs["wall_s"]  # type: ignore[operator]
    assert third.submitted_at < long_end - 2, "the third trial waited for the long one: a barrier"
    assert all(submissions(Path(t.run_dir)) == 1 for t in files.values())
    # two trials at once on this machine: each stage's threads capped at its cores // 2
    cap = f"={max(1, len(os.sched_getaffinity(0)) // 2)}"
    want = [f"{s}.threads{cap}" for s in ("data_prep", "pretrain")] if cap == "=1" else []
    assert all([o for o in t.overrides if ".threads=" in o] == want for t in files.values())
    # one prefork server, the controller's, forked every trial's ranks (none started its own, none refused)
    shared = (root / ".search" / "prefork.log").read_text()
    assert "imports done" in shared and "refused" not in shared, shared
    assert not any((Path(t.run_dir) / "jobs" / "prefork.log").exists() for t in files.values())
    best = (root / "best.yaml").read_text()
    assert "overrides:" in best and "pretrain.iters=" in best and "prefork_socket" not in best
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.status", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "trials: 4 (complete 4)" in out and "best: #" in out, out


def test_pruned_then_kill_9_and_resume(root: Path) -> None:
    """Grid order (seed 0): lr 0.005, 1e-7, 0.004, one at a time: the 1e-7 trial is pruned at step 2 against the
    first (the third may be too: the median pruner compares it with the first's step-2 loss); the controller is
    killed (-9) while a trial runs, and the same command finishes the study. 40 steps, so a trial pruned at step 2
    is still training when the restarted controller reads it, on a fast machine too."""
    args = ("pretrain.lr=choice(0.004,1e-7,0.005)", "search.n_trials=3", "search.max_concurrent=1")
    args += ("pretrain.iters=40",)
    args += ("search.pruner=median",)  # the last of two: it wins
    launch(root, *args)
    wait_for("trial 1 to start", lambda: (t := trials.load(root, 1)) is not None and t.pid is not None, root)
    pid = json.loads((root / ".search" / "controller.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for("the controller to die", lambda: not controller_alive(root), root, timeout=scaled(30))
    launch(root, *args)  # the same command: resumes, adopts trial 1
    wait_for("the study to finish", finished(root, 3), root)
    study = load_study(root)
    states = {t.params["pretrain.lr"]: t.state.name for t in study.trials}
    assert len(study.trials) == 3 and states[0.005] == "COMPLETE" and states[1e-7] == "PRUNED", states
    assert states[0.004] in ("COMPLETE", "PRUNED"), states
    files = trials.load_all(root)
    assert [t.number for t in files] == [0, 1, 2]
    assert all(submissions(Path(t.run_dir)) == 1 for t in files), "a trial was submitted twice"
    pruned = next(t for t in files if t.ended == "pruned")
    assert pruned.pruned["step"] == 2
    events = [e for e in Ledger(Path(pruned.run_dir)).events() if e.get("event") == "pruned"]
    assert events and events[0]["step"] == 2 and "value" in events[0]
    rec = Ledger(Path(pruned.run_dir)).read("pretrain")
    assert (
        rec is not None and rec.status == "cancelled" and "pruned by the search at step 2" in str(rec.error)
    )
    assert "adopted" in (root / ".search" / "controller.log").read_text()


def test_cancel_stops_controller_and_trials(root: Path) -> None:
    launch(root, "pretrain.iters=choice(60,61)", "search.n_trials=2", "search.max_concurrent=2")
    wait_for("both trials to start", lambda: len([t for t in trials.load_all(root) if t.pid]) == 2, root)
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.cancel", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert r.returncode == 0 and "trials stopped: [0, 1]" in r.stdout, r.stdout + r.stderr
    assert not controller_alive(root)
    files = trials.load_all(root)
    assert all(t.ended == "cancelled" and not trials.alive(t.pid, t.start) for t in files)
    assert {t.state.name for t in load_study(root).trials} == {"FAIL"}


def test_a_search_on_an_in_training_task_prunes_on_that_tasks_values(root: Path, tmp_path: Path) -> None:
    """search.objective=pretrain.task.local_mc.acc (maximize): the pruner's rungs are the task's in-training
    values at each validation, not the valid losses; the trial's score is the value at the end of training."""
    from pipeline.search.registry import task_values
    from tests.support.lm_tasks import write_tasks

    tasks = write_tasks(tmp_path / "tasks")
    launch(
        root,
        "pretrain.lr=choice(0.004,0.005)",
        "pretrain.iters=4",
        "pretrain.eval_tasks=[local_mc]",
        "pretrain.eval_task_limit=2",
        f"eval.task_paths=[{tasks}]",
        "search.objective=pretrain.task.local_mc.acc",
        "search.direction=maximize",
        "search.pruner=median",
        "search.n_trials=2",
        "search.max_concurrent=1",
    )
    wait_for("the study to finish", finished(root, 2), root)
    for t, tf in zip(load_study(root).trials, trials.load_all(root)):
        values = task_values(Path(tf.run_dir) / "stages" / "pretrain" / "metrics.jsonl", "local_mc", "acc")
        assert [s for s, _ in values] == [2, 4] and t.intermediate_values == dict(values), t
        if t.state.name == "COMPLETE":
            assert t.value == values[-1][1]
