"""Precision: fp16 with dynamic loss scaling on the engine path (runs on CPU too), against fp32.

megatron's scaler starts at 2^32, so the first fp16 steps overflow: each is skipped (no update, the LR
schedule does not advance), counted (``overflow_steps``) and halves the scale (after the hysteresis of 2);
then the run learns like fp32. A real overflow, not a forced one. bf16/fp16 on CUDA: tests/gpu/test_gpu.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_worker import launch
from tests.support.timing import scaled


def run(tmp: Path, precision: str, iters: int) -> list[dict[str, Any]]:
    spec = {
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32},
        "parallel": {"micro_batch_size": 2, "global_batch_size": 4, "precision": precision},
        "stage": {"iters": iters},
        "samples": 4,
    }
    return list(launch(1, spec, tmp / precision, timeout_s=scaled(300))["history"])


@pytest.mark.timeout(600)
def test_fp16_skips_and_counts_overflows_lowers_the_scale_then_learns_like_fp32(tmp_path: Path) -> None:
    fp16 = run(tmp_path, "fp16", 26)
    fp32 = run(tmp_path, "fp32", 26)
    over = [h for h in fp16 if h["overflow"]]
    good = [h for h in fp16 if not h["overflow"]]
    assert len(over) >= 2 and good, [h["loss_scale"] for h in fp16]
    assert fp16[: len(over)] == over, "overflows come first, while the scale is too high"
    assert [h["overflow_steps"] for h in fp16] == [min(i + 1, len(over)) for i in range(len(fp16))]
    scales = [h["loss_scale"] for h in fp16]
    assert scales[0] == 2.0**32 and all(
        b == a / 2 for a, b in zip(scales[1 : len(over)], scales[2 : len(over)])
    )
    assert all(s == scales[len(over)] for s in scales[len(over) :]), "no overflow after the scale fits"
    # An overflow step is skipped: same loss (no update), LR schedule not advanced, no grad norm.
    assert {h["loss"] for h in over} == {fp16[0]["loss"]} and {h["lr"] for h in over} == {good[0]["lr"]}
    assert all(math.isnan(h["grad_norm"]) for h in over)
    # Then it trains as fp32 does (fp16 weights and activations: loose tolerance).
    for a, b in zip(good[:3], fp32):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3)
    assert good[-1]["loss"] < good[0]["loss"] - 0.5


class _Optimizer:
    """megatron's optimizer step as the trainer sees it: prepare_grads reports inf/NaN in the scaled grads."""

    def __init__(self, found_inf: bool) -> None:
        self.found_inf = found_inf

    def prepare_grads(self) -> bool:
        return self.found_inf

    def get_grad_norm(self) -> float:
        return 1.0

    def step(self) -> tuple[bool, float | None, None]:
        if self.prepare_grads():
            return False, None, None
        return True, self.get_grad_norm(), None


@pytest.mark.parametrize(
    ("found_inf", "loss", "overflows", "reason"),
    [
        (True, 2.0, 1, None),  # fp16 overflow with finite losses: skipped and counted, not a bad step
        (True, float("nan"), 0, "nonfinite_loss"),  # a NaN loss stays a bad step: nan_policy applies
        (False, 2.0, 0, None),  # a good step
        (False, float("nan"), 0, "nonfinite_loss"),  # bf16/fp32: no scaler, the guard judges the loss
    ],
)
def test_overflow_is_told_apart_from_a_bad_step(
    found_inf: bool, loss: float, overflows: int, reason: str
) -> None:
    import torch

    from engine.train.bad_steps import BadStepGuard
    from engine.train.trainer import Trainer

    trainer = Trainer.__new__(Trainer)  # the step judgement only: no model, no process group
    trainer.optimizer, trainer.guard, trainer.overflow_steps = _Optimizer(found_inf), BadStepGuard(), 0
    ok, _ = trainer._judged_optimizer_step([{"loss": torch.tensor([loss, 1.0])}])
    assert ok is (not found_inf and reason is None)
    assert trainer.overflow_steps == overflows
    assert (trainer.verdict or {}).get("reason") == reason
    assert "prepare_grads" not in vars(trainer.optimizer), "the wrapper is removed after the step"
