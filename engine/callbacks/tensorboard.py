"""TensorBoard sink: the numbers of metrics.jsonl as scalars in <stage dir>/tensorboard (rank 0 only).

Tags: ``train/<key>`` for each logged train line, ``valid/<key>`` for validation, ``checkpoint/save_s``.
``tensorboard --logdir <run_dir>`` shows every stage of the run (and ``--logdir runs`` every run).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.train.callback import Callback, StageInfo, StepView
from pipeline.schema.stage_sections import MonitorConfig

SKIP = {"kind", "step", "iters", "time"}


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics line, without bookkeeping keys."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if k not in SKIP and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class TensorBoard(Callback):
    """The writer is created at the first scalar (importing it takes a second: not before the first step)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.writer: Any = None

    def _w(self) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)
        return self.writer

    def _add(self, prefix: str, view: StepView) -> None:
        w = self._w()
        for k, v in scalars(view.metrics).items():
            w.add_scalar(f"{prefix}/{k}", v, view.step)

    def on_step_end(self, view: StepView) -> None:
        if view.logged:
            self._add("train", view)

    def on_eval(self, view: StepView) -> None:
        task = view.metrics.get("task")  # an in-training lm-eval task's line, else the validation loss
        self._add(f"tasks/{task}" if view.metrics.get("kind") == "eval_task" else "valid", view)
        self._w().flush()

    def on_save(self, view: StepView) -> None:
        self._add("checkpoint", view)
        self._w().flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def sink(mon: MonitorConfig, info: StageInfo) -> Callback:
    """``monitor.sinks: [tensorboard]``: event files in <stage dir>/tensorboard."""
    return TensorBoard(info.out_dir / "tensorboard")
