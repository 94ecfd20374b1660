"""No hidden channels: nothing below the job entry point (pipeline.submit.launch) reads the environment.

The job's facts (its place, attempt, restarts, fault specs) reach the stages and the engine as
StageContext fields and arguments. Setting a variable for a library (``os.environ[k] = v``, a
``setdefault``/``update`` statement) is not a read; every read in engine/ and stages/ must be in ALLOWED.
"""

from __future__ import annotations

import ast
import functools

import pytest

from tests.support.env import REPO

pytestmark = pytest.mark.guard  # scripts/guards.sh: runs before any test that trains

ROOTS = ("engine", "stages")
ALLOWED = {
    "engine/runtime/distributed.py": "torch.distributed's own env rendezvous contract (env_from_os, only when "
    "the caller gives no DistEnv) and torch's TORCHDYNAMO_DISABLE, mirrored while megatron imports",
    "engine/runtime/host_memory.py": "the allocator tuning the user chose (MALLOC_*, GLIBC_TUNABLES, LD_PRELOAD) "
    "is left alone: glibc's knobs, not ours",
    "engine/callbacks/wandb.py": "the wandb library's WANDB_MODE / WANDB_API_KEY (offline without a key)",
    "engine/convert/hf_export.py": "passes this process's environment on to its child (plus PYTHONPATH)",
    "stages/export.py": "passes the job's environment on to the export command (plus OMP_NUM_THREADS)",
    "stages/data_prep/world.py": "the MPI launcher's contract (PMI_SIZE, ...: whether to import mpi4py) and "
    "the mpiexec child's environment",
}
"""file -> why it may read the environment."""

_WRITES = ("setdefault", "update")


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _is_write(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """``os.environ[k] = v`` / ``del os.environ[k]``, or ``os.environ.setdefault|update(...)`` as a statement."""
    up = parents.get(node)
    if isinstance(up, ast.Subscript) and isinstance(up.ctx, (ast.Store, ast.Del)):
        return True
    if isinstance(up, ast.Attribute) and up.attr in _WRITES:
        call = parents.get(up)
        return isinstance(call, ast.Call) and isinstance(parents.get(call), ast.Expr)
    return False


def env_reads(source: str) -> list[int]:
    """Lines reading the environment: ``os.environ`` other than a write, ``os.getenv``, ``from os import``."""
    tree = ast.parse(source)
    parents = _parents(tree)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "environb", "getenv", "getenvb") for a in node.names):
                lines.append(node.lineno)
        if not (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
        ):
            continue
        if node.attr in ("getenv", "getenvb"):
            lines.append(node.lineno)
        if node.attr in ("environ", "environb") and not _is_write(node, parents):
            lines.append(node.lineno)
    return sorted(lines)


@functools.cache
def _all_reads() -> dict[str, list[int]]:
    found = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            lines = env_reads(path.read_text())
            if lines:
                found[path.relative_to(REPO).as_posix()] = lines
    return found


def test_no_environment_reads_below_the_entry_point() -> None:
    hidden = {f: lines for f, lines in _all_reads().items() if f not in ALLOWED}
    assert not hidden, (
        f"environment read below the job entry point: {hidden}; take the value as an argument or a "
        "StageContext field (pipeline.submit.launch reads it once), or add the file to ALLOWED with a reason"
    )


def test_allowlist_is_current() -> None:
    stale = sorted(set(ALLOWED) - set(_all_reads()))
    assert not stale, f"ALLOWED lists files that no longer read the environment: {stale}"


def test_reads_and_writes_are_told_apart() -> None:
    src = (
        "import os\n"
        "os.environ['A'] = '1'\n"
        "os.environ.setdefault('B', '1')\n"
        "x = os.environ.get('C')\n"
        "y = os.getenv('D')\n"
        "z = os.environ.setdefault('E', '1')\n"
        "env = {**os.environ}\n"
    )
    assert env_reads(src) == [4, 5, 6, 7]
