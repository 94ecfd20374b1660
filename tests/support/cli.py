"""The command line as tests drive it: ``python -m pipeline`` in a subprocess, and what a run leaves behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.env import REPO
from tests.support.timing import scaled


def command(root: Path, *overrides: str, base: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "pipeline", *base, f"run.root={root}", *overrides]


def run(
    root: Path, *overrides: str, base: Sequence[str] = (), fault: str = "", timeout: float = scaled(600)
) -> subprocess.CompletedProcess[str]:
    """``python -m pipeline <base> run.root=<root> <overrides>`` from the checkout, with ``PIPELINE_FAULT=fault``
    (engine/runtime/fault_injection.py); output captured. Bind a file's base overrides with functools.partial."""
    return subprocess.run(
        command(root, *overrides, base=base),
        cwd=REPO,
        env={**os.environ, "PIPELINE_FAULT": fault},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_pipeline(*overrides: str, timeout: float = scaled(1200)) -> subprocess.CompletedProcess[str]:
    """``python -m pipeline <overrides>`` from the checkout (no run root added), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(root: Path, *overrides: str, base: Sequence[str] = (), fault: str = "") -> subprocess.Popen[str]:
    """The same command, not waited for, in its own process group (as a terminal runs it), output discarded."""
    return subprocess.Popen(
        command(root, *overrides, base=base),
        cwd=REPO,
        env={**os.environ, "PIPELINE_FAULT": fault},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def ok(r: subprocess.CompletedProcess[str]) -> None:
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def run_dir(root: Path) -> Path:
    """The one run directory under run root ``root``."""
    (d,) = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return d


def metrics(root: Path, kind: str | None = None, stage: str = "pretrain") -> list[dict[str, Any]]:
    """The records of ``stage``'s metrics.jsonl in the run under ``root`` (only those of ``kind`` if given)."""
    path = run_dir(root) / "stages" / stage / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [m for m in lines if kind is None or m["kind"] == kind]


def seeded(src_root: Path, dest: Path, stages: Sequence[str] | None = ("data_prep",)) -> Path:
    """``dest`` as a run root whose ``stages`` are already done: copies of their outputs and ledger records
    from the run under ``src_root``; ``stages=None`` copies the whole root (symlinks kept). Returns ``dest``."""
    if stages is None:
        shutil.copytree(src_root, dest, symlinks=True, dirs_exist_ok=True)
        return dest
    src = run_dir(src_root)
    target = dest / src.name
    (target / "ledger").mkdir(parents=True)
    for stage in stages:
        shutil.copytree(src / "stages" / stage, target / "stages" / stage)
        shutil.copy(src / "ledger" / f"{stage}.json", target / "ledger" / f"{stage}.json")
    return dest
