"""Bad-step detection for the training loop: non-finite loss or gradient norm, gradient-norm spikes.

``BadStepGuard.check(loss_finite, grad_norm)`` answers the reason a step is bad (or None) from values that
are equal on every rank (the trainer reduces the verdict across ranks before acting on it). What to do
with a bad step is the trainer's ``nan_policy`` (``skip``: no update for that batch; ``rollback``: reload
the last checkpoint and skip the batch; ``stop``: fail naming the step). ``max_bad_steps`` bad steps in a
row stop the run whatever the policy. The guard's state is plain values, saved in checkpoints, so a resumed
run judges spikes exactly as the uninterrupted one would.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

SPIKE_WINDOW = 20
"""Good steps whose grad norms make up the running median."""
SPIKE_MIN_HISTORY = 5
"""Good steps needed before spikes are judged at all."""

REASONS = ("grad_spike", "nonfinite_grad", "nonfinite_loss")
"""Verdicts, least severe first (a code per reason lets ranks agree with one max-reduction)."""


class BadStepError(RuntimeError):
    """The run stops on bad steps (``nan_policy=stop`` or ``max_bad_steps`` reached); the message names the step."""


class BadStepGuard:
    """Judges each step; counts bad steps in a row; keeps the recent good grad norms for spike detection."""

    def __init__(self, spike_factor: float = 0.0, max_bad_steps: int = 10) -> None:
        self.spike_factor = spike_factor
        self.max_bad_steps = max_bad_steps
        self.norms: list[float] = []
        self.in_a_row = 0
        self.last_bad = -1

    def check(self, loss_finite: bool, grad_norm: float) -> str | None:
        """The reason step is bad: ``nonfinite_loss``, ``nonfinite_grad``, ``grad_spike``; None when good."""
        if not loss_finite:
            return "nonfinite_loss"
        if not math.isfinite(grad_norm):
            return "nonfinite_grad"
        if self.is_spike(grad_norm):
            return "grad_spike"
        return None

    def is_spike(self, grad_norm: float) -> bool:
        if self.spike_factor <= 0 or len(self.norms) < SPIKE_MIN_HISTORY:
            return False
        return grad_norm > self.spike_factor * statistics.median(self.norms)

    def good(self, step: int, grad_norm: float) -> None:
        """Record a good step. A replayed step (before the last bad one, after a rollback) keeps the count."""
        self.norms = [*self.norms, grad_norm][-SPIKE_WINDOW:]
        if step > self.last_bad:
            self.in_a_row = 0

    def bad(self, step: int) -> int:
        """Record a bad step; returns the number of bad steps in a row."""
        self.in_a_row += 1
        self.last_bad = max(self.last_bad, step)
        return self.in_a_row

    def state(self) -> dict[str, Any]:
        return {"norms": list(self.norms), "in_a_row": self.in_a_row, "last_bad": self.last_bad}

    def load_state(self, state: dict[str, Any]) -> None:
        self.norms = [float(x) for x in state.get("norms", [])]
        self.in_a_row = int(state.get("in_a_row", 0))
        self.last_bad = int(state.get("last_bad", -1))


def reason_code(reason: str | None) -> float:
    """0 for a good step, else 1 + the reason's index (ranks take the max: the worst verdict wins)."""
    return 0.0 if reason is None else 1.0 + REASONS.index(reason)


def reason_from_code(code: float) -> str | None:
    return None if code <= 0 else REASONS[int(code) - 1]
