"""Constants, errors and small helpers of the local SLURM cluster: binaries, subprocesses, waits, ports."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / ".slurm"
CLUSTER_NAME = "local"
PARTITION = "debug"
CPUS_PER_NODE = 2
REAL_MEMORY_MB = 2000
SBIN = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
# Daemons in stop order (phase by phase): nodes first, then the controller, then what it depends on.
STOP_PHASES = [["nodes", "slurmctld"], ["slurmdbd"], ["mysqld", "munged"]]


class ClusterError(RuntimeError):
    pass


class DaemonDied(ClusterError):
    """A daemon we started exited during a wait: fail at once instead of at the deadline."""


def log(msg: str) -> None:
    print(f"[slurm-local] {msg}", flush=True)


def which(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for d in SBIN:
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    raise ClusterError(f"{name} not found: run slurm/install.sh (as root)")


REQUIRED_BINARIES = [
    "munged",
    "mungekey",
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "sbatch",
    "sinfo",
    "sacct",
    "sacctmgr",
    "scontrol",
    "mariadbd",
    "mariadb-install-db",
    "mariadb",
    "unshare",
    "hostname",
    "mount",
]


def missing_binaries() -> list[str]:
    out = []
    for b in REQUIRED_BINARIES:
        try:
            which(b)
        except ClusterError:
            out.append(b)
    return out


def _port_free(port: int) -> bool:
    for host in ("0.0.0.0", "127.0.0.1"):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((host, port))
        except OSError:
            return False
        finally:
            s.close()
    return True


CTLD_SLOTS = 12
CTLD_BASE = 11900
"""slurmctld takes a port in CTLD_BASE + 0..11, its slot: a cluster's job ids start at slot x 1000 + 1
(``first_job_id``), so the concurrent clusters of one machine (pytest workers) never run jobs whose ids, and
with them the pipeline's rendezvous ports (20000 + id % 12000), coincide. Its bound port holds the slot."""


def first_job_id(ctld_port: int) -> int:
    """FirstJobId of the cluster whose slurmctld listens on ``ctld_port``."""
    return (ctld_port - CTLD_BASE) % CTLD_SLOTS * 1000 + 1


def pick_ports(n: int) -> list[int]:
    """A free slurmctld port in a free slot (see CTLD_BASE), then n - 1 distinct free TCP ports below the range
    the pipeline's SLURM jobs rendezvous on (20000-31999, pipeline.submit.launch.RENDEZVOUS_PORTS: a daemon
    there once took a job's port) and below the kernel's ephemeral range (so outgoing connections never take
    them), chosen at random so that concurrent clusters rarely race for the same one."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    slots = [CTLD_BASE + i for i in rng.sample(range(CTLD_SLOTS), CTLD_SLOTS)]
    ctld = next((p for p in slots if _port_free(p)), None)
    if ctld is None:
        raise ClusterError(f"all {CTLD_SLOTS} slurmctld slots (ports from {CTLD_BASE}) are taken")
    lo, hi = 12000, 20000
    try:
        eph_lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        hi = min(hi, eph_lo)
        lo = min(lo, hi - 2000)
    except (OSError, ValueError, IndexError):
        pass
    chosen: list[int] = [ctld]
    for _ in range(10000):
        p = rng.randrange(lo, hi)
        if p not in chosen and not CTLD_BASE <= p < CTLD_BASE + CTLD_SLOTS and _port_free(p):
            chosen.append(p)
            if len(chosen) == n:
                return chosen
    raise ClusterError("could not find free ports")


def run(
    cmd: list[str], env: dict[str, str], timeout: float = 30, check: bool = False
) -> subprocess.CompletedProcess:
    cp = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and cp.returncode != 0:
        raise ClusterError(
            f"{' '.join(cmd)} failed ({cp.returncode}): {cp.stderr.strip() or cp.stdout.strip()}"
        )
    return cp


def wait_until(what: str, pred, deadline_s: float, interval: float = 0.2, on_timeout=None):
    t0 = time.monotonic()
    last_exc: Exception | None = None
    while True:
        try:
            v = pred()
            if v:
                return v
        except DaemonDied:
            raise
        except (subprocess.TimeoutExpired, OSError, ClusterError) as e:
            last_exc = e
        if time.monotonic() - t0 > deadline_s:
            extra = on_timeout() if on_timeout else ""
            raise ClusterError(
                f"timed out after {deadline_s:.0f}s waiting for {what}"
                + (f" (last error: {last_exc})" if last_exc else "")
                + (f"\n{extra}" if extra else "")
            )
        time.sleep(interval)


def tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return f"({path} missing)"
    return f"--- tail of {path} ---\n" + "\n".join(lines)
