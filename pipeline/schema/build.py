"""``build_config``: a composed Hydra config (or plain dict) into a validated ``PipelineConfig``.

Each section validates itself (domains, choices, relations inside it); here come the dotted key paths of
errors, unknown keys, and the relations between sections: layouts against the model and cluster, time limits,
keys nothing reads in the chosen mode (pipeline.schema.ignored).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from pipeline.schema import ignored
from pipeline.schema.config import PipelineConfig
from pipeline.schema.domains import fail
from pipeline.schema.errors import ConfigError
from pipeline.schema.layout import check_layout
from pipeline.schema.moe import check_moe_peft
from pipeline.schema.origins import GIVEN, Origin, Origins, leaves
from pipeline.schema.search import SearchConfig
from pipeline.schema.sections import (
    ClusterConfig,
    DataConfig,
    DataSource,
    HealthConfig,
    ModelConfig,
    ParallelConfig,
    PlannerConfig,
    RunConfig,
)
from pipeline.schema.stage_sections import (
    DataPrepStage,
    EvalStage,
    ExportStage,
    MonitorConfig,
    PeftConfig,
    RewardModelStage,
    RLHFStage,
    TrainStage,
)


def _build(cls: type, data: Any, path: str) -> Any:
    """Construct dataclass ``cls`` from plain ``data``, prefixing errors with the dotted ``path``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or '<root>'}={data!r}: expected a mapping of {cls.__name__} fields")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, list(fields), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{_join(path, k)}={data[k]!r}: unknown key{hint}; valid keys: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        ftype = fields[name].type
        sub = _DATACLASSES.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
        item = _DATACLASSES.get(ftype[5:-1]) if isinstance(ftype, str) and ftype.startswith("list[") else None
        if item is not None and isinstance(value, list):  # a list of dataclasses (data.sources)
            kwargs[name] = [_build(item, v, f"{_join(path, name)}[{i}]") for i, v in enumerate(value)]
            continue
        kwargs[name] = _build(sub, value, _join(path, name)) if sub else value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{_join(path, str(e))}") from None
    except TypeError as e:
        raise ConfigError(f"{path or '<root>'}: {e}") from None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_DATACLASSES: dict[str, type] = {
    c.__name__: c
    for c in (
        ModelConfig,
        ParallelConfig,
        MonitorConfig,
        PeftConfig,
        ClusterConfig,
        HealthConfig,
        DataConfig,
        DataSource,
        DataPrepStage,
        TrainStage,
        RLHFStage,
        EvalStage,
        RewardModelStage,
        ExportStage,
        RunConfig,
        PlannerConfig,
        SearchConfig,
        PipelineConfig,
    )
}


Resolve = Callable[[PipelineConfig, Origins], tuple[PipelineConfig, Origins]]
"""Fills values from referenced files before the cross-field checks, with their origins."""


def build_config(
    cfg: Any, *, resolve: Resolve | None = None, origins: Origins | None = None
) -> PipelineConfig:
    """Validate a composed Hydra config (DictConfig or dict) into a PipelineConfig, fully resolved.

    Raises ConfigError naming the key; a key the command line did not set is followed by where its value came
    from (``origins``, recorded at composition: pipeline.schema.compose.compose_traced; without them every value
    that differs from the schema default counts as set by the user). ``resolve`` fills values from referenced
    files before the cross-field checks (the commands pass ``pipeline.schema.hf_model.apply``: ``hf:<dir>``
    model references). Cross-field checks (layouts against the model and cluster, keys nothing reads in the
    chosen mode) run here too; the commands add the pre-flight of inputs (``pipeline.cli.compose.load``), so
    nothing is submitted or written before the whole config is known good.
    """
    return build_traced(cfg, resolve=resolve, origins=origins)[0]


def build_traced(
    cfg: Any, *, resolve: Resolve | None = None, origins: Origins | None = None
) -> tuple[PipelineConfig, Origins]:
    """``build_config`` that also returns the origins after ``resolve`` (values it filled in are its)."""
    from omegaconf import DictConfig, OmegaConf

    raw = (
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        if isinstance(cfg, DictConfig)
        else cfg
    )
    if not isinstance(raw, dict):
        raise ConfigError(f"<root>={raw!r}: expected a mapping")
    data = {str(k): v for k, v in raw.items() if k != "hydra"}
    if origins is None:
        origins = untraced(data)
    values = dict(leaves(data))
    try:
        pc: PipelineConfig = _build(PipelineConfig, data, "")
        if resolve is not None:
            pc, origins = resolve(pc, origins)
            values = dict(leaves(pc.to_dict()))
        _check_cross(pc, origins)
    except ConfigError as e:
        raise ConfigError(origins.annotate(str(e), values)) from None
    return pc, origins


def untraced(data: dict[str, Any]) -> Origins:
    """Origins of a config given as a plain mapping: each value that differs from the schema default."""
    defaults = dict(leaves(PipelineConfig().to_dict()))
    missing = object()
    return Origins(
        {
            k: Origin(GIVEN, "the given config", user=True)
            for k, v in leaves(data)
            if defaults.get(k, missing) != v
        }
    )


def _check_cross(pc: PipelineConfig, origins: Origins) -> None:
    """Relations between keys of different sections, and keys the user set that nothing reads."""
    for name in pc.run.stages:
        check_layout(pc, name)
    _check_modes(pc)
    ignored.check(pc, origins)
    c = pc.cluster
    if c.executor == "slurm":
        for name in pc.run.stages:
            limit = pc.stage(name).time_min or c.time_min
            if c.signal_delay_s >= limit * 60:
                key = f"{name}.time_min" if pc.stage(name).time_min else "cluster.time_min"
                fail(
                    "cluster.signal_delay_s",
                    c.signal_delay_s,
                    f"the warning signal must come before the time limit ({key}={limit} min = {limit * 60} s)",
                )
    if pc.eval.num_task_examples > pc.data.num_eval_examples:
        fail(
            "eval.num_task_examples",
            pc.eval.num_task_examples,
            f"must be <= data.num_eval_examples={pc.data.num_eval_examples} (the held-out set data prep writes)",
        )
    if pc.model.vocab_size is not None and pc.data.tokenizer_path is None:
        if pc.model.vocab_size < pc.data.vocab_size:
            fail(
                "model.vocab_size",
                pc.model.vocab_size,
                f"must be >= data.vocab_size={pc.data.vocab_size} (the tokenizer data prep trains)",
            )


def _check_modes(pc: PipelineConfig) -> None:
    """Values that cannot work together (whoever set them)."""
    for name in pc.run.stages:
        st = pc.stage(name)
        if isinstance(st, TrainStage) and st.save_interval == "auto" and pc.cluster.node_mtbf_hours is None:
            fail(
                f"{name}.save_interval",
                "auto",
                "chooses the interval from the failure rate: set cluster.node_mtbf_hours (one node's mean time "
                "between failures, hours), or give a number of steps",
            )
    if pc.pretrain.peft.method != "none":
        fail(
            "pretrain.peft.method",
            pc.pretrain.peft.method,
            "LoRA is for sft and rlhf; pretrain trains every weight",
        )
    for name in ("sft", "rlhf"):
        st = getattr(pc, name)
        if name in pc.run.stages:
            check_moe_peft(pc.model, st.peft, name)
        if st.peft.method == "lora" and st.init_from in (None, "", "none", "null"):
            fail(
                f"{name}.peft.method",
                st.peft.method,
                f"LoRA adapts a base model: {name}.init_from must name one (auto, a checkpoint or hf:<dir>), not null",
            )


def from_dict(data: dict[str, Any]) -> PipelineConfig:
    """Rebuild a PipelineConfig from ``to_dict()`` output (used inside jobs)."""
    return _build(PipelineConfig, data, "")
