"""The local SLURM cluster (slurm/localcluster/) behaves like a real one: scheduling on named nodes,
accounting, dependencies, submitit, node failure -> requeue, clean teardown."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.env import REPO
from tests.support.slurm_cluster import stray_processes, wait_for
from tests.support.timing import scaled

pytestmark = pytest.mark.slurm


def test_bring_up_three_idle_nodes(slurm_cluster):
    slurm_cluster.wait_nodes_idle(deadline_s=scaled(30))
    states = slurm_cluster.node_states()
    assert states == {"node1": "idle", "node2": "idle", "node3": "idle"}, slurm_cluster.sinfo()
    out = slurm_cluster.sinfo("-h", "-N", "-o", "%N %c %P")
    assert sorted(out.split("\n")[:3]) == ["node1 2 debug*", "node2 2 debug*", "node3 2 debug*"]
    assert slurm_cluster.run("sacct", "-n").returncode == 0


@pytest.mark.timeout(180)
def test_two_node_job_hostnames_and_sacct(slurm_cluster):
    jid = slurm_cluster.sbatch(
        "-N2",
        "--ntasks-per-node=2",
        "--wrap",
        "echo batch $(hostname); srun bash -c 'echo task $SLURM_PROCID $(hostname)'; getent hosts node1",
    )
    assert slurm_cluster.wait_job(jid, deadline_s=scaled(120)) == "COMPLETED", slurm_cluster.job_output(jid)
    out = slurm_cluster.job_output(jid).split("\n")
    batch_host = next(x.split()[1] for x in out if x.startswith("batch "))
    tasks = sorted(x.split()[1:] for x in out if x.startswith("task "))
    hosts = [h for _, h in tasks]
    assert len(tasks) == 4 and len(set(hosts)) == 2 and all(h in slurm_cluster.nodes for h in hosts), out
    assert hosts.count(hosts[0]) == 2  # 2 ranks per node
    assert batch_host in hosts
    assert any(x.startswith("127.0.0.1") and "node1" in x for x in out)  # node names resolve inside nodes
    # accounting: allocation, batch step and the srun step all COMPLETED
    acct = slurm_cluster.run("sacct", "-n", "-P", "-j", jid, "-o", "JobID,State,NodeList").stdout.split()
    assert {line.split("|")[1] for line in acct} == {"COMPLETED"}, acct
    assert any(line.startswith(f"{jid}.0|") for line in acct), acct


@pytest.mark.timeout(180)
def test_afterok_on_failed_job_never_runs(slurm_cluster):
    """22.05 default: the dependent job stays PENDING with reason DependencyNeverSatisfied forever (nothing
    cancels it); with --kill-on-invalid-dep=yes (or SchedulerParameters=kill_invalid_depend) it is CANCELLED."""
    marker = slurm_cluster.dir / "jobs" / f"dep-ran-{os.getpid()}"
    failing = slurm_cluster.sbatch("--wrap", "exit 3")
    waits = slurm_cluster.sbatch(f"--dependency=afterok:{failing}", "--wrap", f"touch {marker}")
    killed = slurm_cluster.sbatch(
        f"--dependency=afterok:{failing}", "--kill-on-invalid-dep=yes", "--wrap", f"touch {marker}"
    )
    assert slurm_cluster.wait_job(failing) == "FAILED"
    assert slurm_cluster.wait_job(killed, deadline_s=scaled(60)) == "CANCELLED"
    wait_for(
        lambda: slurm_cluster.squeue(waits) == ("PENDING", "DependencyNeverSatisfied"),
        60,
        lambda: f"squeue: {slurm_cluster.squeue(waits)}",
    )
    # it stays that way across several scheduler passes (sched_interval=2, bf_interval=1)
    t_end = time.monotonic() + scaled(6)
    while time.monotonic() < t_end:
        assert slurm_cluster.squeue(waits) == ("PENDING", "DependencyNeverSatisfied")
        time.sleep(0.5)
    assert slurm_cluster.sacct_state(waits) == "PENDING"
    slurm_cluster.run("scancel", waits)
    assert slurm_cluster.wait_job(waits, deadline_s=scaled(60)) == "CANCELLED"
    assert not marker.exists(), "a job depending on a failed job ran"


def _remote_fn(x: int) -> dict:
    import pipeline  # the repo must be importable in the job (submitit runs sys.executable)

    return {
        "value": x * 2,
        "host": socket.gethostname(),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "pipeline": pipeline.__file__,
        "python": sys.executable,
    }


@pytest.mark.timeout(240)
def test_submitit_function_result(slurm_cluster, monkeypatch):
    import submitit

    # submitit calls sbatch/sacct with os.environ, and the job inherits it (--export=ALL)
    for k, v in slurm_cluster.vars.items():
        monkeypatch.setenv(k, v)
    pp = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    monkeypatch.setenv("PYTHONPATH", ":".join(pp))
    folder = slurm_cluster.dir / "submitit" / f"{os.getpid()}-%j"
    ex = submitit.AutoExecutor(folder=folder)
    assert ex.cluster == "slurm"
    ex.update_parameters(timeout_min=5, nodes=1, tasks_per_node=1, cpus_per_task=1, slurm_partition="debug")
    job = ex.submit(_remote_fn, 21)
    res = job.result()  # polls sacct
    assert res["value"] == 42
    assert res["host"] in slurm_cluster.nodes
    assert res["job_id"] == str(job.job_id)
    assert Path(res["pipeline"]).resolve().is_relative_to(REPO)
    assert res["python"] == sys.executable
    # submitit's watcher reads sacct (rate-limited, cached): the state may say UNKNOWN for a moment
    wait_for(lambda: job.state == "COMPLETED", 60, lambda: f"submitit state {job.state}")
    assert job.done()
    assert slurm_cluster.wait_job(str(job.job_id)) == "COMPLETED"


@pytest.mark.timeout(300)
def test_node_failure_requeues_job_elsewhere(slurm_cluster):
    log = slurm_cluster.dir / "jobs" / f"requeue-{os.getpid()}.log"
    script = slurm_cluster.dir / "jobs" / f"requeue-{os.getpid()}.sh"
    script.write_text(f"""#!/bin/bash
echo "$(hostname) ${{SLURM_RESTART_COUNT:-0}}" >> {log}
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then sleep 600; fi
echo finished on $(hostname)
""")
    slurm_cluster.wait_nodes_idle()
    jid = slurm_cluster.sbatch("--requeue", "-N1", "-n1", str(script))
    wait_for(lambda: log.exists() and log.read_text().strip(), 60, lambda: f"job {jid} never started")
    first_node, count = log.read_text().split()
    assert count == "0"
    t_kill = time.monotonic()
    slurm_cluster.kill_node(first_node)
    try:
        assert not slurm_cluster.node_alive(first_node)
        wait_for(
            lambda: (
                (slurm_cluster.squeue(jid) or ("",))[0] == "PENDING" or len(log.read_text().split("\n")) > 2
            ),
            120,
            lambda: f"not requeued: {slurm_cluster.squeue(jid)}",
        )
        t_requeued = time.monotonic() - t_kill
        wait_for(
            lambda: len(log.read_text().strip().split("\n")) >= 2,
            120,
            lambda: f"not restarted: {slurm_cluster.squeue(jid)} {slurm_cluster.node_states()}",
        )
        t_rerun = time.monotonic() - t_kill
        assert slurm_cluster.wait_job(jid, states={"COMPLETED"}, deadline_s=scaled(120)) == "COMPLETED"
        t_done = time.monotonic() - t_kill
        second_node, count2 = log.read_text().strip().split("\n")[1].split()
        assert second_node != first_node and second_node in slurm_cluster.nodes
        assert count2 == "1"  # SLURM_RESTART_COUNT
        # accounting keeps both runs: NODE_FAIL on the dead node, then COMPLETED
        hist = slurm_cluster.run(
            "sacct", "-n", "-X", "-P", "-D", "-j", jid, "-o", "State,NodeList"
        ).stdout.split()
        assert hist == [f"NODE_FAIL|{first_node}", f"COMPLETED|{second_node}"], hist
        assert slurm_cluster.node_states()[first_node].startswith("down")
        slurm_cluster.timings.update(
            kill_to_requeue_s=round(t_requeued, 1),
            kill_to_rerun_s=round(t_rerun, 1),
            kill_to_completed_s=round(t_done, 1),
        )
        print(
            f"node failure: requeued after {t_requeued:.1f}s, running again after {t_rerun:.1f}s, "
            f"completed after {t_done:.1f}s"
        )
    finally:
        if not slurm_cluster.node_alive(first_node):
            t = slurm_cluster.start_node(first_node)
            slurm_cluster.timings["start_node_s"] = round(t, 1)
    slurm_cluster.wait_nodes_idle()


@pytest.mark.timeout(300)
def test_cli_second_cluster_up_down_leaves_nothing(slurm_cluster):
    """slurm/cluster.sh: a second cluster (its own ports) next to the session one; `down` stops every
    process it started, and a second `down` is harmless."""
    d = Path(tempfile.mkdtemp(prefix="slurm-cli-", dir="/tmp"))
    cli = [str(REPO / "slurm" / "cluster.sh")]
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_CONF", "SLURM_LOCAL_DIR")}
    try:
        t0 = time.monotonic()
        up = subprocess.run(
            cli + ["up", "--dir", str(d), "--nodes", "2"],
            env=env,
            capture_output=True,
            text=True,
            timeout=scaled(240),
        )
        t_up = time.monotonic() - t0
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"source {d}/env.sh" in up.stdout
        envsh = (d / "env.sh").read_text()
        assert f"export SLURM_CONF={d}/etc/slurm.conf" in envsh
        # the two clusters use different ports
        own = (d / "etc" / "slurm.conf").read_text()
        sess = slurm_cluster.conf.read_text()
        port = [x for x in own.splitlines() if x.startswith("SlurmctldPort=")]
        assert port and port[0] not in sess
        out = subprocess.run(
            ["bash", "-c", f"source {d}/env.sh && srun -N2 hostname | sort"],
            env=env,
            capture_output=True,
            text=True,
            timeout=scaled(120),
        )
        assert out.stdout.split() == ["node1", "node2"], out.stdout + out.stderr
        st = subprocess.run(
            cli + ["status", "--dir", str(d)], env=env, capture_output=True, text=True, timeout=scaled(60)
        )
        assert st.returncode == 0 and "node2" in st.stdout, st.stdout + st.stderr
        assert stray_processes(d)  # the daemons are found by the scan
    finally:
        t0 = time.monotonic()
        down = subprocess.run(
            cli + ["down", "--dir", str(d)], env=env, capture_output=True, text=True, timeout=scaled(120)
        )
        t_down = time.monotonic() - t0
    assert down.returncode == 0, down.stdout + down.stderr
    assert not stray_processes(d)
    again = subprocess.run(
        cli + ["down", "--dir", str(d)], env=env, capture_output=True, text=True, timeout=scaled(60)
    )
    assert again.returncode == 0, again.stdout + again.stderr
    slurm_cluster.timings.update(cli_up_2nodes_s=round(t_up, 1), cli_down_s=round(t_down, 1))
    # the session cluster was not disturbed
    assert set(slurm_cluster.node_states()) == {"node1", "node2", "node3"}
    shutil.rmtree(d, ignore_errors=True)
