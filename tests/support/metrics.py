"""What training runs report, as tests read and compare it: TensorBoard scalars, relative loss deltas."""

from __future__ import annotations

from pathlib import Path

FP32_REL = 1e-4
"""Relative loss tolerance between two fp32 runs that differ only in the parallel layout."""


def max_rel_delta(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), (got, want)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def tb_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar in the TensorBoard logs under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
