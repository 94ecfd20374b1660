"""Hydra: the schema in the ConfigStore, ``CONF_DIR`` and ``compose``, the one compose path of every command."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.schema.build import build_config
from pipeline.schema.config import PipelineConfig
from pipeline.schema.sections import ClusterConfig, DataConfig, ModelConfig, ParallelConfig


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (conf/config.yaml lists 'pipeline_schema' first)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if "pipeline_schema.yaml" in cs.repo:  # once per process: storing the schema costs ~0.4 s each time
        return
    cs.store(name="pipeline_schema", node=PipelineConfig)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="cluster", name="schema", node=ClusterConfig)
    cs.store(group="data", name="schema", node=DataConfig)
    cs.store(group="parallel", name="schema", node=ParallelConfig)


def _conf_dir() -> Path:
    """``conf/`` next to the packages in a checkout (or a job's code snapshot); ``pipeline/conf`` in a wheel."""
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent / "conf"
    return checkout if (checkout / "config.yaml").is_file() else package / "conf"


CONF_DIR = _conf_dir()


def compose(
    overrides: list[str] | None = None, config_name: str = "config", return_hydra_config: bool = False
) -> Any:
    """Compose conf/ with Hydra's compose API: the one compose path of every command; returns a DictConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(
            config_name, overrides=list(overrides or []), return_hydra_config=return_hydra_config
        )


def load_config(overrides: list[str] | None = None) -> PipelineConfig:
    """Compose and validate (without the input pre-flight and the error normalization of ``pipeline.cli.compose.load``,
    which the commands use)."""
    return build_config(compose(overrides))
