"""The configuration schema: ``PipelineConfig``, the whole run, composed of one section per component.

The sections live in ``pipeline.schema.sections`` (model, parallel, cluster, data, planner, run) and
``pipeline.schema.stage_sections`` (one per stage); YAML under ``conf/`` only selects and overrides.
``pipeline.schema.compose`` composes conf/ with Hydra, ``pipeline.schema.build.build_config`` turns the result
into a validated ``PipelineConfig`` (every error is a ``ConfigError`` naming the dotted key, the value and what is
allowed) and ``pipeline.schema.identity`` hashes it into the run directory's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipeline.schema import graph
from pipeline.schema.domains import choice
from pipeline.schema.graph import STAGES
from pipeline.schema.search import SearchConfig
from pipeline.schema.sections import ClusterConfig, DataConfig, ModelConfig, PlannerConfig, RunConfig
from pipeline.schema.stage_sections import (
    DataPrepStage,
    EvalStage,
    ExportStage,
    RewardModelStage,
    RLHFStage,
    TrainStage,
)


@dataclass
class PipelineConfig:
    """The whole run: one config object, composed by Hydra from conf/ and validated here."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    data_prep: DataPrepStage = field(default_factory=DataPrepStage)
    pretrain: TrainStage = field(default_factory=TrainStage)
    sft: TrainStage = field(default_factory=TrainStage)
    rlhf: RLHFStage = field(default_factory=RLHFStage)
    eval: EvalStage = field(default_factory=EvalStage)
    reward_model: RewardModelStage = field(default_factory=lambda: RewardModelStage())
    export: ExportStage = field(default_factory=lambda: ExportStage())
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    search: SearchConfig = field(default_factory=SearchConfig)

    def stage(self, name: str) -> DataPrepStage | TrainStage | EvalStage | ExportStage:
        choice("run.stages", name, STAGES)
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_sections() -> None:
    """Each stage of the registry (pipeline.schema.graph.REGISTRY) has its section in PipelineConfig, of its type."""
    fields = {f.name: f.type for f in dataclasses.fields(PipelineConfig)}
    for s in graph.REGISTRY:
        have = fields.get(s.name)
        have = have if isinstance(have, str) else getattr(have, "__name__", None)
        if have != s.section:
            raise RuntimeError(
                f"pipeline.schema.graph declares stage {s.name!r} with section {s.section}: add "
                f"'{s.name}: {s.section} = field(default_factory={s.section})' to PipelineConfig (found {have})"
            )


_check_sections()
