"""What the prefork server preloads comes from the declarations: every stage's module and every registered RL
algorithm's module, so a new one is imported ahead of the ranks without an edit to pipeline.submit.prefork.

Reads the declarations and the engine.rl sources only (no torch, no training)."""

from __future__ import annotations

import ast
import importlib

import pytest

from pipeline.schema import graph, rl
from pipeline.submit import prefork
from tests.support.env import REPO

pytestmark = pytest.mark.guard  # scripts/guards.sh: runs before any test that trains


def registering_modules() -> list[str]:
    """The engine.rl modules that call ``register(...)`` at their top level (an RL algorithm's implementation),
    read from their source: what a job imports when it runs that algorithm."""
    found = []
    for path in sorted((REPO / "engine" / "rl").glob("*.py")):
        statements = ast.parse(path.read_text(), str(path)).body
        calls = [
            n
            for s in statements
            if isinstance(s, ast.Assign | ast.AnnAssign | ast.Expr)
            for n in ast.walk(s)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "register"
        ]
        if calls:
            found.append(f"engine.rl.{path.stem}")
    return found


def test_every_registered_rl_algorithm_is_preloaded() -> None:
    registering = registering_modules()
    assert len(registering) >= len(rl.REGISTRY) > 0, registering
    preloaded = prefork.declared_modules()
    missing = [m for m in registering if m not in preloaded]
    assert missing == [], f"RL algorithm modules the prefork server does not preload: {missing}"
    assert {a.engine_module for a in rl.REGISTRY} <= set(preloaded)


def test_every_stage_module_is_preloaded_and_nothing_above_submission() -> None:
    preloaded = prefork.declared_modules()
    assert [m for m in preloaded if m.startswith("stages.")] == [f"stages.{s}" for s in graph.STAGES]
    assert all(m.startswith(("stages.", "engine.rl.")) for m in preloaded), preloaded
    assert len(set(preloaded)) == len(preloaded)


def test_a_module_that_fails_to_import_does_not_stop_the_preload(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    imported: list[str] = []

    def import_module(name: str) -> None:
        if name == "stages.sft":
            raise ImportError("an optional package")
        imported.append(name)

    monkeypatch.setattr(importlib, "import_module", import_module)
    prefork._import_by_name(prefork.declared_modules())
    assert imported == [m for m in prefork.declared_modules() if m != "stages.sft"]
    assert "[prefork] not preloaded: stages.sft: ImportError: an optional package" in capsys.readouterr().out
