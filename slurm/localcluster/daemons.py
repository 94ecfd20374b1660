"""Starting each daemon of the cluster and waiting until it answers: munged, mariadb, slurmdbd (with the
cluster's accounts), slurmctld, and the nodes (slurmd in PID+UTS+mount namespaces); the sinfo/scontrol queries.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

from .common import CLUSTER_NAME, ClusterError, DaemonDied, log, run, tail, wait_until, which
from .configs import db_password
from .procs import pidns, pids, stat
from .supervisor import Supervisor


class Daemons(Supervisor):
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
            on_timeout=lambda: tail(self.dir / "log" / "munged.log"),
        )

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
            on_timeout=lambda: tail(self.dir / "log" / "mysqld.log"),
        )
        pw = db_password(self)
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
            on_timeout=lambda: tail(self.dir / "log" / "slurmdbd.log"),
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
            on_timeout=lambda: tail(self.dir / "log" / "slurmctld.log"),
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
            for pid in pids():
                st = stat(pid)
                if st and st[1] == p.pid:
                    ns = pidns(pid)
                    if ns and ns != pidns(p.pid):
                        return ns
            if not p.leader_alive():
                raise DaemonDied(f"{name} died at start\n" + tail(self.dir / "log" / f"{name}.out"))
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
