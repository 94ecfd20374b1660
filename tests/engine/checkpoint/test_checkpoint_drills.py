"""Fault drills at the engine level, with real faults: a SIGKILLed training process, a full filesystem,
checkpoint files carrying pickle payloads. The drills through the command line are in
tests/e2e/test_fault_recovery.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.env import REPO
from tests.support.timing import scaled

HELPERS_SCRIPT = """
import multiprocessing as mp, os, sys, time
from engine.checkpoint import writer

if __name__ == "__main__":
    writer.signal_safe_writer_queue()  # the writer's results-queue manager, as the first save starts it
    child = mp.get_context("fork").Process(target=time.sleep, args=(600,))  # like megatron's async writer
    child.start()
    print(writer._MANAGER._process.pid, child.pid, flush=True)
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
        proc.wait(timeout=scaled(60))
        left = wait_gone(sorted(kids), timeout=scaled(30))
    finally:
        proc.kill()
        proc.wait()
    for pid in left:  # leave nothing behind, even when the drill fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"helpers outlived the SIGKILLed training process: {left}"


# ---------------------------------------------------------------------------- checkpoints do not run code

MODEL = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16}
SPEC = {"model": MODEL, "parallel": {"global_batch_size": 4, "micro_batch_size": 4}, "save_interval": 2}


class Payload:
    """Unpickling this creates ``target``: the stand-in for code a crafted checkpoint would run."""

    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.target, "w"))


def remark(path: Path) -> None:
    """Rewrite the completion marker so the tampered checkpoint verifies (the marker is no signature)."""
    import json

    from engine.checkpoint.integrity import file_record
    from engine.checkpoint.layout import MARKER

    meta = json.loads((path / MARKER).read_text())
    meta["files"] = {
        p.relative_to(path).as_posix(): file_record(p)
        for p in sorted(path.rglob("*"))
        if p.is_file()
        if p.name != MARKER
    }
    (path / MARKER).write_text(json.dumps(meta))


def plant(ckpt: Path, where: str, target: Path) -> None:
    import pickle

    import torch

    if where == ".metadata":
        with open(ckpt / ".metadata", "rb") as f:
            meta = pickle.load(f)
        meta.storage_meta = Payload(target)
        with open(ckpt / ".metadata", "wb") as f:
            pickle.dump(meta, f)
    else:  # a torch pickle: our RNG file or megatron's common state
        state = torch.load(ckpt / where, weights_only=False)
        state["payload"] = Payload(target)
        torch.save(state, ckpt / where)
    remark(ckpt)


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.engine_worker import launch

    tmp = tmp_path_factory.mktemp("saved")
    launch(1, {**SPEC, "stage": {"iters": 2}, "ckpt": str(tmp / "checkpoints")}, tmp / "run")
    path = tmp / "checkpoints" / "iter_0000002"
    assert (
        (path / ".metadata").is_file()
        and (path / "common.pt").is_file()
        and (path / "rng.rank0.pt").is_file()
    )
    return path


@pytest.mark.parametrize("where", ["rng.rank0.pt", "common.pt", ".metadata"])
def test_a_checkpoint_with_a_pickle_payload_does_not_run_it(
    saved_checkpoint: Path, where: str, tmp_path: Path
) -> None:
    import shutil

    from engine.checkpoint.errors import CheckpointError
    from engine.checkpoint.load import load_tensors
    from tests.support.engine_worker import launch

    root = tmp_path / "checkpoints"
    shutil.copytree(saved_checkpoint, root / saved_checkpoint.name)
    target = tmp_path / "PWNED"
    plant(root / saved_checkpoint.name, where, target)
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_tensors(root / saved_checkpoint.name)  # inspection / export path, no process group
    with pytest.raises(RuntimeError, match="refusing to load"):  # a resume: the full load on a rank
        launch(1, {**SPEC, "stage": {"iters": 4}, "ckpt": str(root)}, tmp_path / "run")
    assert not target.exists(), f"the payload in {where} ran"


# ---------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real filesystem that fills up: a 1 MiB tmpfs (needs root to mount; unmounted afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the full-disk drill runs as root in CI)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_gives_logged_failures_retries_and_a_clean_stop(
    small_tmpfs: Path, tmp_path: Path
) -> None:
    from engine.checkpoint.integrity import verify
    from engine.checkpoint.latest import find_latest
    from tests.support.engine_worker import launch

    root = small_tmpfs / "checkpoints"
    spec = {**SPEC, "stage": {"iters": 8}, "save_interval": 1, "ckpt": str(root)}
    with pytest.raises(RuntimeError):
        launch(1, spec, tmp_path / "run")
    log = (tmp_path / "run" / "rank0.log").read_text()  # whole log: the error carries only its tail
    assert "giving up after 3 failed save(s) in a row" in log, log[-3000:]
    failed = [ln for ln in log.splitlines() if "failed (" in ln and "in a row)" in ln]
    assert len(failed) == 3, log[-3000:]  # each failure logged; training went on between them
    assert "No space left on device" in log or "CheckpointException" in log, log[-3000:]
    assert not list(root.glob("tmp.iter_*")), "a failed save's temp dir is left on the full disk"
    latest = find_latest(root, collective=False)
    assert latest is not None and not verify(latest), "the last good checkpoint stays the one to resume"
    committed = sorted(p.name for p in root.glob("iter_*"))
    assert latest.name == committed[-1], committed
