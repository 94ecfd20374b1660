"""``cluster=slurm`` for real: the stage graph on the local SLURM cluster (tests/support/slurm_cluster.py).

Every test runs ``python -m pipeline ... cluster=slurm`` as a subprocess with the cluster's environment
(SLURM_CONF) and without PYTHONPATH, then polls ``pipeline.reporting.status`` with generous deadlines (2 cores shared
with other work: stage times vary by a factor of 3). ``experiment=tiny`` with checkpoints only at the end.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.records.ledger import Ledger
from pipeline.reporting.status import run_status
from pipeline.schema.graph import DEFAULT_STAGES as STAGES
from pipeline.submit.launch import RENDEZVOUS_PORTS
from tests.support.env import REPO
from tests.support.slurm_cluster import cluster_mod, wait_for
from tests.support.slurm_helpers import (
    TINY,
    TWO_NODES,
    assert_ran_from_snapshot,
    events,
    fail_text,
    hostnames,
    pipeline,
    run_dirs,
    sacct,
    sacct_ends,
    submitted,
    wait_sacct,
    wait_settled,
)
from tests.support.timing import scaled

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(600)
def test_graph_completes_with_two_node_pretrain_and_second_command_submits_nothing(cluster, tmp_path):
    stages = list(STAGES)
    args = [*TINY, *TWO_NODES, f"run.root={tmp_path}", f"run.stages=[{','.join(stages)}]"]
    t0 = time.monotonic()
    r = pipeline(cluster, *args)
    t_submit = time.monotonic() - t0
    assert r.returncode == 0, fail_text(r)
    [run_dir] = run_dirs(r.stdout)
    jobs = submitted(r.stdout)
    assert list(jobs) == stages, r.stdout

    again = pipeline(cluster, *args)  # while the jobs are queued or running
    assert again.returncode == 0, fail_text(again)
    assert not submitted(again.stdout) and "nothing submitted" in again.stdout, again.stdout
    assert "already queued or running" in again.stdout, again.stdout

    views = wait_settled(run_dir, stages, deadline_s=scaled(480))
    t_done = time.monotonic() - t0
    assert all(views[s].state == "completed" for s in stages), views
    st = pipeline(cluster, str(run_dir), module="pipeline.status")
    assert st.returncode == 0, fail_text(st)
    for s in stages:
        # eval lists its models' jobs (graph Stage.parts) before its own
        assert re.search(rf"^{s}\s+completed\s+(?:\d+,)*{jobs[s]}\s", st.stdout, flags=re.M), st.stdout
        wait_sacct(cluster, jobs[s], ["COMPLETED"])
    _check_two_node_pretrain(cluster, run_dir, jobs["pretrain"])
    _check_logs(run_dir, stages)
    assert_ran_from_snapshot(run_dir, stages)
    third = pipeline(cluster, *args)
    assert third.stdout.count("completed earlier with the same config: skipped") == len(stages), third.stdout
    cluster.timings.update(graph_submit_s=round(t_submit, 1), graph_submit_to_done_s=round(t_done, 1))
    print(f"graph {stages}: submitted in {t_submit:.1f}s, all completed {t_done:.1f}s after the command")


def _check_two_node_pretrain(cluster, run_dir: Path, job_id: str) -> None:
    """2 ranks, one per node; MASTER_ADDR = the allocation's first node; the port derived from the job id."""
    rec = Ledger(run_dir).read("pretrain")
    assert rec and rec.plan["nodes"] == 2 and rec.plan["tasks_per_node"] == 1 and rec.plan["world_size"] == 2
    script = (run_dir / "jobs" / "pretrain" / job_id / f"{job_id}_submission.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script, script
    [nodelist] = sacct(cluster, job_id, "NodeList")
    first = hostnames(cluster, nodelist)[0]
    [started] = events(run_dir, "started", "pretrain")
    assert started["world_size"] == 2
    lo, hi = RENDEZVOUS_PORTS
    assert started["master"] == f"{first}:{lo + int(job_id) % (hi - lo)}", (started, nodelist)
    hosts = set()
    for task in (0, 1):
        log = (run_dir / "jobs" / "pretrain" / job_id / f"{job_id}_{task}_log.out").read_text()
        hosts |= set(re.findall(r"JobEnvironment\(job_id=\d+, hostname=(\w+)", log))
    assert len(hosts) == 2 and first in hosts, hosts


def _check_logs(run_dir: Path, stages: list[str]) -> None:
    """The log paths in the ledger are the job's real stdout/stderr files."""
    for s in stages:
        rec = Ledger(run_dir).read(s)
        assert rec and rec.log and "Job completed successfully" in Path(rec.log).read_text(), (s, rec)
        assert Path(rec.extra["stderr"]).exists(), rec.extra


@pytest.mark.timeout(600)
def test_sweep_of_three_trials_each_own_run_dir_then_rerun_submits_nothing(cluster, tmp_path):
    """Hydra multirun: one pipeline per trial; the run hash covers every stage, so each trial has its own
    run directory and its own data_prep (a trial's data_prep cannot be shared with another run directory)."""
    cwd = tmp_path / "cwd"  # the submitter imports the checkout through PYTHONPATH; the jobs must not
    cwd.mkdir()
    root = tmp_path / "runs"
    args = [
        "-m",
        *TINY,
        f"run.root={root}",
        "pretrain.lr=1e-3,2e-3,3e-3",
        "run.stages=[data_prep,pretrain]",
        "pretrain.iters=2",
        "pretrain.warmup_iters=0",
        "pretrain.save_interval=2",
    ]
    env = {"PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    r = pipeline(cluster, *args, cwd=cwd, env=env)
    assert r.returncode == 0, fail_text(r)
    trials = run_dirs(r.stdout)
    assert len(trials) == 3 and len({t.name for t in trials}) == 3, r.stdout
    assert r.stdout.count("submitted job") == 6, r.stdout
    for run_dir in trials:
        views = wait_settled(run_dir, ["data_prep", "pretrain"], deadline_s=scaled(420))
        assert {v.state for v in views.values()} == {"completed"}, views
        assert_ran_from_snapshot(run_dir, ["data_prep", "pretrain"])
    lrs = {OmegaConf.load(t / "provenance" / "config.yaml").pretrain.lr for t in trials}
    assert lrs == {1e-3, 2e-3, 3e-3}
    t_done = time.monotonic() - t0
    assert list(cwd.iterdir()) == []  # Hydra's sweep dir is ${run.root}/.hydra-sweeps: nothing in the cwd
    again = pipeline(cluster, *args, cwd=cwd, env=env)
    assert again.returncode == 0, fail_text(again)
    assert "submitted job" not in again.stdout and again.stdout.count("skipped") == 6, again.stdout
    assert run_dirs(again.stdout) == trials
    cluster.timings["sweep_3_trials_s"] = round(t_done, 1)


@pytest.mark.timeout(600)
def test_failed_stage_blocks_dependents_and_rerun_completes_the_rest(cluster, tmp_path):
    args = [*TINY, f"run.root={tmp_path}", "run.stages=[data_prep,pretrain,sft]", "cluster.max_requeues=0"]
    r = pipeline(cluster, *args, env={"PIPELINE_FAULT": "raise@step:2"})
    assert r.returncode == 0, fail_text(r)
    [run_dir] = run_dirs(r.stdout)
    jobs = submitted(r.stdout)
    views = wait_settled(run_dir, ["data_prep", "pretrain", "sft"], deadline_s=scaled(420))
    assert views["data_prep"].state == "completed", views
    assert views["pretrain"].state == "failed" and "InjectedFault" in views["pretrain"].detail, views
    assert views["sft"].state == "blocked" and "upstream stage pretrain failed" in views["sft"].detail, views
    # --kill-on-invalid-dep=yes: SLURM cancelled sft at once; it never ran
    wait_sacct(cluster, jobs["sft"], ["CANCELLED"])
    assert not events(run_dir, "started", "sft")
    st = pipeline(cluster, str(run_dir), module="pipeline.status")
    assert st.returncode == 1, fail_text(st)
    rec = Ledger(run_dir).read("pretrain")
    assert rec and rec.status == "failed"
    err_log = rec.extra["stderr"]
    assert f"failed stage: pretrain, log {err_log}" in st.stdout, st.stdout
    assert "InjectedFault" in Path(err_log).read_text()

    again = pipeline(cluster, *args)  # the cause removed: no PIPELINE_FAULT
    assert again.returncode == 0, fail_text(again)
    assert "[data_prep] completed earlier with the same config: skipped" in again.stdout, again.stdout
    assert list(submitted(again.stdout)) == ["pretrain", "sft"], again.stdout
    views = wait_settled(run_dir, ["pretrain", "sft"], deadline_s=scaled(420))
    assert {v.state for v in views.values()} == {"completed"}, views


@pytest.mark.timeout(600)
def test_crashed_stage_is_requeued_once_with_max_requeues_1(cluster, tmp_path):
    """A crash on the first run asks SLURM to requeue the job; the rerun (SLURM_RESTART_COUNT=1) passes the
    step that failed (each fault fires once per stage directory) and completes. pretrain is added by a second
    command while data_prep (from the first) is still queued or running: it must wait for that job."""
    args = [*TINY, f"run.root={tmp_path}", "cluster.max_requeues=1"]
    # The partition is down while both commands submit: data_prep stays queued (it would otherwise finish in
    # about a second, before the second command looks), so the second command must find it queued.
    partition = f"PartitionName={cluster_mod.PARTITION}"
    cluster.run("scontrol", "update", partition, "State=DOWN")
    try:
        first = pipeline(cluster, *args, "run.stages=[data_prep]")
        assert first.returncode == 0, fail_text(first)
        prep = submitted(first.stdout)["data_prep"]
        r = pipeline(
            cluster, *args, "run.stages=[data_prep,pretrain]", env={"PIPELINE_FAULT": "raise@step:1"}
        )
    finally:
        cluster.run("scontrol", "update", partition, "State=UP")
    assert r.returncode == 0, fail_text(r)
    assert f"[data_prep] already queued or running (job {prep})" in r.stdout, r.stdout
    [run_dir] = run_dirs(r.stdout)
    job = submitted(r.stdout)["pretrain"]
    assert f"[pretrain] submitted job {job} (afterok:{prep})" in r.stdout, r.stdout
    views = wait_settled(run_dir, ["data_prep", "pretrain"], deadline_s=scaled(420))
    assert views["pretrain"].state == "completed", views
    assert [e["restarts"] for e in events(run_dir, "started", "pretrain")] == [0, 1]
    assert len(events(run_dir, "requeued", "pretrain")) == 1
    wait_sacct(cluster, job, ["REQUEUED", "COMPLETED"])
    st = pipeline(cluster, str(run_dir), module="pipeline.status")
    assert re.search(rf"^pretrain\s+completed\s+{job}\s+1\s", st.stdout, flags=re.M), st.stdout


@pytest.mark.timeout(600)
def test_hung_job_dumps_stacks_and_is_requeued(cluster, tmp_path):
    """The watchdog finds the hang, dumps the stacks, asks SLURM to requeue, exits 86; the rerun completes."""
    args = [*TINY, f"run.root={tmp_path}", "run.stages=[data_prep,pretrain]", "cluster.max_requeues=1"]
    r = pipeline(cluster, *args, "pretrain.hang_timeout_s=10", env={"PIPELINE_FAULT": "hang@step:2"})
    assert r.returncode == 0, fail_text(r)
    [run_dir] = run_dirs(r.stdout)
    job = submitted(r.stdout)["pretrain"]
    views = wait_settled(run_dir, ["data_prep", "pretrain"], deadline_s=scaled(420))
    assert views["pretrain"].state == "completed", views
    assert [e["restarts"] for e in events(run_dir, "started", "pretrain")] == [0, 1]
    wait_sacct(cluster, job, ["REQUEUED", "COMPLETED"])
    logs = "".join(p.read_text() for p in (run_dir / "jobs" / "pretrain").rglob("*_log.*"))
    assert "[watchdog] no progress" in logs and "HangDetected: exiting with code 86" in logs
    assert "fault_injection.py" in logs, "the hung thread's stack is in the log"


@pytest.mark.timeout(600)
def test_cancel_stops_running_and_queued_jobs(cluster, tmp_path):
    args = [
        *TINY,
        f"run.root={tmp_path}",
        "run.stages=[data_prep,pretrain,sft]",
        "pretrain.iters=100000",
        "pretrain.save_interval=100000",
    ]
    r = pipeline(cluster, *args)
    assert r.returncode == 0, fail_text(r)
    [run_dir] = run_dirs(r.stdout)
    jobs = submitted(r.stdout)
    metrics = run_dir / "stages" / "pretrain" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 300, lambda: str(run_status(run_dir)))
    t_cancel = math.floor(time.time())  # sacct's end times are whole seconds
    c = pipeline(cluster, str(run_dir), module="pipeline.cancel")
    assert c.returncode == 0 and "cancelled: pretrain, sft" in c.stdout, fail_text(c)
    # a run SLURM requeued before the cancel (a loaded machine) is not the cancel's doing: only later runs count
    before = {s: [r for r in sacct_ends(cluster, jobs[s]) if r[1] < t_cancel] for s in ("pretrain", "sft")}
    for s in ("pretrain", "sft"):
        wait_sacct(cluster, jobs[s], [r[0] for r in before[s]] + ["CANCELLED"], run_dir=run_dir)
    wait_for(lambda: all(cluster.squeue(j) is None for j in jobs.values()), 120, lambda: "jobs still listed")
    views = {v.stage: v for v in run_status(run_dir)}
    assert views["pretrain"].state == views["sft"].state == "cancelled", views
    late = [e for e in events(run_dir, "requeued", "pretrain") if e["time"] >= t_cancel]
    assert not late, late  # the stop signal did not turn into a requeue
    st = pipeline(cluster, str(run_dir), module="pipeline.status")
    assert st.returncode == 1 and re.search(r"^sft\s+cancelled", st.stdout, flags=re.M), st.stdout
