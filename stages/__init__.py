"""The stage modules, one per stage declared in pipeline.schema.graph, each with ``main(cfg, ctx) -> outputs``.

``entry(stage)`` imports a stage's module (plain function-level imports: the import graph shows them, and a
job imports only its own stage) and returns its ``main``. Every declared stage has an entry (checked here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeline.schema.graph import STAGES

if TYPE_CHECKING:
    from engine.context import StageContext
    from pipeline.schema.config import PipelineConfig

StageMain = Callable[["PipelineConfig", "StageContext"], dict[str, Any]]
"""A stage's ``main(cfg, ctx)``: runs on every rank of the stage's job, returns rank 0's outputs."""


def _data_prep() -> StageMain:
    from stages.data_prep import main

    return main


def _pretrain() -> StageMain:
    from stages.pretrain import main

    return main


def _sft() -> StageMain:
    from stages.sft import main

    return main


def _reward_model() -> StageMain:
    from stages.reward_model import main

    return main


def _rlhf() -> StageMain:
    from stages.rlhf import main

    return main


def _eval() -> StageMain:
    from stages.eval import main

    return main


def _export() -> StageMain:
    from stages.export import main

    return main


ENTRIES: dict[str, Callable[[], StageMain]] = {
    "data_prep": _data_prep,
    "pretrain": _pretrain,
    "sft": _sft,
    "reward_model": _reward_model,
    "rlhf": _rlhf,
    "eval": _eval,
    "export": _export,
}
"""Each declared stage's importer (pipeline.schema.graph.REGISTRY names the stages)."""

if set(ENTRIES) != set(STAGES):
    raise RuntimeError(f"stages: entries {sorted(ENTRIES)} differ from the declared stages {sorted(STAGES)}")


def entry(stage: str) -> StageMain:
    """The ``main(cfg, ctx)`` of ``stage`` (imports its module)."""
    return ENTRIES[stage]()
