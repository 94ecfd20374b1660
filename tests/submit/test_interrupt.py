"""pipeline.submit.interrupt without training: the command's side of Ctrl-C, on stand-in processes.

The end-to-end drills (both presses during pretraining) are tests/e2e/test_ctrl_c.py; here, in a second, the
grace period that no e2e test waits out, and the SIGINT disposition the job's processes start with.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import pytest

from pipeline.submit import interrupt
from tests.support.timing import scaled

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
PARENT = [  # a job's controller stand-in: one child (a rank), both asleep
    sys.executable,
    "-c",
    f"import subprocess, time; subprocess.Popen({SLEEPER!r}); time.sleep(600)",
]


def wait_for(what: str, cond: Callable[[], object], timeout: float = scaled(30)) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


@dataclass
class StandInJob:
    """What interrupt.follow uses of a submitit local job: its controller's pid and whether it ended."""

    process: subprocess.Popen[bytes]

    @property
    def job_id(self) -> str:
        return str(self.process.pid)

    def done(self) -> bool:
        return self.process.poll() is not None


def test_ctrl_c_is_counted_and_processes_started_meanwhile_ignore_it() -> None:
    with interrupt.catching() as presses:
        with interrupt.ignoring_sigint():
            child = subprocess.Popen(SLEEPER)
        try:
            os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: counted
            child.send_signal(signal.SIGINT)
            wait_for("the press to be counted", lambda: presses.count == 1)
            with pytest.raises(subprocess.TimeoutExpired):
                child.wait(timeout=0.5)  # SIGINT ignored: a default python would have died of it at once
        finally:
            child.kill()
            child.wait()
    assert presses.first_at is not None and not presses.past_grace(60)
    presses.press(signal.SIGINT, None)
    assert presses.past_grace(60)  # a second press: at once


def test_ctrl_c_is_sent_again_until_a_rank_still_starting_up_heeds_it() -> None:
    # the rank ignores SIGINT at first (inherited), then heeds it (exit 7) as run_stage does; its controller
    # stand-in passes its exit code on
    rank = "import signal, sys, time; time.sleep(0.3); signal.signal(signal.SIGINT, lambda *_: sys.exit(7)); time.sleep(600)"
    controller = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {rank!r}]))"
    with interrupt.ignoring_sigint():
        job = StandInJob(subprocess.Popen([sys.executable, "-c", controller]))
    try:
        wait_for("the stand-in rank", lambda: psutil.Process(job.process.pid).children())
        presses = interrupt.Presses()
        presses.press(signal.SIGINT, None)
        assert not interrupt.follow(job, lambda: None, presses, grace_s=scaled(30), poll_s=0.01)
        assert job.process.wait(timeout=scaled(10)) == 7
    finally:
        interrupt.kill_job(job.process.pid)
        job.process.wait()


def test_a_job_still_running_after_the_grace_period_is_killed_whole() -> None:
    job = StandInJob(subprocess.Popen(PARENT))
    rank: list[psutil.Process] = []
    try:
        wait_for("the stand-in rank", lambda: rank.extend(psutil.Process(job.process.pid).children()) or rank)
        presses = interrupt.Presses()
        presses.press(signal.SIGINT, None)
        polls: list[int] = []
        assert interrupt.follow(job, lambda: polls.append(1), presses, grace_s=0.2, poll_s=0.01)
        assert not polls, "no metrics followed after the press"
        assert job.process.wait(timeout=scaled(10)) == -signal.SIGKILL
        wait_for("the rank to end", lambda: gone(rank[0]))
    finally:
        for p in rank:
            with contextlib.suppress(psutil.Error):
                p.kill()
        job.process.kill()
        job.process.wait()
    line = interrupt.killed_line("pretrain", presses, 0.2)
    assert line.startswith("[pretrain] stopped at once on no checkpoint within 0.2 s of Ctrl-C"), line
