"""Ctrl-C on the companion commands that run for a while (``pipeline.status --watch``, ``pipeline.plan
--simulate-failures``; ``pipeline.export`` is in tests/e2e/test_export_files.py, beside a run it exports): SIGINT to
the command's process group, as a terminal sends it, ends it with one line on stderr, no traceback, exit 130."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.records.ledger import Ledger
from pipeline.submit.interrupt import EXIT_INTERRUPTED
from tests.schema.test_plan import PLAN_70B
from tests.support.env import REPO
from tests.support.timing import scaled


def interrupted(*args: str) -> tuple[int, str, list[str]]:
    """Start ``python -m ARGS`` in a session of its own, SIGINT its process group once it has printed, and
    return (exit code, what it printed, stderr's lines)."""
    cmd = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert cmd.stdout is not None
    try:
        ready, _, _ = select.select([cmd.stdout], [], [], scaled(120))
        assert ready and cmd.poll() is None, "the command printed nothing, or ended, before the signal"
        first = os.read(cmd.stdout.fileno(), 1 << 16).decode()
        time.sleep(0.3)  # a line printed: the command is in its long part
        os.killpg(cmd.pid, signal.SIGINT)
        out, err = cmd.communicate(timeout=scaled(60))
    finally:
        if cmd.poll() is None:
            os.killpg(cmd.pid, signal.SIGKILL)
            cmd.wait()
    return cmd.returncode, first + out.decode(), err.decode().splitlines()


def test_status_watch_stops_on_ctrl_c_in_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    Ledger(run).update("pretrain", status="running")
    code, out, err = interrupted("pipeline.status", str(run), "--watch", "0.2")
    assert "pretrain" in out
    assert code == EXIT_INTERRUPTED and err == [
        "[status] stopped on Ctrl-C: the run goes on; --watch again to follow it"
    ], err


@pytest.mark.timeout(300)
def test_plan_simulation_stops_on_ctrl_c_in_one_line() -> None:
    args = [*PLAN_70B, "cluster.node_mtbf_hours=6300", "pretrain.iters=100000", "cluster.max_requeues=20"]
    code, out, err = interrupted("pipeline.plan", *args, "--simulate-failures", "--replications=100000000")
    assert "pretrain" in out and "failure simulation" not in out  # the plan printed, the simulation cut short
    assert code == EXIT_INTERRUPTED and len(err) == 1, err
    assert err[0].startswith("[plan] stopped on Ctrl-C: the failure simulation is left out"), err
