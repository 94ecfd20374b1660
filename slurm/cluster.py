#!/usr/bin/env python3
"""A real SLURM cluster on one machine, for tests and demos (Debian slurm-wlm 22.05 + munge + mariadb).

    python3 slurm/cluster.py up   [--dir DIR] [--nodes N]   # start (or complete) the cluster, wait until ready
    python3 slurm/cluster.py status [--dir DIR]
    python3 slurm/cluster.py kill-node node2 [--dir DIR]     # kill -9 the emulated node (hardware failure)
    python3 slurm/cluster.py start-node node2 [--dir DIR]    # bring it back, wait until it is usable
    python3 slurm/cluster.py down [--dir DIR]                # stop exactly what `up` started; safe to repeat

Everything lives under one directory (default <repo>/.slurm, or $SLURM_LOCAL_DIR, or --dir): configs, munge
key and socket, the mariadb data dir, slurmctld state, node spool dirs, logs, and `state.json`, which records
every process started (pid + kernel start time, process group, and for nodes the PID namespace) so that `down`
and `kill-node` signal only those. Nothing under the host's /etc is written. Ports are picked at run time.

Each node is `slurmd -D -N nodeX` inside its own PID+UTS+mount namespace
(`unshare --pid --fork --kill-child --mount-proc --uts`), with hostname nodeX and a private bind-mounted
/etc/hosts listing node1..nodeN as 127.0.0.1. Needs root. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
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


# ----------------------------------------------------------------------------------------------------------
# /proc helpers: process identity is (pid, start time in clock ticks since boot); zombies count as dead.


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, starttime) or None if the process does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw.rsplit(")", 1)[1].split()
    # rest[0] = state (field 3), rest[1] = ppid, rest[2] = pgrp, rest[19] = starttime (field 22)
    return rest[0], int(rest[1]), int(rest[2]), int(rest[19])


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _pidns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


@dataclass
class Proc:
    """A process this script started: the leader of its own session/process group."""

    name: str
    pid: int
    start: int  # kernel start time of `pid`, guards against pid reuse
    pidns: str | None = None  # nodes: the node's PID namespace ("pid:[4026...]")
    started_at: float = 0.0  # wall clock (time.time()) when started

    def leader_alive(self) -> bool:
        st = _stat(self.pid)
        return st is not None and st[3] == self.start and st[0] not in ("Z", "X")

    def members(self) -> list[int]:
        """Live processes belonging to it: its process group (born after the leader) and, for a node,
        everything in the node's PID namespace."""
        out = []
        for pid in _pids():
            st = _stat(pid)
            if st is None or st[0] in ("Z", "X"):
                continue
            if (st[2] == self.pid and st[3] >= self.start) or (self.pidns and _pidns(pid) == self.pidns):
                out.append(pid)
        return out

    def alive(self) -> bool:
        return self.leader_alive() or bool(self.members())

    def signal(self, sig: int) -> None:
        if self.leader_alive():
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass
        for pid in self.members():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "pid": self.pid,
            "start": self.start,
            "pidns": self.pidns,
            "started_at": self.started_at,
        }

    @classmethod
    def from_json(cls, d: dict) -> Proc:
        return cls(d["name"], d["pid"], d["start"], d.get("pidns"), d.get("started_at", 0.0))


def spawn(name: str, cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> Proc:
    """Start `cmd` as the leader of a new session, detached (double fork: it is never our child, so no
    zombie is left in a long-lived caller such as pytest). Returns its identity."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # intermediate
        try:
            os.close(r)
            gc = os.fork()
            if gc == 0:  # the daemon
                try:
                    os.setsid()
                    os.chdir(cwd)
                    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    nul = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(nul, 0)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.execve(cmd[0], cmd, env)
                except BaseException as e:  # noqa: BLE001
                    try:
                        os.write(2, f"exec {cmd!r} failed: {e}\n".encode())
                    finally:
                        os._exit(127)
            os.write(w, str(gc).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 64):
        data += chunk
    os.close(r)
    os.waitpid(child, 0)
    pid = int(data)
    st = _stat(pid)
    if st is None:
        raise ClusterError(f"{name} exited immediately; see {log_path}")
    return Proc(name, pid, st[3], started_at=time.time())


# ----------------------------------------------------------------------------------------------------------


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


def pick_ports(n: int) -> list[int]:
    """n distinct free TCP ports below the kernel's ephemeral range (so outgoing connections never take
    them), chosen at random so that concurrent clusters rarely race for the same one."""
    lo, hi = 20000, 32000
    try:
        eph_lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        hi = min(hi, eph_lo)
        lo = min(lo, hi - 2000)
    except (OSError, ValueError, IndexError):
        pass
    chosen: list[int] = []
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(10000):
        p = rng.randrange(lo, hi)
        if p not in chosen and _port_free(p):
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


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return f"({path} missing)"
    return f"--- tail of {path} ---\n" + "\n".join(lines)


@dataclass
class Cluster:
    dir: Path
    nodes: int = 3
    procs: dict[str, Proc] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    # ---- layout
    @property
    def conf(self) -> Path:
        return self.dir / "etc" / "slurm.conf"

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    @property
    def env_file(self) -> Path:
        return self.dir / "env.sh"

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge" / "munge.socket"

    @property
    def mysql_socket(self) -> Path:
        return self.dir / "mysql" / "mysql.sock"

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def env(self) -> dict[str, str]:
        """Environment for SLURM clients (sbatch, srun, sacct, submitit...)."""
        e = dict(os.environ)
        e.update(self.env_vars())
        return e

    def env_vars(self) -> dict[str, str]:
        path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        for d in ("/usr/bin", "/usr/sbin"):
            if d not in path.split(":"):
                path = f"{path}:{d}"
        return {"SLURM_CONF": str(self.conf), "SLURM_LOCAL_DIR": str(self.dir), "PATH": path}

    # ---- state
    @classmethod
    def load(cls, d: Path, nodes: int | None = None) -> Cluster:
        d = Path(d).resolve()
        c = cls(d, nodes or 3)
        if c.state_file.exists():
            s = json.loads(c.state_file.read_text())
            c.nodes = s.get("nodes", c.nodes)
            c.ports = s.get("ports", {})
            c.procs = {k: Proc.from_json(v) for k, v in s.get("procs", {}).items()}
            if nodes and nodes != c.nodes and c.any_alive():
                raise ClusterError(f"cluster in {d} runs {c.nodes} nodes; run `down` before changing --nodes")
            if nodes and not c.any_alive():
                c.nodes = nodes
        return c

    def save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "nodes": self.nodes,
                    "ports": self.ports,
                    "procs": {k: p.to_json() for k, p in self.procs.items()},
                },
                indent=1,
            )
        )
        os.replace(tmp, self.state_file)

    def any_alive(self) -> bool:
        return any(p.alive() for p in self.procs.values())

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.alive()

    def leftovers(self) -> dict[str, list[int]]:
        """Recorded processes (and their group / namespace members) that still run."""
        out = {}
        for name, p in self.procs.items():
            m = sorted(set(p.members()) | ({p.pid} if p.leader_alive() else set()))
            if m:
                out[name] = m
        return out

    # ---- configuration
    def _write_configs(self) -> None:
        d = self.dir
        for sub in ("etc", "munge", "mysql/tmp", "ctld/state", "log", "run", "jobs"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for n in self.node_names:
            (d / "nodes" / n / "spool").mkdir(parents=True, exist_ok=True)
        # munged wants its socket directory reachable by everyone (o+x) on the whole path
        os.chmod(d, 0o755)
        os.chmod(d / "munge", 0o755)
        for path in (
            self.munge_socket,
            self.mysql_socket,
            d / "nodes" / "nodeNN" / "spool" / "nodeNN_4294967295.4294967295",
        ):
            if len(str(path)) > 100:
                raise ClusterError(
                    f"cluster directory path too long for unix sockets: {path} (use a shorter --dir)"
                )

        p = self.ports
        host = socket.gethostname().split(".")[0]
        nodes_lines = "\n".join(
            f"NodeName={n} NodeHostname={n} NodeAddr=127.0.0.1 Port={p[n]} CPUs={CPUS_PER_NODE} "
            f"RealMemory={REAL_MEMORY_MB} State=UNKNOWN"
            for n in self.node_names
        )
        self.conf.write_text(f"""\
# Generated by slurm/cluster.py -- local test cluster, regenerated on every fresh `up`.
ClusterName={CLUSTER_NAME}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={p["slurmctld"]}
SlurmdPort={p[self.node_names[0]]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={d}/ctld/state
SlurmdSpoolDir={d}/nodes/%n/spool
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/nodes/%n/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={p["slurmdbd"]}
# for slurmdbd connections the munge socket is taken from AccountingStoragePass, not from AuthInfo
AccountingStoragePass={self.munge_socket}
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=5
SlurmctldTimeout=10
MessageTimeout=5
InactiveLimit=0
KillWait=5
JobRequeue=1
MailProg=/bin/true
{nodes_lines}
PartitionName={PARTITION} Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
        dbpass = self._db_password()
        dbd = d / "etc" / "slurmdbd.conf"
        dbd.write_text(f"""\
# Generated by slurm/cluster.py
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={p["slurmdbd"]}
SlurmUser=root
DebugLevel=info
LogFile={d}/log/slurmdbd.log
PidFile={d}/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={p["mysqld"]}
StorageUser=slurm
StoragePass={dbpass}
StorageLoc=slurm_acct_db
""")
        os.chmod(dbd, 0o600)
        (d / "mysql" / "my.cnf").write_text(f"""\
[mariadbd]
datadir={d}/mysql/data
socket={self.mysql_socket}
port={p["mysqld"]}
bind-address=127.0.0.1
pid-file={d}/run/mysqld.pid
log-error={d}/log/mysqld.log
tmpdir={d}/mysql/tmp
user=root
skip-name-resolve
innodb_buffer_pool_size=64M
innodb_log_file_size=16M
innodb_use_native_aio=0
innodb_flush_log_at_trx_commit=2
max_connections=100
innodb_lock_wait_timeout=900
[client]
socket={self.mysql_socket}
""")
        hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
        (d / "etc" / "hosts").write_text(
            hosts.rstrip("\n")
            + "\n# slurm/cluster.py emulated nodes\n"
            + "".join(f"127.0.0.1 {n}\n" for n in self.node_names)
        )
        self._write_env()

    def _db_password(self) -> str:
        f = self.dir / "mysql" / "slurm.password"
        if not f.exists():
            f.write_text(secrets.token_hex(12))
            os.chmod(f, 0o600)
        return f.read_text().strip()

    def _write_env(self) -> None:
        v = self.env_vars()
        self.env_file.write_text(
            "# source this file to use the local SLURM cluster (generated by slurm/cluster.py)\n"
            f"export SLURM_CONF={v['SLURM_CONF']}\n"
            f"export SLURM_LOCAL_DIR={v['SLURM_LOCAL_DIR']}\n"
            'case ":$PATH:" in *:/usr/bin:*) ;; *) export PATH="$PATH:/usr/bin" ;; esac\n'
        )

    # ---- daemons
    def _daemon_env(self) -> dict[str, str]:
        e = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "SLURM_CONF": str(self.conf),
            "HOME": str(self.dir),
            "LANG": "C.UTF-8",
        }
        return e

    def _start(self, name: str, cmd: list[str]) -> Proc:
        p = spawn(name, cmd, self._daemon_env(), self.dir / "log" / f"{name}.out", self.dir)
        self.procs[name] = p
        self.save()
        return p

    def _ensure_munge(self) -> None:
        if self.alive("munged"):
            return
        key = self.dir / "munge" / "munge.key"
        if not key.exists():
            run([which("mungekey"), "-c", "-k", str(key)], self._daemon_env(), check=True)
            os.chmod(key, 0o600)
        self.munge_socket.unlink(missing_ok=True)
        self._start(
            "munged",
            [
                which("munged"),
                "-F",
                "--key-file",
                str(key),
                "--socket",
                str(self.munge_socket),
                "--pid-file",
                str(self.dir / "run" / "munged.pid"),
                "--log-file",
                str(self.dir / "log" / "munged.log"),
                "--seed-file",
                str(self.dir / "munge" / "munged.seed"),
                "--num-threads",
                "4",
            ],
        )
        wait_until(
            "munged socket",
            lambda: self._check_alive("munged") and self.munge_socket.exists(),
            20,
            on_timeout=lambda: _tail(self.dir / "log" / "munged.log"),
        )

    def _check_alive(self, name: str) -> bool:
        if not self.alive(name):
            logs = [self.dir / "log" / f"{name}.out", self.dir / "log" / f"{name}.log"]
            raise DaemonDied(f"{name} died during start-up\n" + "\n".join(_tail(x) for x in logs))
        return True

    def _mysql(self, sql: str) -> subprocess.CompletedProcess:
        return run(
            [which("mariadb"), "--no-defaults", f"--socket={self.mysql_socket}", "-uroot", "-N", "-e", sql],
            self._daemon_env(),
            timeout=20,
        )

    def _ensure_mysql(self) -> None:
        if self.alive("mysqld"):
            return
        cnf = self.dir / "mysql" / "my.cnf"
        data = self.dir / "mysql" / "data"
        if not (data / "mysql").exists():
            shutil.rmtree(data, ignore_errors=True)
            t = time.monotonic()
            run(
                [
                    which("mariadb-install-db"),
                    f"--defaults-file={cnf}",
                    "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ],
                self._daemon_env(),
                timeout=180,
                check=True,
            )
            log(f"  initialised mariadb data dir in {time.monotonic() - t:.1f}s")
        self.mysql_socket.unlink(missing_ok=True)
        self._start("mysqld", [which("mariadbd"), f"--defaults-file={cnf}"])
        wait_until(
            "mariadb",
            lambda: self._check_alive("mysqld") and self._mysql("SELECT 1").returncode == 0,
            60,
            on_timeout=lambda: _tail(self.dir / "log" / "mysqld.log"),
        )
        pw = self._db_password()
        sql = " ".join(
            f"CREATE USER IF NOT EXISTS 'slurm'@'{h}' IDENTIFIED BY '{pw}'; "
            f"ALTER USER 'slurm'@'{h}' IDENTIFIED BY '{pw}'; "
            f"GRANT ALL ON slurm_acct_db.* TO 'slurm'@'{h}';"
            for h in ("127.0.0.1", "localhost")
        )
        cp = self._mysql(sql + " FLUSH PRIVILEGES;")
        if cp.returncode != 0:
            raise ClusterError(f"creating the accounting db user failed: {cp.stderr}")

    def _ensure_slurmdbd(self) -> None:
        if not self.alive("slurmdbd"):
            self._start("slurmdbd", [which("slurmdbd"), "-D"])
        env = self.env
        wait_until(
            "slurmdbd",
            lambda: (
                self._check_alive("slurmdbd")
                and run(
                    [which("sacctmgr"), "-n", "-P", "list", "cluster", "format=cluster"], env, timeout=15
                ).returncode
                == 0
            ),
            90,
            interval=0.5,
            on_timeout=lambda: _tail(self.dir / "log" / "slurmdbd.log"),
        )
        clusters = run(
            [which("sacctmgr"), "-n", "-P", "list", "cluster", "format=cluster"], env, check=True
        ).stdout.split()
        if CLUSTER_NAME not in clusters:
            run([which("sacctmgr"), "-i", "add", "cluster", CLUSTER_NAME], env, check=True)
        accounts = run(
            [which("sacctmgr"), "-n", "-P", "list", "account", "format=account"], env, check=True
        ).stdout.split()
        if "default" not in accounts:
            run(
                [
                    which("sacctmgr"),
                    "-i",
                    "add",
                    "account",
                    "default",
                    f"Cluster={CLUSTER_NAME}",
                    "Description=local test account",
                    "Organization=local",
                ],
                env,
                check=True,
            )
        users = run(
            [
                which("sacctmgr"),
                "-n",
                "-P",
                "list",
                "assoc",
                "format=user,account",
                f"cluster={CLUSTER_NAME}",
            ],
            env,
            check=True,
        ).stdout.split()
        if "root|default" not in users:
            run(
                [
                    which("sacctmgr"),
                    "-i",
                    "add",
                    "user",
                    "root",
                    "Account=default",
                    f"Cluster={CLUSTER_NAME}",
                ],
                env,
                check=True,
            )

    def _ensure_slurmctld(self) -> None:
        if not self.alive("slurmctld"):
            self._start("slurmctld", [which("slurmctld"), "-D", "-i"])
        env = self.env
        wait_until(
            "slurmctld",
            lambda: (
                self._check_alive("slurmctld")
                and run([which("scontrol"), "ping"], env, timeout=10).stdout.count("UP") >= 1
            ),
            60,
            interval=0.3,
            on_timeout=lambda: _tail(self.dir / "log" / "slurmctld.log"),
        )

    def _start_node(self, name: str) -> None:
        if name not in self.node_names:
            raise ClusterError(f"unknown node {name}; nodes: {', '.join(self.node_names)}")
        if self.alive(name):
            return
        (self.dir / "nodes" / name / "spool").mkdir(parents=True, exist_ok=True)
        inner = (
            f"hostname {name} && mount --bind {self.dir}/etc/hosts /etc/hosts && "
            f"exec {which('slurmd')} -D -N {name}"
        )
        p = self._start(
            name,
            [
                which("unshare"),
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
                "--uts",
                "--",
                "/bin/sh",
                "-c",
                inner,
            ],
        )

        # record the node's PID namespace (that of unshare's child, PID 1 inside) to find all its processes
        def child_ns():
            for pid in _pids():
                st = _stat(pid)
                if st and st[1] == p.pid:
                    ns = _pidns(pid)
                    if ns and ns != _pidns(p.pid):
                        return ns
            if not p.leader_alive():
                raise DaemonDied(f"{name} died at start\n" + _tail(self.dir / "log" / f"{name}.out"))
            return None

        p.pidns = wait_until(f"{name} namespace", child_ns, 10, interval=0.05)
        self.save()

    def node_states(self) -> dict[str, str]:
        cp = run([which("sinfo"), "-h", "-N", "-o", "%N %T"], self.env, timeout=15)
        if cp.returncode != 0:
            raise ClusterError(cp.stderr.strip())
        out = {}
        for line in cp.stdout.splitlines():
            if line.strip():
                n, s = line.split()[:2]
                out[n] = s.lower()
        return out

    def node_info(self) -> dict[str, dict[str, str]]:
        """`scontrol show node -o` parsed: {node: {key: value}}, plus `_slurmd_start` (epoch seconds)."""
        cp = run([which("scontrol"), "show", "node", "-o"], self.env, timeout=15)
        if cp.returncode != 0:
            raise ClusterError(cp.stderr.strip())
        out: dict[str, dict] = {}
        for line in cp.stdout.splitlines():
            kv = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))
            if "NodeName" in kv:
                try:
                    kv["_slurmd_start"] = time.mktime(
                        time.strptime(kv.get("SlurmdStartTime", ""), "%Y-%m-%dT%H:%M:%S")
                    )
                except ValueError:
                    kv["_slurmd_start"] = 0
                out[kv["NodeName"]] = kv
        return out

    def sinfo(self) -> str:
        return run([which("sinfo"), "-N", "-l"], self.env, timeout=15).stdout

    def sacct_ok(self) -> bool:
        return run([which("sacct"), "-n", "-X", "-a"], self.env, timeout=15).returncode == 0

    # ---- commands
    def up(self, deadline_s: float = 180) -> float:
        if os.geteuid() != 0:
            raise ClusterError("the local cluster must be started as root")
        missing = missing_binaries()
        if missing:
            raise ClusterError(f"missing binaries: {', '.join(missing)}; run slurm/install.sh")
        t0 = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        for attempt in (1, 2, 3):
            fresh = not self.any_alive()
            try:
                self._up(deadline_s)
                break
            except DaemonDied as e:
                # most likely a port taken between picking and binding (another cluster starting): retry
                if not fresh or attempt == 3:
                    raise
                log(f"start-up attempt {attempt} failed ({str(e).splitlines()[0]}); stopping and retrying")
                self.down()
        dt = time.monotonic() - t0
        log(f"cluster up in {dt:.1f}s")
        return dt

    def _up(self, deadline_s: float) -> None:
        if not self.any_alive():
            names = ["slurmctld", "slurmdbd", "mysqld", *self.node_names]
            self.ports = dict(zip(names, pick_ports(len(names))))
            self.procs = {}
            self._write_configs()
            self.save()
            log(f"fresh start in {self.dir}: ports {self.ports}")
        else:
            log(f"cluster in {self.dir} partly/fully running; starting what is missing")
        try:
            for step, fn in [
                ("munged", self._ensure_munge),
                ("mariadb", self._ensure_mysql),
                ("slurmdbd + accounts", self._ensure_slurmdbd),
                ("slurmctld", self._ensure_slurmctld),
            ]:
                t = time.monotonic()
                fn()
                log(f"  {step} ready ({time.monotonic() - t:.1f}s)")
            t = time.monotonic()
            for n in self.node_names:
                self._start_node(n)
            self._wait_nodes(self.node_names, deadline_s)
            wait_until("sacct", self.sacct_ok, 30)
            log(f"  {self.nodes} nodes idle ({time.monotonic() - t:.1f}s)")
        except BaseException:
            log("bring-up failed; logs are in " + str(self.dir / "log"))
            raise

    def _wait_nodes(self, names: list[str], deadline_s: float, ok=("idle",)) -> None:
        def ready():
            for n in names:
                self._check_alive(n)
            st = self.node_states()
            if not all(st.get(n, "") in ok for n in names):  # "idle*" (not responding) is not ready
                return False
            # the state may be a stale one restored by slurmctld: require a registration of *this* slurmd
            info = self.node_info()
            return all(info.get(n, {}).get("_slurmd_start", 0) >= self.procs[n].started_at - 2 for n in names)

        # ReturnToService=2 brings DOWN nodes back on registration; resume any left drained/down by a past run
        def resume_stuck():
            st = self.node_states()
            stuck = [n for n in names if st.get(n, "").startswith(("down", "drain")) and self.alive(n)]
            if stuck:
                run([which("scontrol"), "update", f"NodeName={','.join(stuck)}", "State=RESUME"], self.env)

        t0 = time.monotonic()
        while True:
            try:
                if ready():
                    return
            except DaemonDied:
                raise
            except ClusterError:
                if time.monotonic() - t0 > deadline_s:
                    raise
            if time.monotonic() - t0 > 10:
                resume_stuck()
            if time.monotonic() - t0 > deadline_s:
                raise ClusterError(
                    f"timed out waiting for nodes {names} to be {'/'.join(ok)}: "
                    f"{self.node_states()}\n" + _tail(self.dir / "log" / "slurmctld.log")
                )
            time.sleep(0.3)

    def start_node(self, name: str, wait: bool = True, deadline_s: float = 90) -> float:
        t0 = time.monotonic()
        self._start_node(name)
        if wait:
            self._wait_nodes([name], deadline_s, ok=("idle", "mixed", "allocated", "completing"))
        return time.monotonic() - t0

    def kill_node(self, name: str, deadline_s: float = 20) -> None:
        """Hardware failure: SIGKILL the node's whole process group and namespace, at once."""
        p = self.procs.get(name)
        if p is None or not p.alive():
            raise ClusterError(f"{name} is not running")
        p.signal(signal.SIGKILL)
        wait_until(f"{name} to die", lambda: not p.alive(), deadline_s, interval=0.05)
        # The kernel gives a dead namespace's inode number to the next namespace created on the machine
        # (another cluster's node, any unshare): forget it, or that stranger would count as this node
        # alive (start-node would skip it; down would kill it).
        p.pidns = None
        self.save()

    def down(self, deadline_s: float = 30) -> float:
        t0 = time.monotonic()
        if not self.procs:
            log(f"nothing recorded in {self.state_file}; nothing to stop")
            return 0.0
        for phase in STOP_PHASES:
            names = [n for ph in phase for n in (self.node_names if ph == "nodes" else [ph])]
            procs = [self.procs[n] for n in names if n in self.procs and self.procs[n].alive()]
            for p in procs:
                p.signal(signal.SIGTERM)
            t = time.monotonic()
            while any(p.alive() for p in procs) and time.monotonic() - t < deadline_s:
                time.sleep(0.1)
            for p in procs:
                if p.alive():
                    log(f"  {p.name} ignored SIGTERM for {deadline_s:.0f}s: SIGKILL")
                    p.signal(signal.SIGKILL)
            t = time.monotonic()
            while any(p.alive() for p in procs) and time.monotonic() - t < 10:
                time.sleep(0.1)
        left = self.leftovers()
        if left:
            raise ClusterError(f"processes still running after down: {left}")
        self.procs = {}
        self.save()
        dt = time.monotonic() - t0
        log(f"cluster in {self.dir} down in {dt:.1f}s; no process left")
        return dt

    def status(self) -> int:
        if not self.procs:
            print(f"{self.dir}: not running")
            return 3
        rc = 0
        for name, p in self.procs.items():
            a = p.alive()
            rc = rc or (0 if a else 1)
            print(f"{name:10s} pid {p.pid:>7d}  {'running' if a else 'DEAD'}")
        if self.alive("slurmctld"):
            try:
                print(self.sinfo())
            except (ClusterError, subprocess.SubprocessError) as e:
                print(f"sinfo failed: {e}")
        return rc


def print_usage_hint(c: Cluster) -> None:
    print(f"""
Use it:
  source {c.env_file}
  sinfo
  sbatch -N2 --wrap 'srun hostname'
  squeue; sacct
Kill / restore a node:  {sys.argv[0]} kill-node node2 --dir {c.dir}; {sys.argv[0]} start-node node2 --dir {c.dir}
Stop:                   {sys.argv[0]} down --dir {c.dir}
Logs:                   {c.dir}/log/""")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "status", "kill-node", "start-node", "env"])
    ap.add_argument("node", nargs="?")
    ap.add_argument("--dir", default=os.environ.get("SLURM_LOCAL_DIR", str(DEFAULT_DIR)))
    ap.add_argument("--nodes", type=int, default=None, help="number of nodes for a fresh `up` (default 3)")
    ap.add_argument("--timeout", type=float, default=180, help="deadline in seconds for waits")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `cluster.sh status | head` must not raise
    try:
        c = Cluster.load(Path(a.dir), a.nodes)
        if a.command == "up":
            c.up(a.timeout)
            print_usage_hint(c)
        elif a.command == "down":
            c.down()
        elif a.command == "status":
            return c.status()
        elif a.command == "env":
            print(c.env_file.read_text() if c.env_file.exists() else f"no {c.env_file}; run up first")
        elif a.command in ("kill-node", "start-node"):
            if not a.node:
                ap.error(f"{a.command} needs a node name")
            if a.command == "kill-node":
                t = time.monotonic()
                c.kill_node(a.node)
                log(f"{a.node} killed (SIGKILL, {time.monotonic() - t:.2f}s)")
            else:
                dt = c.start_node(a.node, deadline_s=a.timeout)
                log(f"{a.node} up in {dt:.1f}s")
        return 0
    except ClusterError as e:
        print(f"[slurm-local] ERROR: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
