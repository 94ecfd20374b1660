"""Shared pytest fixtures."""

# Session fixture `slurm_cluster`: a real local SLURM cluster (tests/support/slurm_cluster.py, slurm/cluster.py);
# `cluster`: that cluster with its variables in os.environ, for tests driving the pipeline
# (tests/support/slurm_helpers.py). Registered here so every folder under tests/ sees them.
# ---------------------------------------------------------------------------- no process outlives the suite
# Every process the suite starts inherits PIPELINE_TEST_SESSION=<uuid> (set before any test runs); at the end
# the suite fails if a process carrying this session's marker is still alive, and ends those processes.
# Processes of other sessions on the machine (other uuids) are never counted or touched.
import os as _os
import signal as _signal
import sys as _sys
import time as _time
import uuid as _uuid
from pathlib import Path as _Path

# The suite runs oversubscribed by design (two workers, multi-rank tests and SLURM nodes on 2 cores): idle
# OpenMP threads must sleep, not spin as GNU OpenMP's do by default (two 2-thread torch processes on 2 busy
# cores: 52 s spinning, 8 s passive; docs/testing.md). Set before torch is imported here or in any child.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest as _pytest

from tests.support.slurm_cluster import slurm_cluster  # noqa: F401
from tests.support.slurm_helpers import cluster  # noqa: F401
from tests.support.timing import SCALE, scaled

SESSION_ENV = "PIPELINE_TEST_SESSION"


def pytest_configure(config):  # type: ignore[no-untyped-def]
    if not hasattr(config, "workerinput"):  # one marker per session (an xdist worker keeps the master's)
        _os.environ[SESSION_ENV] = _uuid.uuid4().hex


@_pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """Under pytest-xdist (`make test` runs `-n 2 --dist loadgroup`), every test on the SLURM cluster runs on one
    worker, so the session starts one cluster, as without xdist. (Without tryfirst xdist read the groups
    before this hook set them: each worker started a cluster of its own.)"""
    for item in items:
        if "slurm_cluster" in item.fixturenames:
            item.add_marker(_pytest.mark.xdist_group("slurm"))
        elif _uses_module_fixture(item):
            # a module fixture (a trained baseline, a prepared corpus) is built once per worker that runs one of
            # its tests: the module's tests on one worker build it once (two workers built the SFT run twice)
            item.add_marker(_pytest.mark.xdist_group(item.module.__name__))
        if SCALE != 1:  # PIPELINE_TEST_TIME_SCALE (tests/support/timing.py): the per-test limit scales too
            m = item.get_closest_marker("timeout")
            limit = (m.args[0] if m.args else m.kwargs["timeout"]) if m else config.getini("timeout")
            item.add_marker(_pytest.mark.timeout(scaled(float(limit))), append=False)


def _uses_module_fixture(item):  # type: ignore[no-untyped-def]
    defs = item._fixtureinfo.name2fixturedefs  # pytest's own record of the fixtures this test resolves
    return any(d[-1].scope == "module" for name, d in defs.items() if d and name in item.fixturenames)


@_pytest.fixture(autouse=True)
def _engine_patches_stay_in_workers():  # type: ignore[no-untyped-def]
    """The engine's CPU patches of torch (engine.runtime.cpu_compat) belong to rank processes: a test that
    installs them in the pytest process fails here, not a later test on the same xdist worker."""
    yield
    compat = _sys.modules.get("engine.runtime.cpu_compat")
    if compat is not None and compat.installed():
        _pytest.fail(
            "engine.runtime.cpu_compat was installed in the pytest process: run the engine in a worker"
        )


def session_processes(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of live, non-zombie processes whose environment carries ``marker``, except us."""
    needle = f"{SESSION_ENV}={marker}".encode()
    found = []
    for proc in _Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == _os.getpid():
            continue
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append((int(proc.name), cmd))
    return found


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    marker = _os.environ.get(SESSION_ENV)
    if not marker or hasattr(session.config, "workerinput"):
        return
    deadline = _time.monotonic() + scaled(15)  # helpers of the last test may still be exiting
    left = session_processes(marker)
    while left and _time.monotonic() < deadline:
        _time.sleep(0.5)
        left = session_processes(marker)
    if not left:
        return
    for pid, _ in left:
        try:
            _os.kill(pid, _signal.SIGKILL)
        except OSError:
            pass
    lines = "\n".join(f"  pid {pid}: {cmd[:200]}" for pid, cmd in left)
    msg = f"{len(left)} process(es) started by this test session outlived it (now killed):\n{lines}"
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(msg, red=True)
    else:
        print(msg)
    session.exitstatus = 1
