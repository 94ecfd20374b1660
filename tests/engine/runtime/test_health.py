"""The node health check: figures per node, the slow or failing node named by hostname; a real two-rank gloo
check where one rank is slowed from outside (a SIGSTOP/SIGCONT duty cycle) names that rank's node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.runtime.health import NodeFigures, by_node, judge
from pipeline.schema.build import from_dict
from pipeline.schema.errors import ConfigError
from tests.support.env import rank_env
from tests.support.timing import scaled


def test_judge_names_the_slow_and_the_failing_node_by_hostname() -> None:
    nodes = [NodeFigures(f"node{i}", [i], 0.010, 0.002) for i in range(4)]
    assert judge(nodes, 1.5) == {}
    nodes[1].allreduce_s = 0.2  # a rank that waited in the collective: reported, never named for it
    assert judge(nodes, 1.5) == {}
    nodes[2].matmul_s = 0.031
    nodes[3].error = "RuntimeError: CUDA error: an illegal memory access"
    slow = judge(nodes, 1.5)
    assert set(slow) == {"node2", "node3"}
    assert slow["node2"].startswith("matmul_s 31.00 ms = 3.1x the other nodes' median 10.00 ms"), slow
    assert "illegal memory access" in slow["node3"]


def test_a_node_is_as_slow_as_its_slowest_rank() -> None:
    per_rank = [
        {"host": "a", "rank": 0, "matmul_s": 0.01, "allreduce_s": 0.001},
        {"host": "a", "rank": 1, "matmul_s": 0.05, "allreduce_s": 0.001},
        {"host": "b", "rank": 2, "matmul_s": 0.01, "allreduce_s": 0.001, "error": None},
    ]
    a, b = by_node(per_rank)
    assert (a.host, a.ranks, a.matmul_s, b.ranks) == ("a", [0, 1], 0.05, [2])


def test_policy_is_checked_with_the_key_named() -> None:
    assert from_dict({"cluster": {"health": {"policy": "warn"}}}).cluster.health.policy == "warn"
    with pytest.raises(ConfigError, match="cluster.health.policy"):
        from_dict({"cluster": {"health": {"policy": "sometimes"}}})
    with pytest.raises(ConfigError, match="cluster.health.slow_factor"):
        from_dict({"cluster": {"health": {"slow_factor": 1.0}}})


def _duty_cycle(pid: int, stop: threading.Event, off_s: float = 0.03, on_s: float = 0.003) -> None:
    """Slow process ``pid`` from outside: stopped most of the time, running a little."""
    while not stop.is_set():
        os.kill(pid, signal.SIGSTOP)
        time.sleep(off_s)
        os.kill(pid, signal.SIGCONT)
        time.sleep(on_s)
    os.kill(pid, signal.SIGCONT)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_two_rank_check_names_the_node_slowed_from_outside(tmp_path: Path) -> None:
    go = tmp_path / "go"
    cfg = json.dumps({"policy": "warn", "matmul_size": 768, "allreduce_mb": 0.25, "repeats": 5})
    env0 = rank_env(0, 2, OMP_NUM_THREADS="1")
    env1 = rank_env(1, 2, port=int(env0["MASTER_PORT"]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tests.support.health_worker"]
    procs = [
        subprocess.Popen([*cmd, host, str(go), cfg], env=env, stdout=subprocess.PIPE, text=True)
        for host, env in (("fast-node", env0), ("slow-node", env1))
    ]
    stop = threading.Event()
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        slower = threading.Thread(target=_duty_cycle, args=(procs[1].pid, stop), daemon=True)
        slower.start()
        go.write_text("")
        out, _ = procs[0].communicate(timeout=scaled(150))
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=scaled(30))
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report["nodes"]) == {"fast-node", "slow-node"}
    assert report["nodes"]["slow-node"]["matmul_s"] > 0 and report["nodes"]["fast-node"]["allreduce_s"] > 0
    assert list(report["slow"]) == ["slow-node"], report
    assert report["slow"]["slow-node"].startswith("matmul_s"), report
