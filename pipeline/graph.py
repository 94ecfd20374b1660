"""The stage graph: which stage needs which, and the order to run a chosen subset in."""

from __future__ import annotations

from typing import Any

from pipeline.errors import ConfigError

# Each stage and the stages whose outputs it reads.
DEPENDS: dict[str, tuple[str, ...]] = {
    "data_prep": (),
    "pretrain": ("data_prep",),
    "sft": ("data_prep", "pretrain"),
    "rlhf": ("data_prep", "sft"),
    "eval": ("data_prep", "pretrain", "sft", "rlhf"),
}
STAGES: tuple[str, ...] = tuple(DEPENDS)
"""Every stage, in the order they run."""
TRAIN_STAGES: tuple[str, ...] = ("pretrain", "sft", "rlhf")
"""The stages that train a model with the engine."""


def upstream(stage: str) -> tuple[str, ...]:
    """Direct upstream stages of ``stage`` in the full graph."""
    if stage not in DEPENDS:
        raise ConfigError(f"run.stages={stage!r}: must be one of {list(STAGES)}")
    return DEPENDS[stage]


def weights_upstream(stage: str) -> str | None:
    """The training stage whose final checkpoint ``<stage>.init_from: auto`` loads (None: random init)."""
    ups = [u for u in upstream(stage) if u in TRAIN_STAGES]
    return ups[-1] if ups else None


def required(stage: str, cfg: Any) -> tuple[str, ...]:
    """Upstream stages whose outputs ``stage`` reads under ``cfg``: a training stage whose init_from is not
    ``auto`` (a path, hf:<dir>, null) does not read its predecessor's weights; eval reads the stages it scores."""
    ups = upstream(stage)
    if stage in TRAIN_STAGES and getattr(cfg, stage).init_from != "auto":
        return tuple(u for u in ups if u == "data_prep")
    if stage == "eval":
        return tuple(u for u in ups if u == "data_prep" or u in cfg.eval.models)
    return ups


def order(selected: list[str]) -> list[str]:
    """The selected stages in graph order (duplicates dropped)."""
    for s in selected:
        upstream(s)
    return [s for s in STAGES if s in selected]


def dependencies(stage: str, selected: list[str]) -> list[str]:
    """Upstream stages of ``stage`` that run in this submission (the rest must already be complete)."""
    return [u for u in upstream(stage) if u in selected]


def downstream(stage: str, selected: list[str]) -> list[str]:
    """Selected stages that depend on ``stage`` directly or transitively."""
    out: list[str] = []
    for s in order(selected):
        if any(u == stage or u in out for u in upstream(s)):
            out.append(s)
    return out
