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
import os
import signal
import sys
import time
from pathlib import Path

from .cluster import Cluster
from .common import DEFAULT_DIR, ClusterError, log


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
