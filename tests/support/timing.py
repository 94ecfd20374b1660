"""One knob for slow hosts: ``PIPELINE_TEST_TIME_SCALE`` (default 1) multiplies every deadline a test waits on
(subprocess timeouts, polls' deadlines, pytest-timeout's per-test limits: tests/conftest.py), so a slower or
loaded machine changes one number, not forty. It never shortens what a test checks, only how long it waits."""

from __future__ import annotations

import os

SCALE = float(os.environ.get("PIPELINE_TEST_TIME_SCALE") or 1)
if SCALE <= 0:
    raise ValueError(f"PIPELINE_TEST_TIME_SCALE={SCALE}: give a positive factor (1 = as written)")


def scaled(seconds: float) -> float:
    """``seconds`` times the host's factor: the budget of one wait."""
    return seconds * SCALE
