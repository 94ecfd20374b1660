"""Session-scoped pytest fixture `slurm_cluster`: a real local SLURM cluster (slurm/localcluster/).

Registered in tests/conftest.py. Use it from tests marked `@pytest.mark.slurm`:

    @pytest.mark.slurm
    @pytest.mark.timeout(300)
    def test_x(slurm_cluster):
        jid = slurm_cluster.sbatch("-N1", "--wrap", "hostname")
        assert slurm_cluster.wait_job(jid) == "COMPLETED"
        subprocess.run(["squeue"], env=slurm_cluster.env)

The cluster (3 nodes node1..node3, 2 CPUs each, accounting via slurmdbd) comes up once per session in a
fresh directory under /tmp (shared by all "nodes": they are namespaces on this machine) and is torn down at
the end; teardown fails if any process it started is left. Without root or without the packages
(slurm/install.sh) the fixture skips -- except under CI=true, where it fails.
Environment: SLURM_TEST_KEEP_DIR=1 keeps the cluster directory (logs) after the session.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slurm import localcluster as cluster_mod
from tests.support.timing import scaled

TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "NODE_FAIL",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root"
    missing = cluster_mod.missing_binaries()
    if missing:
        return f"SLURM/munge/mariadb binaries missing ({', '.join(missing)}): run slurm/install.sh as root"
    return None


def stray_processes(directory: Path) -> list[str]:
    """Live processes (not this one) whose command line or environment mentions `directory`:
    daemons, node namespaces and jobs of that cluster all do (SLURM_CONF points into it)."""
    me, d = os.getpid(), str(directory).encode()
    out = []
    for pid in cluster_mod.pids():
        if pid == me:
            continue
        st = cluster_mod.stat(pid)
        if st is None or st[0] in ("Z", "X"):
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if d in cmd or d in env:
            text = cmd.replace(b"\0", b" ").decode(errors="replace").strip()
            out.append(f"{pid}: {text}")
    return out


class SlurmCluster:
    """Handle yielded by the fixture."""

    def __init__(self, cluster, up_s: float):
        self._c = cluster
        self.dir: Path = cluster.dir
        self.nodes: list[str] = cluster.node_names
        self.timings: dict[str, float] = {"up_s": up_s}

    # --- environment
    @property
    def env(self) -> dict[str, str]:
        """Full environment for subprocesses: os.environ + SLURM_CONF (+ SLURM_LOCAL_DIR, PATH)."""
        return self._c.env

    @property
    def vars(self) -> dict[str, str]:
        """Only the variables the cluster adds (for monkeypatch.setenv, e.g. for submitit)."""
        return self._c.env_vars()

    @property
    def conf(self) -> Path:
        return self._c.conf

    # --- nodes
    def kill_node(self, name: str) -> None:
        """Hardware failure: SIGKILL the node's process group / namespace (returns when it is gone)."""
        self._c.kill_node(name)

    def start_node(self, name: str, deadline_s: float = scaled(90)) -> float:
        """Bring a node back; returns once SLURM reports it usable (idle/mixed/allocated)."""
        return self._c.start_node(name, wait=True, deadline_s=deadline_s)

    def node_processes(self, name: str) -> list[int]:
        """PIDs (this machine's) of every process running on node ``name`` (its PID namespace)."""
        p = self._c.procs.get(name)
        return p.members() if p is not None and p.alive() else []

    def node_alive(self, name: str) -> bool:
        return self._c.alive(name)

    def sinfo(self, *args: str) -> str:
        """`sinfo -N -l` by default, or `sinfo ARGS`."""
        if not args:
            return self._c.sinfo()
        return self.run("sinfo", *args).stdout

    def node_states(self) -> dict[str, str]:
        """{"node1": "idle", ...} (long state names, with sinfo's suffixes such as '*')."""
        return self._c.node_states()

    def wait_nodes_idle(self, deadline_s: float = scaled(90)) -> None:
        wait_for(
            lambda: all(s == "idle" for s in self.node_states().values()),
            deadline_s,
            lambda: f"nodes not idle: {self.node_states()}",
        )

    # --- commands
    def run(self, *cmd: str, check: bool = True, timeout: float = scaled(60)) -> subprocess.CompletedProcess:
        cp = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and cp.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> {cp.returncode}\n{cp.stdout}\n{cp.stderr}")
        return cp

    def sbatch(self, *args: str) -> str:
        """sbatch --parsable ARGS; returns the job id. Output goes to <dir>/jobs/%j.out unless -o is given."""
        extra = (
            [] if any(a.startswith(("-o", "--output")) for a in args) else ["-o", f"{self.dir}/jobs/%j.out"]
        )
        return self.run("sbatch", "--parsable", *extra, *args).stdout.strip().split(";")[0]

    def job_output(self, job_id: str) -> str:
        p = self.dir / "jobs" / f"{job_id}.out"
        return p.read_text() if p.exists() else ""

    def sacct_state(self, job_id: str) -> str | None:
        """State of the job's latest allocation record in accounting (first word: 'CANCELLED by 0' ->
        'CANCELLED'), or None if sacct does not know it yet."""
        cp = self.run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State", check=False)
        lines = [x.split()[0] for x in cp.stdout.splitlines() if x.strip()]
        return lines[-1] if lines else None

    def squeue(self, job_id: str) -> tuple[str, str] | None:
        """(state, reason) from squeue, or None if the controller does not list it."""
        cp = self.run("squeue", "-h", "-j", job_id, "-o", "%T|%r", check=False)
        line = cp.stdout.strip()
        if cp.returncode != 0 or not line:
            return None
        state, reason = line.split("|", 1)
        return state, reason

    def wait_job(self, job_id: str, states=TERMINAL_STATES, deadline_s: float = scaled(120)) -> str:
        """Poll sacct until the job reaches one of `states`; returns that state."""
        return wait_for(
            lambda: s if (s := self.sacct_state(job_id)) in states else None,
            deadline_s,
            lambda: f"job {job_id}: sacct {self.sacct_state(job_id)}, squeue {self.squeue(job_id)}",
        )


def wait_for(pred, deadline_s: float, describe=lambda: "", interval: float = 0.25):
    """Poll `pred` until it returns something truthy (returned); fail after `deadline_s`."""
    t0 = time.monotonic()
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() - t0 > deadline_s:
            raise AssertionError(f"timed out after {deadline_s:.0f}s: {describe()}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = unavailable_reason()
    if reason:
        if in_ci():
            pytest.fail(f"CI=true but the local SLURM cluster cannot run: {reason}", pytrace=False)
        pytest.skip(reason)
    # short path: unix sockets (munge, mysql, slurmstepd) live under it; o+x for munged
    d = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    c = cluster_mod.Cluster(d, nodes=3)
    try:
        up_s = c.up(deadline_s=scaled(180))
    except BaseException:
        try:
            c.down()
        finally:
            print(f"local SLURM cluster failed to start; logs kept in {d}/log", file=sys.stderr)
        raise
    handle = SlurmCluster(c, up_s)
    try:
        yield handle
    finally:
        down_s = c.down()
        handle.timings["down_s"] = down_s
        left = cluster_mod.Cluster.load(d).leftovers()
        stray = stray_processes(d)
        print(f"\n[slurm_cluster] timings: {handle.timings}")
        if not left and not stray and not os.environ.get("SLURM_TEST_KEEP_DIR"):
            shutil.rmtree(d, ignore_errors=True)
        assert not left and not stray, f"processes left after teardown: {left} {stray} (logs in {d}/log)"
