"""Helpers for tests that drive ``python -m pipeline ... cluster=slurm`` on the local SLURM cluster.

Shared by tests/slurm/test_slurm_pipeline.py and tests/slurm/test_slurm_node_failure.py. The fixture ``cluster`` (the
session cluster with its variables in os.environ) is registered in tests/conftest.py.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from pipeline.records.ledger import Ledger
from pipeline.reporting.status import StageView, run_status
from tests.support.env import REPO
from tests.support.slurm_cluster import wait_for
from tests.support.timing import scaled

TINY = [
    "experiment=tiny",
    "cluster=slurm",
    "pretrain.save_interval=6",  # tiny runs 6/4/4 steps: save once, at the end
    "sft.save_interval=4",
    "rlhf.save_interval=4",
]
TWO_NODES = ["pretrain.parallel.dp=2", "pretrain.parallel.nodes=2", "pretrain.threads=1"]
SETTLED = ("completed", "failed", "blocked", "cancelled")


@pytest.fixture
def cluster(slurm_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The session cluster, with its variables in os.environ (pipeline.reporting.status calls squeue/sacct here)."""
    for k, v in slurm_cluster.vars.items():
        monkeypatch.setenv(k, v)
    slurm_cluster.wait_nodes_idle(deadline_s=scaled(120))
    yield slurm_cluster

    # nothing a test submitted outlives it (a failed test's held or pending jobs would wait for the next tests)
    def queued() -> list[str]:
        return str(slurm_cluster.run("squeue", "-h", "-o", "%i", check=False).stdout).split()

    if left := queued():
        slurm_cluster.run("scancel", *left, check=False)
        wait_for(lambda: not queued(), 60, lambda: f"jobs left after scancel: {queued()}")


def pipeline(
    cluster: Any, *args: str, cwd: Path = REPO, env: dict[str, str] | None = None, module: str = "pipeline"
) -> subprocess.CompletedProcess[str]:
    """``python -m <module> ARGS`` with the cluster's environment; no PYTHONPATH unless ``env`` sets one."""
    full = {k: v for k, v in cluster.env.items() if k not in ("PYTHONPATH", "PIPELINE_FAULT")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=scaled(180),
    )


def run_dirs(stdout: str) -> list[Path]:
    """Run directories named by 'run directory:' lines, in order, without repeats."""
    found = [
        Path(ln.split(":", 1)[1].strip()) for ln in stdout.splitlines() if ln.startswith("run directory:")
    ]
    return list(dict.fromkeys(found))


def submitted(stdout: str) -> dict[str, str]:
    """{stage: job id} from '[stage] submitted job N' lines."""
    return dict(re.findall(r"^\[(\w+)\] submitted job (\d+)", stdout, flags=re.M))


def describe_status(run_dir: Path) -> str:
    return "; ".join(f"{v.stage}={v.state} {v.detail}" for v in run_status(run_dir))


def wait_settled(run_dir: Path, stages: list[str], deadline_s: float) -> dict[str, StageView]:
    """Poll pipeline.reporting.status until every stage completed, failed, is blocked or was cancelled."""

    def settled() -> dict[str, StageView] | None:
        views = {v.stage: v for v in run_status(run_dir)}
        done = all(s in views and views[s].state in SETTLED for s in stages)
        return views if done else None

    return wait_for(settled, deadline_s, lambda: describe_status(run_dir), interval=2.0)


def events(run_dir: Path, kind: str, stage: str) -> list[dict]:
    return [e for e in Ledger(run_dir).events() if e["event"] == kind and e["stage"] == stage]


def assert_ran_from_snapshot(run_dir: Path, stages: list[str]) -> None:
    """Each job imported pipeline/ and stages/ from run_dir/code/<stamp>, not from a checkout."""
    for s in stages:
        codes = {e["code"] for e in events(run_dir, "started", s)}
        assert codes and all(Path(c).parent == run_dir / "code" for c in codes), (s, codes)


def sacct(cluster: Any, job_id: str, field: str = "State") -> list[str]:
    """One value per run of the job (-D: requeued runs too); states as one word ('CANCELLED by 0')."""
    out = cluster.run("sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", field).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.strip()]


def sacct_ends(cluster: Any, job_id: str) -> list[tuple[str, float]]:
    """(state, end time as epoch seconds; inf while it runs) per run of the job, oldest first."""
    out = cluster.run("sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State,End").stdout
    runs = []
    for ln in out.splitlines():
        if "|" in ln:
            state, _, end = ln.partition("|")
            try:
                t = datetime.fromisoformat(end.strip()).timestamp()
            except ValueError:  # "Unknown": not ended
                t = math.inf
            runs.append((state.split()[0], t))
    return runs


def wait_sacct(
    cluster: Any, job_id: str, runs: list[str], deadline_s: float = scaled(120), run_dir: Path | None = None
) -> None:
    """Poll until sacct shows exactly ``runs``: the ledger says completed a moment before the job exits.
    With ``run_dir`` a failure also prints the run's events and its job logs' tails (what happened, and when)."""

    def describe() -> str:
        rows = cluster.run(
            "sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State,Reason,Start,End,NodeList"
        )
        text = f"job {job_id}: {sacct(cluster, job_id)}\n{rows.stdout}"
        return text + (f"\n{run_story(run_dir)}" if run_dir else "")

    wait_for(lambda: sacct(cluster, job_id) == runs, deadline_s, describe)


def run_story(run_dir: Path, tail: int = 40) -> str:
    """The run's ledger events (one line each) and the last ``tail`` lines of every job log."""
    lines = [json.dumps(e, default=str)[:400] for e in Ledger(run_dir).events()]
    for log in sorted((run_dir / "jobs").rglob("*_log.*")):
        lines += [f"--- {log.relative_to(run_dir)}", *log.read_text(errors="replace").splitlines()[-tail:]]
    return "\n".join(lines)


def hostnames(cluster: Any, nodelist: str) -> list[str]:
    """'node[1-2]' -> ['node1', 'node2'] (scontrol show hostnames)."""
    return cluster.run("scontrol", "show", "hostnames", nodelist).stdout.split()


def fail_text(r: subprocess.CompletedProcess[str]) -> str:
    return f"rc={r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
