"""Ctrl-C during pretraining keeps the work and says so in one line (pipeline/submit/interrupt.py).

The command runs in its own session and gets SIGINT on its whole process group, as a terminal sends it. The
first press: the stage saves at its next step boundary, the command prints one line and exits 130, the ledger
says ``interrupted``, and the re-run ends bit-identical to an uninterrupted run. A second press a second later
stops at once, as resumable. A fault holds the rank at a known step (``PIPELINE_FAULT``) before the signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psutil
import pytest
import torch

from pipeline.records.ledger import Ledger
from tests.support import cli
from tests.support.cli import metrics, run_dir, seeded
from tests.support.env import REPO
from tests.support.timing import scaled
from tests.support.weights import assert_identical, final_tensors

BASE = [
    "experiment=tiny",
    "run.stages=[data_prep,pretrain]",
    "pretrain.save_interval=50",  # no periodic save before the signal: the one it keeps is Ctrl-C's
    "pretrain.hang_timeout_s=60",
]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
run = partial(cli.run, base=BASE)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    cli.ok(run(root, "run.stages=[data_prep]"))
    return root


@pytest.fixture(scope="module")
def baseline(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = seeded(data_root, tmp_path_factory.mktemp("base"))
    cli.ok(run(root))
    return final_tensors(root)


def start(root: Path, out: Path, *overrides: str, fault: str) -> subprocess.Popen[bytes]:
    """The command in a session of its own (its process group is what a terminal signals), output to ``out``."""
    return subprocess.Popen(
        cli.command(root, *overrides, base=BASE),
        cwd=REPO,
        env={**os.environ, "PIPELINE_FAULT": fault, "PYTHONUNBUFFERED": "1"},
        stdout=out.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_for(what: str, cond: Callable[[], bool], timeout: float = scaled(300)) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def fault_fired(root: Path, spec: str) -> bool:
    """The rank logged the fault ``spec`` (it holds or hangs from then on, at a known step)."""
    logs = (run_dir(root) / "jobs" / "pretrain").glob("*/*_0_log.out")
    return any(f"[fault] injecting {spec}" in p.read_text(errors="replace") for p in logs)


def lines(out: Path) -> list[str]:
    return out.read_text(errors="replace").splitlines()


def group_alive(pgid: int) -> list[psutil.Process]:
    """Processes of the command's group still running (zombies have ended)."""
    alive = []
    for p in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


def end(cmd: subprocess.Popen[bytes]) -> None:
    """Nothing the test started outlives it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(cmd.pid, signal.SIGKILL)
    cmd.wait()


def interrupt(root: Path, out: Path, fault: str, presses: int, *overrides: str) -> tuple[int, list[str]]:
    """Start the command, wait for ``fault`` to fire, Ctrl-C it ``presses`` times a second apart; returns its exit
    code and the lines it printed after the first press."""
    cmd = start(root, out, *overrides, fault=fault)
    try:
        wait_for(f"the fault {fault}", lambda: fault_fired(root, fault))
        before = len(lines(out))
        os.killpg(cmd.pid, signal.SIGINT)
        for _ in range(presses - 1):
            time.sleep(1.0)  # the claim: a second press one second after the first
            os.killpg(cmd.pid, signal.SIGINT)
        rc = cmd.wait(timeout=scaled(120))
        wait_for("the command's processes to end", lambda: not group_alive(cmd.pid), scaled(30))
    finally:
        end(cmd)
    return rc, lines(out)[before:]


def test_ctrl_c_saves_at_the_next_step_says_so_in_one_line_and_the_rerun_resumes_exactly(
    data_root: Path, baseline: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    root, out = seeded(data_root, tmp_path / "root"), tmp_path / "out.txt"
    rc, after = interrupt(root, out, "hold@step:4", 1)  # held before step 4 until the stop request
    assert rc == 130, out.read_text()[-3000:]
    assert "Traceback" not in out.read_text(), out.read_text()[-3000:]
    assert len(after) <= 2 and "[pretrain] stopped on Ctrl-C: checkpoint saved at step 4" in after[-1], after
    assert "run the same command" in after[-1]
    led = Ledger(run_dir(root)).read("pretrain")
    assert led and led.status == "stopped" and [f["cause"] for f in led.failures] == ["interrupted"], led
    status = subprocess.run(
        [sys.executable, "-m", "pipeline.status", str(run_dir(root))],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert "attempt 1 failed: interrupted" in status.stdout, status.stdout
    cli.ok(run(root))
    assert [(m["from_step"], m["steps_lost"]) for m in metrics(root, "resume")] == [(4, 0)]
    assert_identical(final_tensors(root), baseline)


def test_ctrl_c_inside_a_save_finishes_it_stops_in_one_line_and_the_rerun_resumes_exactly(
    data_root: Path, baseline: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """The press lands inside the save of step 2 (held after its files are written, before its commit): the
    save completes, the stage stops there, and the re-run resumes from it bit-identical."""
    root, out = seeded(data_root, tmp_path / "root"), tmp_path / "out.txt"
    rc, after = interrupt(root, out, "hold@ckpt_write:2", 1, "pretrain.save_interval=2")
    assert rc == 130 and "Traceback" not in out.read_text(), out.read_text()[-3000:]
    led = Ledger(run_dir(root)).read("pretrain")
    assert led and led.status == "stopped" and [f["cause"] for f in led.failures] == ["interrupted"], led
    step = led.extra.get("stopped_at_step")
    assert step is not None and step >= 2, led.extra
    assert (
        len(after) <= 2 and f"[pretrain] stopped on Ctrl-C: checkpoint saved at step {step}" in after[-1]
    ), after
    cli.ok(run(root, "pretrain.save_interval=2"))
    assert [(m["from_step"], m["steps_lost"]) for m in metrics(root, "resume")] == [(step, 0)]
    assert_identical(final_tensors(root), baseline)


def test_a_second_ctrl_c_stops_at_once_in_one_line_and_the_run_resumes(
    data_root: Path, baseline: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    root, out = seeded(data_root, tmp_path / "root"), tmp_path / "out.txt"
    # hung at step 3 (the first press cannot end it), after the save of step 2
    rc, after = interrupt(root, out, "hang@step:3", 2, "pretrain.save_interval=2")
    assert rc == 130, out.read_text()[-3000:]
    assert "Traceback" not in out.read_text(), out.read_text()[-3000:]
    assert len(after) <= 2 and "[pretrain] stopped at once on a second Ctrl-C" in after[-1], after
    led = Ledger(run_dir(root)).read("pretrain")
    assert led and [f["cause"] for f in led.failures] == ["interrupted"], led
    cli.ok(run(root, "pretrain.save_interval=2"))
    assert [m["from_step"] for m in metrics(root, "resume")] == [2]
    assert_identical(final_tensors(root), baseline)


def test_ctrl_c_on_the_debug_executor_saves_in_one_line_without_a_debugger(
    data_root: Path, baseline: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """``cluster=debug`` runs the stage in the command's own process: the loop takes the press itself, saves and
    stops; the command says so in one line and exits 130 (no post-mortem debugger, which submitit's debug
    executor opens on a job's error), and the re-run resumes exactly."""
    root, out = seeded(data_root, tmp_path / "root"), tmp_path / "out.txt"
    cmd = start(root, out, "cluster=debug", fault="hold@step:4")
    try:
        wait_for("the fault", lambda: "[fault] injecting hold@step:4" in out.read_text(errors="replace"))
        before = len(lines(out))
        os.killpg(cmd.pid, signal.SIGINT)
        rc = cmd.wait(timeout=scaled(120))
    finally:
        end(cmd)
    text, after = out.read_text(errors="replace"), lines(out)[before:]
    assert rc == 130 and "Traceback" not in text and "(Pdb)" not in text, text[-3000:]
    # in-process, the stage's own log is on the console too: its save (two lines), then the command's line
    assert len(after) <= 3 and "[pretrain] stopped on Ctrl-C: checkpoint saved at step 4" in after[-1], after
    assert not any("rror" in x for x in after), after
    led = Ledger(run_dir(root)).read("pretrain")
    assert led and led.status == "stopped" and [f["cause"] for f in led.failures] == ["interrupted"], led
    cli.ok(run(root, "cluster=debug"))
    assert [(m["from_step"], m["steps_lost"]) for m in metrics(root, "resume")] == [(4, 0)]
    assert_identical(final_tensors(root), baseline)
