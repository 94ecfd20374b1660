"""Kill, signal and hang the pretrain stage through the real command line; every resume is exact.

Each scenario runs ``python -m pipeline`` (local executor, separate processes) with ``PIPELINE_FAULT``
(engine/runtime/fault_injection.py), re-runs the same command until it completes, and compares the final
checkpoint's tensors (model and optimizer) bit for bit with an uninterrupted run of the same layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from pipeline.records.ledger import Ledger
from tests.support import cli
from tests.support.cli import metrics, run_dir, seeded
from tests.support.timing import scaled
from tests.support.weights import assert_identical, final_tensors

BASE = [
    "experiment=tiny",
    "run.stages=[data_prep,pretrain]",
    "pretrain.save_interval=2",
    "pretrain.hang_timeout_s=60",
]
DP2 = ["pretrain.parallel.dp=2", "pretrain.parallel.distributed_optimizer=true"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
run = partial(cli.run, base=BASE)
_start = partial(cli.start, base=BASE)  # in its own process group, as a terminal would run it


def until_done(
    root: Path, overrides: list[str], fault: str, max_runs: int = 6
) -> list[subprocess.CompletedProcess[str]]:
    runs = []
    for _ in range(max_runs):
        r = run(root, *overrides, fault=fault)
        runs.append(r)
        if r.returncode == 0:
            return runs
    raise AssertionError(
        "never completed:\n" + "\n----\n".join(x.stdout[-1500:] + x.stderr[-1500:] for x in runs)
    )


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run root whose data_prep completed once; scenarios copy it instead of preparing data again."""
    root = tmp_path_factory.mktemp("data")
    r = run(root, "run.stages=[data_prep]")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return root


@pytest.fixture(scope="module")
def baseline_1(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = seeded(data_root, tmp_path_factory.mktemp("base1"))
    until_done(root, [], "", max_runs=1)
    return final_tensors(root)


@pytest.fixture(scope="module")
def baseline_dp2(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = seeded(data_root, tmp_path_factory.mktemp("base2"))
    until_done(root, DP2, "", max_runs=1)
    return final_tensors(root)


def test_sigkill_at_three_steps_and_mid_checkpoint_write(
    data_root: Path, baseline_1: dict, tmp_path: Path
) -> None:
    root = seeded(data_root, tmp_path)
    runs = until_done(root, [], "kill@step:2,kill@ckpt_write:4,kill@step:5")
    assert [r.returncode for r in runs] == [1, 1, 1, 0]
    ckpts = run_dir(root) / "stages" / "pretrain" / "checkpoints"
    assert list(ckpts.glob("tmp.iter_0000004.*")), "the killed write's temp dir is left, never taken for good"
    resumes = [m for m in metrics(root) if m["kind"] == "resume"]
    # the kill at step 2 came before the first save: a restart from scratch, one step lost, still counted;
    # the kill inside the write of 4 fell back to 2
    assert [r["from_step"] for r in resumes] == [0, 2, 4] and [r["attempt"] for r in resumes] == [2, 3, 4]
    assert resumes[0]["checkpoint"] is False and resumes[0]["steps_lost"] == 1, resumes[0]
    assert_identical(final_tensors(root), baseline_1)
    status = subprocess.run(
        [sys.executable, "-m", "pipeline.status", str(run_dir(root))],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert "attempts 4" in status.stdout and "resumes 3" in status.stdout, status.stdout
    assert status.stdout.count("failed: unknown") == 3, status.stdout  # a SIGKILL from outside says nothing
    assert f"steps lost {sum(r['steps_lost'] for r in resumes)}" in status.stdout, status.stdout


def test_sigkill_one_of_two_ranks_with_distributed_optimizer(
    data_root: Path, baseline_dp2: dict, tmp_path: Path
) -> None:
    root = seeded(data_root, tmp_path)
    runs = until_done(root, DP2, "kill@step:3/rank=1,kill@step:5/rank=0")
    assert [r.returncode for r in runs] == [1, 1, 0]
    assert_identical(final_tensors(root), baseline_dp2)


def test_signals_on_two_ranks_save_at_the_same_step_and_lose_nothing(
    data_root: Path, baseline_dp2: dict, tmp_path: Path
) -> None:
    root = seeded(data_root, tmp_path)
    runs = until_done(root, DP2, "usr1@step:2/rank=0,usr2@step:3/rank=1,term@step:5/rank=0")
    assert [r.returncode for r in runs] == [1, 1, 1, 0]
    for r in runs[:3]:
        assert "stopped" in (r.stdout + r.stderr), r.stdout[-1500:] + r.stderr[-1500:]
    led = Ledger(run_dir(root)).read("pretrain")
    assert led and [f["cause"] for f in led.failures] == ["preemption"] * 3, led.failures
    resumes = [m for m in metrics(root) if m["kind"] == "resume"]
    assert [(r["from_step"], r["steps_lost"]) for r in resumes] == [(2, 0), (3, 0), (5, 0)]
    stops = [m["message"] for m in metrics(root) if m["kind"] == "info" and "stopped" in m.get("message", "")]
    assert len(stops) == 3
    ckpts = run_dir(root) / "stages" / "pretrain" / "checkpoints"
    final = json.loads((ckpts / "iter_0000006" / "COMPLETE.json").read_text())
    assert {"rng.rank0.pt", "rng.rank1.pt"} <= set(final["files"])
    assert_identical(final_tensors(root), baseline_dp2)


def test_hung_rank_is_detected_dumped_and_exits_with_hang_code(
    data_root: Path, baseline_dp2: dict, tmp_path: Path
) -> None:
    from engine.runtime.signals import HANG_EXIT_CODE

    root = seeded(data_root, tmp_path)
    runs = until_done(root, [*DP2, "pretrain.hang_timeout_s=30"], "hang@step:3/rank=1")
    assert [r.returncode for r in runs] == [1, 0]
    logs = "\n".join(p.read_text() for p in (run_dir(root) / "jobs" / "pretrain").rglob("*_log.*"))
    assert "[watchdog] no progress" in logs
    assert "_fire" in logs and "fault_injection.py" in logs, "the hung rank's stack is in its log"
    assert f"HangDetected: exiting with code {HANG_EXIT_CODE}" in runs[0].stderr, runs[0].stderr
    led = Ledger(run_dir(root)).read("pretrain")
    assert led and led.status == "completed"
    assert [(f["attempt"], f["cause"]) for f in led.failures] == [(1, "hang")], led.failures
    assert_identical(final_tensors(root), baseline_dp2)


def _wait_for(what: str, cond, timeout: float = scaled(300)):  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _progress(root: Path) -> int:
    p = run_dir(root) / "stages" / "pretrain" / "progress.json"
    try:
        return int(json.loads(p.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def test_group_kill_mid_pretrain_then_an_immediate_rerun_resumes_exactly(
    data_root: Path, baseline_1: dict, tmp_path: Path
) -> None:
    import signal

    root = seeded(data_root, tmp_path)
    cmd = _start(root, fault="hang@step:3")  # stays at step 3 (the watchdog would fire after 60 s)
    try:
        ckpt = run_dir(root) / "stages" / "pretrain" / "checkpoints" / "iter_0000002" / "COMPLETE.json"
        _wait_for("the step-2 checkpoint", lambda: ckpt.exists() and _progress(root) >= 2)
    finally:
        os.killpg(cmd.pid, signal.SIGKILL)  # the command, the job controller, the rank: the whole group
        cmd.wait()
    r = run(root)  # at once: the killed job may still be a zombie
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "nothing submitted" not in r.stdout, r.stdout
    resumes = [m for m in metrics(root) if m["kind"] == "resume"]
    assert [m["from_step"] for m in resumes] == [2], resumes
    assert_identical(final_tensors(root), baseline_1)


def test_a_stopped_rank_on_the_local_executor_ends_the_job(data_root: Path, tmp_path: Path) -> None:
    import signal
    import time

    import psutil

    root = seeded(data_root, tmp_path)
    hang_s = 20
    # rank 0 stops making progress at step 3 (its watchdog fires after hang_s), and rank 1 is frozen there
    cmd = _start(root, *DP2, f"pretrain.hang_timeout_s={hang_s}", fault="hang@step:3/rank=0")
    ranks: list[psutil.Process] = []
    try:
        _wait_for("training", lambda: _progress(root) >= 2)
        led = Ledger(run_dir(root)).read("pretrain")
        assert led is not None
        job = led.job_ids[0]
        # the ranks (cluster.prefork: forked by the prefork server, named job<controller pid>.r<rank>;
        # the controller's children are their relays)
        # (the checkpoint writer's manager, forked from a rank, carries the rank's name too: not a rank)
        names = (f"job{job}.r0", f"job{job}.r1")
        ranks = [
            p
            for p in psutil.process_iter(["name"])
            if p.info["name"] in names and _parent_name(p) not in names
        ]
        assert len(ranks) == 2, ranks
        frozen = next(p for p in ranks if p.info["name"] == f"job{job}.r1")
        ranks += psutil.Process(int(job)).children()
        frozen.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        rc = cmd.wait(timeout=hang_s + 120)  # the hang timeout plus a margin for a loaded machine
        print(f"command ended {time.monotonic() - t0:.0f} s after the SIGSTOP (hang timeout {hang_s} s)")
    finally:
        if cmd.poll() is None:
            os.killpg(cmd.pid, signal.SIGKILL)
            cmd.wait()
        for p in ranks:
            if p.is_running():
                p.kill()
    assert rc == 1
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    led = Ledger(run_dir(root)).read("pretrain")
    assert led and led.status == "failed", led


def _parent_name(p: object) -> str | None:
    import psutil

    try:
        parent = p.parent()  # type: ignore[attr-defined]
        return None if parent is None else str(parent.name())
    except psutil.Error:
        return None
