"""The local multi-node SLURM test cluster (slurm/cluster.py is its command line; see slurm/README.md).

Modules, bottom up: common (constants, errors, subprocess and wait helpers, ports), procs (the processes it
started), layout (its directory), configs (the files it writes), supervisor (state.json, starting a daemon),
daemons (each daemon brought up), cluster (up/down/node failure), cli. Standard library only.
"""

from .cluster import Cluster
from .common import CLUSTER_NAME, PARTITION, ClusterError, DaemonDied, missing_binaries
from .procs import Proc, pids, stat

__all__ = [
    "CLUSTER_NAME",
    "PARTITION",
    "Cluster",
    "ClusterError",
    "DaemonDied",
    "Proc",
    "missing_binaries",
    "pids",
    "stat",
]
