"""Fault injection specs, the stop flag, and the hang watchdog (in subprocesses: they kill and hang)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.runtime.fault_injection import FaultInjector, InjectedFault, parse
from engine.runtime.signals import HANG_EXIT_CODE, Interrupted, Preempted, StopFlag, stopped
from tests.support.timing import scaled


def test_parse_specs() -> None:
    specs = parse("kill@step:3, hang@step:5/rank=1,usr1@ckpt_write:4")
    assert [s.key for s in specs] == ["kill@step:3", "hang@step:5/rank=1", "usr1@ckpt_write:4"]
    for bad in ("kill", "explode@step:1", "kill@lunch:1", "kill@step:x", "kill@step:1/r=2"):
        with pytest.raises(ValueError, match="PIPELINE_FAULT"):
            parse(bad)


def test_fires_once_per_stage_dir_and_only_on_its_rank(tmp_path: Path) -> None:
    inj = FaultInjector(tmp_path, rank=0, text="raise@step:2,nan@step:3/rank=1")
    assert inj.check("step", 1) is None
    with pytest.raises(InjectedFault):
        inj.check("step", 2)
    assert inj.check("step", 2) is None  # already fired: a resumed run passes the same step
    assert FaultInjector(tmp_path, rank=0, text="raise@step:2").check("step", 2) is None
    assert inj.check("step", 3) is None  # rank 1 only
    assert FaultInjector(tmp_path, rank=1, text="nan@step:3/rank=1").check("step", 3) == "nan"


def test_stop_flag_is_set_by_each_signal() -> None:
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        flag = StopFlag().install()
        try:
            assert not flag.requested
            os.kill(os.getpid(), sig)
            assert flag.requested and flag.signum == sig
        finally:
            flag.uninstall()


def test_ctrl_c_stops_instead_of_requeueing_holds_end_on_it_and_its_repeats_are_ignored(
    tmp_path: Path,
) -> None:
    import pickle

    flag = StopFlag().install()
    hold = FaultInjector(tmp_path, rank=0, text="hold@step:2", released=lambda: flag.requested)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # Ctrl-C, once seen, decides
        assert flag.signum == signal.SIGINT
        assert hold.check("step", 2) is None  # a hold ends on the stop request
    finally:
        flag.uninstall()
    assert (
        signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    )  # heeded: repeats cannot cut the stop's recording
    signal.signal(signal.SIGINT, signal.default_int_handler)
    e = stopped(signal.SIGINT, 17)
    assert isinstance(e, Interrupted) and e.step == 17 and "step 17" in str(e)
    assert pickle.loads(pickle.dumps(e)).step == 17  # submitit pickles the job's exception
    assert type(stopped(signal.SIGTERM, 17)) is Preempted


def test_watchdog_dumps_stacks_and_exits_with_hang_code(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import time
        from engine.runtime.signals import Watchdog
        w = Watchdog(timeout_s=1.0, poll_s=0.1).start()
        w.beat()
        def stuck_in_a_collective():
            time.sleep(120)
        stuck_in_a_collective()
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=scaled(120))
    assert r.returncode == HANG_EXIT_CODE, r.stderr
    assert "stuck_in_a_collective" in r.stderr and "no progress" in r.stdout


def test_kill_fault_kills(tmp_path: Path) -> None:
    script = f"from engine.runtime.fault_injection import FaultInjector; FaultInjector({str(tmp_path)!r}, 0, 'kill@step:1').check('step', 1)"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=scaled(120))
    assert r.returncode == -signal.SIGKILL
