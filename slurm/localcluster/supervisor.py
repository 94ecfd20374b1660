"""The record of what a cluster started (state.json: ports and processes) and how it starts a daemon."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from .common import ClusterError, DaemonDied, tail
from .layout import Layout
from .procs import Proc, spawn


@dataclass
class Supervisor(Layout):
    procs: dict[str, Proc] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    # ---- state
    @classmethod
    def load(cls, d: Path, nodes: int | None = None) -> Self:
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

    def _check_alive(self, name: str) -> bool:
        if not self.alive(name):
            logs = [self.dir / "log" / f"{name}.out", self.dir / "log" / f"{name}.log"]
            raise DaemonDied(f"{name} died during start-up\n" + "\n".join(tail(x) for x in logs))
        return True
