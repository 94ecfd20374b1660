"""A node dies under the pretrain job on the real local SLURM cluster (tests/support/slurm_cluster.py).

The emulated node running pretrain's rank 0 (a 2-node, dp=2 job) is killed mid-training; SLURM marks the job
NODE_FAIL and requeues it (``--requeue``), it runs again on the two surviving nodes, resumes from its newest
checkpoint, and the graph (data_prep -> pretrain -> sft, afterok) completes with pretrain's final weights and
optimizer state bit-identical to an uninterrupted run. No ``checkpoint()`` call and no requeue request come
from the job itself: recovery rests on the periodic checkpoints and on the pipeline not taking SLURM's
transient NODE_FAIL as final.

To kill at a known point on a loaded machine, the faulted run holds every rank before step ``HANG_AT``
(``PIPELINE_FAULT=hang@step:7``: a sleep that changes no state and fires once per stage directory, so the
rerun passes it); the node is killed while the job sits there, two steps past the checkpoint of step 4.
Run with ``-s`` to see the measured recovery times.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pipeline.records.ledger import Ledger
from pipeline.reporting.status import run_status
from tests.support.slurm_cluster import wait_for
from tests.support.slurm_helpers import (
    SETTLED,
    TWO_NODES,
    describe_status,
    events,
    fail_text,
    hostnames,
    pipeline,
    run_dirs,
    submitted,
    wait_sacct,
    wait_settled,
)
from tests.support.timing import scaled
from tests.support.weights import assert_identical, tensors_at

pytestmark = pytest.mark.slurm

ITERS, SAVE_INTERVAL, HANG_AT = 12, 4, 7
LAST_SAVE_BEFORE_KILL = (HANG_AT - 1) // SAVE_INTERVAL * SAVE_INTERVAL
ARGS = [
    "experiment=tiny",
    "cluster=slurm",
    f"pretrain.iters={ITERS}",
    f"pretrain.save_interval={SAVE_INTERVAL}",
    "sft.save_interval=4",
    *TWO_NODES,
]
GRAPH = ["data_prep", "pretrain", "sft"]


@pytest.mark.timeout(600)
def test_node_killed_mid_pretrain_is_requeued_resumed_and_matches_uninterrupted_run(
    cluster: Any, tmp_path: Path
) -> None:
    baseline = _completed_run(cluster, tmp_path / "baseline", ["data_prep", "pretrain"])
    root = _seeded_with_data_prep(baseline, tmp_path / "faulted")
    r = pipeline(
        cluster,
        *ARGS,
        f"run.root={root}",
        f"run.stages=[{','.join(GRAPH)}]",
        env={"PIPELINE_FAULT": f"hang@step:{HANG_AT}"},
    )
    jobs = submitted(r.stdout)
    with _cancelled_on_failure(cluster, list(jobs.values())):  # no hung job left holding nodes
        assert r.returncode == 0, fail_text(r)
        assert "[data_prep] completed earlier with the same config: skipped" in r.stdout, r.stdout
        assert list(jobs) == ["pretrain", "sft"], r.stdout
        [run_dir] = run_dirs(r.stdout)
        victim = _wait_hung_before_step(cluster, run_dir, jobs["pretrain"])[0]  # rank 0's node
        with _node_killed(cluster, victim) as t_kill:
            seen = _pretrain_states_until_settled(run_dir, deadline_s=scaled(420))
    cluster.wait_nodes_idle(deadline_s=scaled(120))  # the dead node is back, every job gone

    views = {v.stage: v for v in run_status(run_dir)}
    assert all(views[s].state == "completed" for s in GRAPH), describe_status(run_dir)
    assert "requeued" in seen and "failed" not in seen and "blocked" not in seen, seen
    wait_sacct(cluster, jobs["pretrain"], ["NODE_FAIL", "COMPLETED"])
    _check_rerun_avoided_the_dead_node(run_dir, victim)
    _check_resume_and_accounting(cluster, run_dir, jobs["pretrain"])
    assert_identical(tensors_at(run_dir, ITERS), tensors_at(baseline, ITERS))
    _report_recovery(cluster, run_dir, t_kill, seen)


# ---------------------------------------------------------------------------- runs


def _completed_run(cluster: Any, root: Path, stages: list[str]) -> Path:
    """Run ``stages`` uninterrupted under ``root``; returns the run directory once all completed."""
    r = pipeline(cluster, *ARGS, f"run.root={root}", f"run.stages=[{','.join(stages)}]")
    with _cancelled_on_failure(cluster, list(submitted(r.stdout).values())):
        assert r.returncode == 0, fail_text(r)
        [run_dir] = run_dirs(r.stdout)
        views = wait_settled(run_dir, stages, deadline_s=scaled(420))
    assert all(views[s].state == "completed" for s in stages), describe_status(run_dir)
    return run_dir


def _seeded_with_data_prep(src_run_dir: Path, root: Path) -> Path:
    """A run root holding ``src_run_dir``'s completed data_prep (outputs and ledger record) only."""
    target = root / src_run_dir.name
    shutil.copytree(src_run_dir / "stages" / "data_prep", target / "stages" / "data_prep")
    (target / "ledger").mkdir(parents=True)
    shutil.copy(src_run_dir / "ledger" / "data_prep.json", target / "ledger" / "data_prep.json")
    return root


@contextmanager
def _cancelled_on_failure(cluster: Any, jobs: list[str]) -> Iterator[None]:
    """scancel ``jobs`` if the block fails: no job is left holding the session's nodes."""
    try:
        yield
    except BaseException:
        cluster.run("scancel", *jobs, check=False)
        raise


@contextmanager
def _node_killed(cluster: Any, node: str) -> Iterator[float]:
    """Kill ``node`` (a hardware failure) and yield the time; bring it back on the way out, so later
    tests in the session have all three nodes."""
    t_kill = time.time()
    cluster.kill_node(node)
    try:
        yield t_kill
    finally:
        if not cluster.node_alive(node):
            cluster.start_node(node)


def _progress_step(run_dir: Path) -> int:
    p = run_dir / "stages" / "pretrain" / "progress.json"
    try:
        return int(json.loads(p.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def _wait_hung_before_step(cluster: Any, run_dir: Path, job: str) -> list[str]:
    """Wait until pretrain's rank 0 finished step HANG_AT - 1 (the ranks then hold); the job's nodes."""
    wait_for(
        lambda: _progress_step(run_dir) == HANG_AT - 1,
        300,
        lambda: f"progress step {_progress_step(run_dir)}; {describe_status(run_dir)}",
    )
    nodelist = cluster.run("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()
    nodes = hostnames(cluster, nodelist)
    assert len(nodes) == 2, nodelist
    [started] = events(run_dir, "started", "pretrain")
    assert started["host"] == nodes[0] and started["restarts"] == 0, (started, nodes)
    return nodes


def _pretrain_states_until_settled(run_dir: Path, deadline_s: float) -> dict[str, float]:
    """Poll pipeline.reporting.status until the graph settles; {pretrain state: first time seen} along the way."""
    seen: dict[str, float] = {}

    def settled() -> bool:
        views = {v.stage: v for v in run_status(run_dir)}
        if "pretrain" in views:
            seen.setdefault(views["pretrain"].state, time.time())
        return all(s in views and views[s].state in SETTLED for s in GRAPH)

    wait_for(
        settled,
        deadline_s,
        lambda: f"{describe_status(run_dir)}; pretrain states seen {list(seen)}",
        interval=1.0,
    )
    return seen


# ---------------------------------------------------------------------------- checks


def _check_rerun_avoided_the_dead_node(run_dir: Path, victim: str) -> None:
    first, second = events(run_dir, "started", "pretrain")
    assert (first["restarts"], second["restarts"]) == (0, 1), (first, second)
    assert first["job_id"] == second["job_id"] and second["host"] != victim, (first, second)


def _check_resume_and_accounting(cluster: Any, run_dir: Path, job: str) -> None:
    """The rerun resumed from the checkpoint before the kill; ledger and ``pipeline.reporting.status`` account for it."""
    [resume] = [m for m in _metrics(run_dir) if m["kind"] == "resume"]
    lost = HANG_AT - 1 - LAST_SAVE_BEFORE_KILL
    assert (resume["from_step"], resume["reached_step"], resume["steps_lost"]) == (
        LAST_SAVE_BEFORE_KILL,
        HANG_AT - 1,
        lost,
    ), resume
    rec = Ledger(run_dir).read("pretrain")
    assert rec and (rec.status, rec.attempts, rec.requeues) == ("completed", 2, 1), rec
    assert rec.outputs["steps"] == ITERS and rec.extra["accounting"]["resumes"] == 1, rec
    st = pipeline(cluster, str(run_dir), module="pipeline.status")
    assert st.returncode == 0, fail_text(st)
    assert re.search(rf"^pretrain\s+completed\s+{job}\s+1\s", st.stdout, flags=re.M), st.stdout
    assert f"attempts 2, resumes 1, steps lost {lost}, failure-to-training" in st.stdout, st.stdout


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "stages" / "pretrain" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _report_recovery(cluster: Any, run_dir: Path, t_kill: float, seen: dict[str, float]) -> None:
    """Print (and keep in the session timings) kill -> requeued -> restarted -> resumed -> first step."""
    m = _metrics(run_dir)
    resume = next(x for x in m if x["kind"] == "resume")
    first_step = next(x for x in m if x["kind"] == "train" and x["step"] == resume["from_step"] + 1)
    restarted = events(run_dir, "started", "pretrain")[1]["time"]
    times = {
        "kill_to_status_requeued_s": seen["requeued"] - t_kill,
        "kill_to_restarted_s": restarted - t_kill,
        "kill_to_resumed_s": resume["time"] - t_kill,
        "kill_to_first_resumed_step_s": first_step["time"] - t_kill,
        "resume_down_s": resume["down_s"],
    }
    cluster.timings.update({k: round(v, 1) for k, v in times.items()})
    print(
        "node failure under pretrain: "
        + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
        + f" (resumed from step {resume['from_step']}, {resume['steps_lost']} steps lost)"
    )
