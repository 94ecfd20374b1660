"""bench/bench_moe.py (``python -m bench.bench_moe``) runs and prints its ratios."""

from __future__ import annotations

import pytest

from tests.bench.test_bench import run_bench
from tests.support.timing import scaled


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_moe_prints_ep_and_dense_ratios() -> None:
    r = run_bench(
        "bench_moe", "--steps", "2", "--warmup", "1", "--rounds", "1", "--layers", "1", timeout=scaled(880)
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert (
        "EP2 / EP1 step time:" in r.stdout and "MoE (EP1) / dense of the same active parameters" in r.stdout
    )
    assert "of the step)" in r.stdout
