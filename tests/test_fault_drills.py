"""Fault drills at the engine level, with real faults: a SIGKILLed training process, a full filesystem,
checkpoint files carrying pickle payloads. The drills through the command line are in
test_fault_tolerance.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent

HELPERS_SCRIPT = """
import multiprocessing as mp, os, sys, time
from stages.engine import checkpoint

if __name__ == "__main__":
    checkpoint._signal_safe_writer_queue()  # the writer's results-queue manager, as the first save starts it
    writer = mp.get_context("fork").Process(target=time.sleep, args=(600,))  # like megatron's async writer
    writer.start()
    print(checkpoint._MANAGER._process.pid, writer.pid, flush=True)
    time.sleep(600)
"""


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_checkpoint_writer_helpers_die_with_a_killed_training_process() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HELPERS_SCRIPT], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        helpers = [int(x) for x in proc.stdout.readline().split()]
        assert len(helpers) == 2, helpers
        kids = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert set(helpers) <= kids
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        left = wait_gone(sorted(kids), timeout=30)
    finally:
        proc.kill()
        proc.wait()
    for pid in left:  # leave nothing behind, even when the drill fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"helpers outlived the SIGKILLed training process: {left}"
