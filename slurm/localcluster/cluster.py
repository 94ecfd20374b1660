"""The cluster's lifecycle: `up` (fresh or completing a partial one), node failure and return, `down`, status."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from .common import (
    STOP_PHASES,
    ClusterError,
    DaemonDied,
    log,
    missing_binaries,
    pick_ports,
    run,
    tail,
    wait_until,
    which,
)
from .configs import write_configs
from .daemons import Daemons


class Cluster(Daemons):
    """A real SLURM cluster on this machine, everything under `dir`; `state.json` records what it started."""

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
            write_configs(self, self.ports)
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
                    f"{self.node_states()}\n" + tail(self.dir / "log" / "slurmctld.log")
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
