"""The layering contracts (pyproject.toml, import-linter) hold and classify every module of the project."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.support.env import REPO as ROOT


def _contract(kind: str) -> dict:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return next(c for c in conf["contracts"] if c["type"] == kind)


def test_every_module_sits_in_a_layer() -> None:
    """A new module must be placed in the layers (else the contracts would say nothing about it)."""
    listed = {
        m.strip() for layer in _contract("layers")["layers"] for m in layer.replace("|", ":").split(":")
    }
    modules = {f"pipeline.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "pipeline")])}
    modules |= {f"stages.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "stages")])}
    assert sorted(modules - listed) == []


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
