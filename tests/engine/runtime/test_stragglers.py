"""Straggler scores and verdicts (engine/runtime/stragglers.py), without ranks: a rank's own time against its
pipeline stage's median, a node as slow as its slowest rank, named only after ``straggler_patience`` checks in
a row, never when all are alike; the sync clock takes the gradient synchronisation's wait out. The real job
slowed from outside: tests/slurm/test_slurm_health.py."""

from __future__ import annotations

import time

import pytest

from engine.runtime.stragglers import StragglerMonitor, SyncClock, scores
from pipeline.schema.build import from_dict
from pipeline.schema.errors import ConfigError
from pipeline.schema.sections import HealthConfig

CFG = HealthConfig(policy="warn", straggler_interval=2, straggler_slower=0.2, straggler_patience=3)


def rows(own: dict[str, float], stage: int = 0, first: int = 0) -> list[tuple[int, str, int, float]]:
    return [(first + i, host, stage, s) for i, (host, s) in enumerate(own.items())]


def test_scores_compare_a_rank_with_its_pipeline_stage_and_a_node_is_its_slowest_rank() -> None:
    ranks, nodes = scores(
        [(0, "a", 0, 1.0), (1, "a", 0, 1.6), (2, "b", 0, 1.0), (3, "b", 1, 5.0), (4, "c", 1, 5.0)]
    )
    assert ranks == {0: 1.0, 1: 1.6, 2: 1.0, 3: 1.0, 4: 1.0}  # stage 1 does other work: its own median
    assert nodes == {"a": 1.6, "b": 1.0, "c": 1.0}


def test_a_node_is_named_after_patience_checks_in_a_row_and_never_when_all_are_alike() -> None:
    m = StragglerMonitor(CFG, SyncClock(lambda: None), "a", 0, 0)
    even = rows({"a": 1.0, "b": 1.02, "c": 0.98})
    assert all(not m.judge(s, even).stragglers for s in range(2, 40, 2))  # no false positive
    slow = rows({"a": 1.0, "b": 1.5, "c": 1.0})
    assert not m.judge(2, slow).stragglers and not m.judge(4, slow).stragglers
    assert not m.judge(6, even).stragglers  # a single fast check resets the streak
    verdicts = [m.judge(s, slow) for s in (8, 10, 12)]
    assert [list(v.stragglers) for v in verdicts] == [[], [], ["b"]]
    assert verdicts[-1].stragglers["b"].startswith("straggler: its ranks' own step time 1.50x the median")
    assert verdicts[-1].as_record()["nodes"] == {"a": 1.0, "b": 1.5, "c": 1.0}


def test_a_ranks_own_time_is_its_compute_before_the_gradient_synchronisation() -> None:
    clock = SyncClock(lambda: time.sleep(0.05))
    m = StragglerMonitor(HealthConfig(policy="warn", straggler_interval=100), clock, "a", 0, 0)
    m.starting()
    time.sleep(0.02)  # forward and backward
    clock()  # 50 ms waiting in the gradient synchronisation
    time.sleep(0.03)  # the optimizer step, its collectives' waits among it: not counted
    assert m.observe(1) is None
    assert m.own == pytest.approx(0.02, abs=0.01)
    m.starting()
    clock()  # a step with no compute before the synchronisation adds (almost) nothing
    m.observe(2)
    assert m.own == pytest.approx(0.02, abs=0.01)


def test_straggler_checks_need_a_policy() -> None:
    with pytest.raises(
        ConfigError, match=r"cluster\.health\.straggler_interval=5: needs policy warn or exclude"
    ):
        from_dict({"cluster": {"health": {"straggler_interval": 5}}})
