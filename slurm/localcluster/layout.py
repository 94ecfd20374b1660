"""Where a cluster keeps everything (one directory): config, sockets, state file; the client environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Layout:
    dir: Path
    nodes: int = 3

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
