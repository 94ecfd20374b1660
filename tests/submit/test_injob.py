"""The in-job restart supervisor (pipeline/submit/injob.py) on plain processes: a rank that dies is started again
with its attempt and the restarts left in its environment, at most RESTARTS times; a signal to the supervisor
reaches the rank and ends the restarts. The real job: tests/slurm/test_slurm_injob.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.submit.injob import main
from tests.support.env import REPO
from tests.support.timing import scaled

RANK = """
import os, sys
from pathlib import Path
log = Path(sys.argv[1])
log.write_text(log.read_text() + os.environ["PIPELINE_INJOB_ATTEMPT"] + "/" + os.environ["PIPELINE_INJOB_LEFT"] + " ")
sys.exit(0 if int(os.environ["PIPELINE_INJOB_ATTEMPT"]) >= int(sys.argv[2]) else 3)
"""


def run(tmp_path: Path, restarts: int, succeed_at: int) -> tuple[int, str]:
    log = tmp_path / "starts"
    log.write_text("")
    rc = main([str(restarts), sys.executable, "-c", RANK, str(log), str(succeed_at)])
    return rc, log.read_text().strip()


def test_a_dying_rank_is_started_again_up_to_restarts_times(tmp_path: Path) -> None:
    assert run(tmp_path, restarts=3, succeed_at=2) == (0, "0/3 1/2 2/1")
    assert run(tmp_path, restarts=2, succeed_at=9) == (3, "0/2 1/1 2/0")
    assert run(tmp_path, restarts=0, succeed_at=1) == (3, "0/0")


def test_a_signal_reaches_the_rank_and_ends_the_restarts(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    rank = f"import pathlib, time; pathlib.Path({str(ready)!r}).write_text('x'); time.sleep(60)"
    cmd = [sys.executable, "-m", "pipeline.submit.injob", "5", sys.executable, "-c", rank]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + scaled(60)
        while not ready.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the rank never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert (
            proc.wait(timeout=scaled(30)) == 128 + signal.SIGTERM
        )  # the rank died of it; nothing started again
        assert "starting it again" not in (proc.stdout.read() if proc.stdout else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
