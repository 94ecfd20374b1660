"""The layering contracts (pyproject.toml, import-linter) hold and classify every module of the project."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.env import REPO as ROOT
from tests.support.timing import scaled

pytestmark = pytest.mark.guard  # scripts/guards.sh: runs before any test that trains


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
    unplaced = [m for m in modules if not any(m == p or m.startswith(p + ".") for p in listed)]
    assert sorted(unplaced) == []


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=scaled(300))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


# ---------------------------------------------------------------------------- no cycles, type-only included


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    scc.append(m)
                    if m == node:
                        break
                if len(scc) > 1:
                    out.append(sorted(scc))
    return out


def _path(graph: dict[str, set[str]], scc: list[str]) -> list[str]:
    """One cycle through the first module of ``scc`` (breadth first, inside the component)."""
    start, members = scc[0], set(scc)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for c in sorted(graph[m] & members):
                if c == start:
                    path = [m]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if c not in prev:
                    prev[c] = m
                    nxt.append(c)
        frontier = nxt
    return scc


def test_no_import_cycles_type_checking_imports_included() -> None:
    """No module imports itself through others, counting ``if TYPE_CHECKING`` and function-level imports."""
    import grimp

    g = grimp.build_graph("pipeline", "stages", "engine", exclude_type_checking_imports=False, cache_dir=None)
    graph = {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(_path(graph, c)) for c in cycles)


# ---------------------------------------------------------------------------- imports by name


DYNAMIC_IMPORT_ALLOWED = {
    "engine/runtime/cpu_compat.py": "patches megatron-core internals named by dotted path (resolve)",
    "engine/checkpoint/unpickle.py": "the DCP metadata unpickler checks allowlisted torch/megatron classes",
    "pipeline/submit/prefork.py": "preloads external packages (torch, megatron) and the modules the declarations "
    "name (declared_modules: stages.<stage>, each RL algorithm's engine.rl module; below pipeline.submit, "
    "checked in tests/submit/test_prefork_preload.py); other project modules are imported plainly",
    "engine/rl/registry.py": "imports the engine.rl module an algorithm's torch-free declaration names (its own "
    "package, so no layer is crossed; checked below)",
    "stages/__init__.py": "imports stages.<name> for a stage declared in pipeline.schema.graph (its own package)",
}
"""Files whose ``import_module``/``__import__`` target is not a literal; every such target is external, or in
the importing module's own package."""
PROJECT_PACKAGES = ("pipeline", "stages", "engine")


def _dynamic_imports(path: Path) -> list[tuple[int, str | None]]:
    """(line, literal target or None) of each ``import_module(...)`` / ``__import__(...)`` call in ``path``."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if name not in ("import_module", "__import__"):
            continue
        arg = node.args[0] if node.args else None
        target = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
        out.append((node.lineno, target))
    return out


def test_no_project_module_imported_by_name() -> None:
    """Project modules are imported with ``import`` statements (import-linter sees those; a name string it
    cannot): ``importlib.import_module``/``__import__`` only for external packages."""
    bad = []
    for pkg in PROJECT_PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, target in _dynamic_imports(path):
                if target is None and rel not in DYNAMIC_IMPORT_ALLOWED:
                    bad.append(f"{rel}:{line}: import by a computed name")
                if target is not None and target.split(".")[0] in PROJECT_PACKAGES:
                    bad.append(f"{rel}:{line}: imports the project module {target!r} by name")
    from pipeline.submit import prefork

    bad += [
        f"pipeline/submit/prefork.py: PRELOAD names the project module {n!r}"
        for n in prefork.PRELOAD
        if n.split(".")[0] in PROJECT_PACKAGES
    ]
    assert bad == [], "\n".join(bad)
    for rel in DYNAMIC_IMPORT_ALLOWED:
        assert _dynamic_imports(ROOT / rel), f"{rel}: allowlisted but imports nothing by name any more"
    from pipeline.schema import rl

    outside = [a.engine_module for a in rl.REGISTRY if not a.engine_module.startswith("engine.rl.")]
    assert outside == [], f"RL algorithms must live in engine.rl: {outside}"
