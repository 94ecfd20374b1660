"""Processes the cluster started, identified by (pid, kernel start time): /proc queries, signalling, spawning.

Process identity is (pid, start time in clock ticks since boot); zombies count as dead.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from .common import ClusterError


def stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, starttime) or None if the process does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw.rsplit(")", 1)[1].split()
    # rest[0] = state (field 3), rest[1] = ppid, rest[2] = pgrp, rest[19] = starttime (field 22)
    return rest[0], int(rest[1]), int(rest[2]), int(rest[19])


def pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def pidns(pid: int) -> str | None:
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
        st = stat(self.pid)
        return st is not None and st[3] == self.start and st[0] not in ("Z", "X")

    def members(self) -> list[int]:
        """Live processes belonging to it: its process group (born after the leader) and, for a node,
        everything in the node's PID namespace."""
        out = []
        for pid in pids():
            st = stat(pid)
            if st is None or st[0] in ("Z", "X"):
                continue
            if (st[2] == self.pid and st[3] >= self.start) or (self.pidns and pidns(pid) == self.pidns):
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
    st = stat(pid)
    if st is None:
        raise ClusterError(f"{name} exited immediately; see {log_path}")
    return Proc(name, pid, st[3], started_at=time.time())
