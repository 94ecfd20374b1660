"""engine.runtime.distributed on gloo: megatron's groups that span the world are the default group.

Each layout runs twice in fresh gloo worlds, with the sharing (what ``D.init`` does) and without it. Every
group megatron hands out has the same ranks both ways, an all-reduce over each of them sums exactly its
ranks, every group of all ranks is the default group, and the shared run has fewer gloo event-loop
threads: on one rank, one thread instead of 21.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.timing import scaled


def _run(world: int, tp: int, pp: int, share: bool, tmp: Path) -> dict[str, Any]:
    from tests.support.engine_worker import launch

    return launch(
        world, {"tp": tp, "pp": pp, "share": share}, tmp, timeout_s=scaled(600), script=Path(__file__)
    )


@pytest.mark.dist
@pytest.mark.parametrize(("world", "tp", "pp"), [(1, 1, 1), (4, 2, 1), (4, 1, 2)])
def test_groups_spanning_the_world_are_the_default_group(
    world: int, tp: int, pp: int, tmp_path: Path
) -> None:
    shared = _run(world, tp, pp, True, tmp_path / "shared")
    alone = _run(world, tp, pp, False, tmp_path / "alone")
    assert shared["ranks"] == alone["ranks"], (shared["ranks"], alone["ranks"])
    assert len(shared["ranks"]) >= 10, shared["ranks"]  # megatron's groups were found
    assert shared["sums_ok"] and alone["sums_ok"], (shared, alone)
    assert shared["whole_are_world"] and not alone["whole_are_world"], (shared, alone)
    assert shared["loops"] < alone["loops"], (shared["loops"], alone["loops"])
    if world == 1:
        assert shared["loops"] == 1, shared


# ---------------------------------------------------------------------------- worker


def _groups() -> dict[str, Any]:
    """Every group megatron's parallel_state hands out without arguments (skipped where this rank has none)."""
    from megatron.core import parallel_state as ps

    out = {}
    for name in sorted(dir(ps)):
        if not (name.startswith("get_") and name.endswith("_group")) or "global" in name:
            continue
        try:
            group = getattr(ps, name)()
        except (AssertionError, RuntimeError, TypeError):
            continue
        if group is not None and not isinstance(group, list):
            out[name] = group
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import contextlib

    import torch
    import torch.distributed as dist

    from engine.runtime import distributed as D

    if not spec["share"]:
        D.share_the_default_group = lambda **kw: contextlib.nullcontext()  # type: ignore[assignment]
    D.init(spec["tp"], spec["pp"], None, seed=1, threads=1)
    try:
        groups = _groups()
        ranks, sums_ok = {}, True
        for name, group in groups.items():
            members = dist.get_process_group_ranks(group)
            ranks[name] = sorted(members)
            x = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(x, group=group)
            sums_ok &= x.item() == float(sum(members))
        task = Path(f"/proc/{os.getpid()}/task")
        loops = sum((t / "comm").read_text().strip() == "gloo_tcp_loop" for t in task.iterdir())
        whole = [g for n, g in groups.items() if len(ranks[n]) == dist.get_world_size()]
        whole_are_world = bool(whole) and all(g is dist.group.WORLD for g in whole)
        return {"ranks": ranks, "sums_ok": sums_ok, "loops": loops, "whole_are_world": whole_are_world}
    finally:
        D.shutdown()


if __name__ == "__main__":
    from tests.support.engine_worker import serve

    serve(run)
