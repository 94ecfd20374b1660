"""pipeline.submit.prefork: local ranks forked from a pre-imported server, through submitit's local controller.

One server for the module (its imports take seconds); every job goes through the real LocalExecutor with
the server's relay as its ``python``. Faults come from outside: SIGKILL of a relay, of the server.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest

from pipeline.submit import prefork
from tests.support.timing import scaled

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[prefork.Server]:
    log = tmp_path_factory.mktemp("prefork") / "server.log"
    srv = prefork.start(log)
    try:
        yield srv
    finally:
        srv.close()
        assert srv.process.poll() is not None, "the server outlived its close()"
        assert not srv.socket_path.exists()


def executor(tmp_path: Path, python: str | None, tasks: int = 1) -> Any:
    import submitit

    ex = submitit.LocalExecutor(folder=tmp_path / "jobs" / "%j", python=python)
    ex.update_parameters(timeout_min=10, tasks_per_node=tasks, nodes=1)
    return ex


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = scaled(120)) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def whoami() -> dict[str, Any]:
    """In the rank: where it runs and what it found imported at its start."""
    import submitit
    import torch

    env = submitit.JobEnvironment()
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "relay": os.environ.get(prefork.RELAY_ENV),
        "rank": env.global_rank,
        "megatron_preloaded": "megatron.core" in sys.modules,
        "torch_seed": torch.initial_seed(),
        "name": psutil.Process().name(),
        "pgid": os.getpgid(0),
    }


def test_ranks_are_forked_from_the_preloaded_server(server: prefork.Server, tmp_path: Path) -> None:
    job = executor(tmp_path, server.python, tasks=2).submit(whoami)
    results = job.results()
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["ppid"] == server.process.pid, r  # forked by the server, not started by the controller
        assert r["megatron_preloaded"], r
        assert r["relay"] and int(r["relay"]) != r["pid"], r
        assert r["name"] == f"job{job.job_id}.r{r['rank']}", r
        assert r["pgid"] == r["pid"], r  # own process group: terminal signals reach it through its relay
    # torch's default generator is seeded from the OS, as in fresh interpreters: not shared by the ranks
    assert results[0]["torch_seed"] != results[1]["torch_seed"]


def raise_error() -> None:
    raise ValueError("the job's own error")


def relay_cmd(server: prefork.Server, *args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.submit.prefork", "relay", str(server.socket_path), *args]


def test_exit_status_and_errors_come_back_as_from_a_plain_process(
    server: prefork.Server, tmp_path: Path
) -> None:
    import subprocess

    with pytest.raises(Exception, match="the job's own error"):  # the traceback, through submitit
        executor(tmp_path, server.python).submit(raise_error).result()
    # an exit code: this module without arguments prints its usage and exits with 2
    env = prefork.task_env()  # as submitit's controller gives its tasks (else the server refuses)
    r = subprocess.run(
        relay_cmd(server, "-u", "-m", "pipeline.submit.prefork"), capture_output=True, text=True, env=env
    )
    assert r.returncode == 2 and "usage: python -m pipeline.submit.prefork" in r.stderr, r
    # a rank killed by a signal: its relay ends by the same signal
    p = subprocess.Popen(
        relay_cmd(server, "-m", "timeit", "-n1", "-r1", "__import__('time').sleep(300)"), env=env
    )
    try:
        wait_for("the rank", lambda: bool(psutil.Process(server.process.pid).children()))
        (rank,) = psutil.Process(server.process.pid).children()
        rank.kill()
        assert p.wait(timeout=scaled(60)) == -signal.SIGKILL
    finally:
        p.kill()
        p.wait()


def wait_for_signal(flag: str) -> str:
    """Park until SIGTERM arrives (its handler sets a flag), then say so in ``flag``."""
    got: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, _f: got.append(s))
    Path(flag + ".ready").write_text(str(os.getpid()))
    deadline = time.monotonic() + scaled(120)
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    Path(flag).write_text("SIGTERM" if got else "none")
    return "stopped"


def park(ready: str) -> None:
    Path(ready).write_text(str(os.getpid()))
    time.sleep(600)


def test_a_signal_to_the_relay_reaches_the_rank(server: prefork.Server, tmp_path: Path) -> None:
    flag = str(tmp_path / "flag")
    job = executor(tmp_path, server.python).submit(wait_for_signal, flag)
    wait_for("the rank", lambda: Path(flag + ".ready").exists())
    (relay,) = psutil.Process(int(job.job_id)).children()
    assert relay.pid != int(Path(flag + ".ready").read_text())
    relay.send_signal(signal.SIGTERM)
    assert job.result() == "stopped"
    assert Path(flag).read_text() == "SIGTERM"


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_killed_relay_takes_its_rank_along(server: prefork.Server, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    job = executor(tmp_path, server.python).submit(park, str(ready))
    wait_for("the rank", ready.exists)
    rank = psutil.Process(int(ready.read_text()))
    (relay,) = psutil.Process(int(job.job_id)).children()
    relay.kill()
    wait_for("the rank to die", lambda: gone(rank))
    wait_for("the job to end", job.done)


def test_a_killed_server_takes_its_ranks_along(tmp_path: Path) -> None:
    srv = prefork.start(tmp_path / "server.log")
    ready = tmp_path / "ready"
    try:
        job = executor(tmp_path, srv.python).submit(park, str(ready))
        wait_for("the rank", ready.exists)
        rank = psutil.Process(int(ready.read_text()))
        assert rank.ppid() == srv.process.pid
        srv.process.kill()
        wait_for("the rank to die", lambda: gone(rank))
        wait_for("the job to end", job.done)
    finally:
        srv.close()


def test_no_server_or_another_environment_runs_a_plain_process(
    server: prefork.Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = prefork.Server(server.process, tmp_path / "no-such-socket", server.log)
    job = executor(tmp_path / "a", missing.python).submit(whoami)
    r = job.result()
    assert r["ppid"] == int(job.job_id) and not r["relay"], r  # the controller's own child

    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # read at torch's import: the server imported without it
    job = executor(tmp_path / "b", server.python).submit(whoami)
    r = job.result()
    assert r["ppid"] == int(job.job_id) and not r["relay"], r
    assert "refused: environment differs in OMP_NUM_THREADS" in server.log.read_text()
