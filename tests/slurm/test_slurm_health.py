"""``cluster.health.policy=exclude`` on the real local SLURM cluster. At job start: node2, where a 2-node
pretrain job runs (node3 drained), is slowed from outside (its job processes held to a fifth of a CPU by a
cgroup quota, or stopped three quarters of the time with SIGSTOP/SIGCONT where no cgroup is writable); the
health check at job start names it, the job requeues itself with the node in its ExcNodeList, runs again on
the two other nodes and completes; the run
remembers the node (excluded_nodes.json, later submissions' --exclude) and status shows it; straggler checks on
the untouched nodes raise no alarm. Mid-training: the same slowdown from step 10 on makes the straggler check
name the node within ``patience`` checks; the job saves at that step, is requeued without it and resumes from
that step."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from pipeline.records.ledger import Ledger, read_metrics
from tests.support.env import REPO
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
    wait_settled,
)
from tests.support.timing import scaled

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

ARGS = [
    *TINY,
    *TWO_NODES,
    "run.stages=[data_prep,pretrain]",
    "cluster.health.policy=exclude",
    "cluster.health.matmul_size=768",
    "cluster.health.repeats=5",
]


def _job_processes(cluster: Any, node: str) -> list[psutil.Process]:
    """The job's Python processes on ``node`` (submitit's task processes)."""
    out = []
    for pid in cluster.node_processes(node):
        try:
            proc = psutil.Process(pid)
            if "submitit" in " ".join(proc.cmdline()):
                out.append(proc)
        except psutil.Error:
            continue
    return out


CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")


class Slowdown:
    """Slow ``node`` from outside while in a ``with`` block: its job processes held to a fifth of a CPU (a
    cgroup v1 CPU quota, 2 ms per 10 ms), or where this machine has no writable one stopped three quarters of
    the time (SIGSTOP/SIGCONT, weaker: the signalling thread shares the CPUs). New processes are found every
    half second; ``applied`` is set once the first ones are slowed."""

    def __init__(self, cluster: Any, node: str) -> None:
        self.cluster, self.node = cluster, node
        self.stop, self.applied = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Slowdown:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=scaled(30))

    def _run(self) -> None:
        group = CPU_CGROUPS / f"pipeline-test-slow-{self.node}-{os.getpid()}"
        try:
            group.mkdir()
            (group / "cpu.cfs_period_us").write_text("10000")
            (group / "cpu.cfs_quota_us").write_text("2000")
        except OSError:
            self._stop_and_continue()
            return
        try:
            while True:
                for p in _job_processes(self.cluster, self.node):
                    with contextlib.suppress(OSError):
                        (group / "cgroup.procs").write_text(str(p.pid))
                        self.applied.set()
                if self.stop.wait(0.5):
                    break
        finally:
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (CPU_CGROUPS / "cgroup.procs").write_text(pid)
            group.rmdir()

    def _stop_and_continue(self, off_s: float = 0.006, on_s: float = 0.002) -> None:
        procs: list[psutil.Process] = []
        found_at = 0.0
        while not self.stop.is_set():
            if time.monotonic() - found_at > 0.5:
                procs, found_at = _job_processes(self.cluster, self.node), time.monotonic()
            for sig, pause in ((signal.SIGSTOP, off_s), (signal.SIGCONT, on_s)):
                for p in procs:
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(sig)
                        self.applied.set()
                time.sleep(pause)
        for p in _job_processes(self.cluster, self.node):
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)


def _until_excluded(run_dir: Path) -> None:
    """Wait for the job to exclude a node."""
    wait_for(lambda: events(run_dir, "node_excluded", "pretrain"), 300, lambda: run_story(run_dir))


def _completed(run_dir: Path) -> None:
    views = wait_settled(run_dir, ["data_prep", "pretrain"], 400)
    assert views["pretrain"].state == "completed", run_story(run_dir)


def test_a_node_slowed_from_outside_is_excluded_and_the_job_runs_without_it(
    cluster: Any, tmp_path: Path
) -> None:
    # node3 drained, so the 2-node job lands on node1 and node2; node2 is slowed before the job starts (on a
    # loaded machine a slowdown begun once the job runs can miss its start check)
    slow = "node2"
    cluster.run("scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=test-health")
    try:
        with Slowdown(cluster, slow):
            r = pipeline(cluster, *ARGS, "cluster.health.straggler_interval=2", f"run.root={tmp_path}")
            assert r.returncode == 0, fail_text(r)
            run_dir, job = run_dirs(r.stdout)[0], submitted(r.stdout)["pretrain"]
            _until_excluded(run_dir)
    finally:
        cluster.run("scontrol", "update", "NodeName=node3", "State=RESUME")
    _completed(run_dir)
    ev = events(run_dir, "node_excluded", "pretrain")[0]
    assert list(ev["nodes"]) == [slow] and ev["requeued"], ev
    assert ev["nodes"][slow].startswith("matmul_s"), ev
    assert set(Ledger(run_dir).excluded_nodes()) == {slow}
    job_info = cluster.run("scontrol", "show", "job", job).stdout
    assert f"ExcNodeList={slow}" in job_info, job_info
    ran = cluster.run("sacct", "-n", "-P", "-X", "-D", "-j", job, "-o", "State,NodeList").stdout.splitlines()
    assert len(ran) == 2 and slow not in hostnames(cluster, ran[-1].split("|")[1]), ran
    rec = Ledger(run_dir).read("pretrain")
    assert rec is not None and [f["cause"] for f in rec.failures] == ["node_failure"], rec.failures
    st = pipeline(cluster, str(run_dir), module="pipeline.status")
    assert f"excluded node: {slow} (matmul_s" in st.stdout, st.stdout
    lines = read_metrics(run_dir, "pretrain")
    assert any(r["kind"] == "straggler" for r in lines), "no straggler check ran"
    assert not [r for r in lines if r.get("alarm") == "straggler"], "a straggler alarm on untouched nodes"
    # the run's later submissions keep off it: the same command's dry run shows the sbatch option
    plan = pipeline(cluster, *ARGS, f"run.root={tmp_path}", "run.dry_run=true")  # the start check alone
    assert plan.returncode == 0 and f"#SBATCH --exclude={slow}" in plan.stdout, fail_text(plan)


def test_a_node_slowed_mid_training_is_named_a_straggler_and_the_job_resumes_without_it(
    cluster: Any, tmp_path: Path
) -> None:
    # the start check is not judged here (under load it could name a node by chance and leave too few).
    # A check's window is 10 steps (about a quarter second here): a 2-step window is shorter than the OS's
    # time slice on a loaded host, where one preemption makes an untouched node look 1.5x slower.
    every, patience = 10, 2
    args = [
        *ARGS,
        "cluster.health.slow_factor=100",
        f"cluster.health.straggler_interval={every}",
        "cluster.health.straggler_slower=0.4",
        f"cluster.health.straggler_patience={patience}",
        "pretrain.iters=400",
        "pretrain.log_interval=1",
    ]
    r = pipeline(cluster, *args, "pretrain.save_interval=1000", f"run.root={tmp_path}")
    assert r.returncode == 0, fail_text(r)
    run_dir, job = run_dirs(r.stdout)[0], submitted(r.stdout)["pretrain"]

    def trained() -> int:
        return max((x["step"] for x in read_metrics(run_dir, "pretrain") if x["kind"] == "train"), default=0)

    def trained_to(step: int) -> list[str] | None:
        got = cluster.run("squeue", "-h", "-j", job, "-o", "%N", check=False).stdout.strip()
        return hostnames(cluster, got) if trained() >= step and got else None

    slow = wait_for(lambda: trained_to(10), 300, lambda: run_story(run_dir))[-1]
    # the slowdown begins between these two readings (the job trains on while this process waits its turn)
    before = trained()
    with Slowdown(cluster, slow) as slowdown:
        wait_for(slowdown.applied.is_set, 60, lambda: f"no job process on {slow} slowed")
        after = trained()
        _until_excluded(run_dir)
    _completed(run_dir)
    lines = read_metrics(run_dir, "pretrain")
    alarms = [x for x in lines if x.get("alarm") == "straggler"]
    assert [a["host"] for a in alarms] == [slow], alarms
    named = alarms[0]["step"]
    # named after the slowdown began, within patience checks of the first window wholly after it
    assert before < named <= after + (patience + 2) * every, (before, after, named)
    assert any(x["kind"] == "checkpoint" and x["step"] == named for x in lines), "no save at the exclusion"
    resume = [x for x in lines if x["kind"] == "resume"]
    assert resume and resume[-1]["from_step"] == named and resume[-1]["steps_lost"] == 0, resume
    ev = events(run_dir, "node_excluded", "pretrain")[0]
    assert list(ev["nodes"]) == [slow] and ev["nodes"][slow].startswith("straggler:"), ev
    ran = cluster.run("sacct", "-n", "-P", "-X", "-D", "-j", job, "-o", "NodeList").stdout.split()
    assert len(ran) == 2 and slow not in hostnames(cluster, ran[-1]), ran


def test_a_job_is_not_excluded_from_more_nodes_than_its_partition_has(cluster: Any, tmp_path: Path) -> None:
    """A 2-node job already kept off node3 cannot leave node1 too (SLURM would hold it pending forever,
    BadConstraints): exclusion_blocked says why; leaving nothing more is fine."""
    out = tmp_path / "out"
    code = (
        "from pipeline.slurm.job_env import exclusion_blocked as b; "
        "print('none:', b([])); print('node1:', b(['node1']))"
    )
    job = cluster.sbatch(
        "-N2", "--exclude=node3", "-o", str(out), f"--chdir={REPO}", "--wrap", f"{sys.executable} -c {code!r}"
    )
    assert cluster.wait_job(job) == "COMPLETED", out.read_text() if out.exists() else job
    lines = out.read_text().splitlines()
    assert "none: None" in lines, lines
    assert any(
        ln.startswith("node1: partition ")
        and "1 node(s) left (node2) outside node1,node3 for a job of 2" in ln
        for ln in lines
    ), lines
