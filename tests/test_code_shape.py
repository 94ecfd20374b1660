"""Product code stays in small modules and short functions: a file over MAX_FILE_LINES lines or a function
(methods and nested functions included) over MAX_FUNCTION_LINES fails, unless ALLOWED names it with a reason.

An allowed entry that no longer exceeds its limit fails too, so the list only shrinks and stays true.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.guard  # scripts/guards.sh: runs before any test that trains

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

ALLOWED: dict[str, str] = {}
"""path (a file over MAX_FILE_LINES) or path::qualname (a function over MAX_FUNCTION_LINES): why it is allowed."""


def product_files() -> list[Path]:
    files = [p for d in ("pipeline", "stages", "engine") for p in sorted((ROOT / d).rglob("*.py"))]
    return files + sorted((ROOT / "slurm").rglob("*.py"))


def _functions(node: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, lines) of every function under ``node``, methods and nested functions included."""
    out = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                out.append((name, (child.end_lineno or child.lineno) - child.lineno + 1))
            out += _functions(child, name + ".")
        else:
            out += _functions(child, prefix)
    return out


def measure() -> dict[str, int]:
    """Every file and function of the product code over its limit, with its length in lines."""
    over: dict[str, int] = {}
    for path in product_files():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            over[rel] = lines
        for name, n in _functions(ast.parse(text, rel)):
            if n > MAX_FUNCTION_LINES:
                over[f"{rel}::{name}"] = n
    return over


def test_files_and_functions_are_short() -> None:
    over = measure()
    new = {k: n for k, n in over.items() if k not in ALLOWED}
    assert not new, "over the limits (files > {} lines, functions > {} lines): {}".format(
        MAX_FILE_LINES, MAX_FUNCTION_LINES, ", ".join(f"{k} ({n})" for k, n in sorted(new.items()))
    )


def test_allowlist_is_current() -> None:
    """An allowed entry must still exceed its limit (else remove it: the list stays short and true)."""
    over = measure()
    stale = sorted(k for k in ALLOWED if k not in over)
    assert not stale, f"no longer over the limit, remove from ALLOWED: {stale}"
