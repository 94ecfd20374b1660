"""Weights & Biases sink (optional: ``pip install .[wandb]``), rank 0 only.

One W&B run per stage, grouped by the run directory's name; the run id is kept in
``<stage dir>/wandb/run_id``, so a resumed stage continues the same W&B run. Without credentials
(no ``WANDB_API_KEY``, no ``WANDB_MODE``) it runs offline: ``wandb sync <stage dir>/wandb/offline-run-*``
uploads it later.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.callbacks.lines import LineSink, kept_run_id
from engine.callbacks.tensorboard import scalars
from engine.train.callback import Callback, StageInfo, StepView
from pipeline.schema.stage_sections import MonitorConfig


def mode() -> str:
    """WANDB_MODE if set, else online with an API key, else offline."""
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


class WandB(LineSink):
    def __init__(self, out_dir: Path, project: str, group: str, name: str, config: Mapping[str, Any]) -> None:
        self.dir = Path(out_dir) / "wandb"
        self.project, self.group, self.name, self.config = project, group, name, dict(config)
        self.run: Any = None

    def run_id(self) -> str:
        """The stage's W&B run id: stored on first use, reused on resume."""
        return kept_run_id(self.dir, lambda: uuid.uuid4().hex[:12])[0]

    def on_train_start(self, view: StepView) -> None:
        try:
            import wandb
        except ImportError as e:  # the sink is disabled (logged), training goes on
            raise ImportError(
                f"{view.stage.name}.monitor.sinks has wandb but it is not installed (pip install '.[wandb]')"
            ) from e

        rid = self.run_id()
        self.run = wandb.init(
            project=self.project,
            group=self.group,
            name=self.name,
            job_type=self.name,
            id=rid,
            resume="allow",
            dir=str(self.dir.parent),
            config=self.config,
            mode=mode(),  # type: ignore[arg-type]
            settings=wandb.Settings(console="off", silent=True),
        )

    def _log(self, prefix: str, view: StepView) -> None:
        if self.run is not None:
            self.run.log({f"{prefix}/{k}": v for k, v in scalars(view.metrics).items()}, step=view.step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def sink(mon: MonitorConfig, info: StageInfo) -> Callback:
    """``monitor.sinks: [wandb]``: one W&B run per stage in project ``monitor.wandb_project``."""
    group = info.run_dir.name if info.run_dir else info.out_dir.name
    return WandB(info.out_dir, mon.wandb_project, group, info.name, info.config)
