"""Hugging Face model families this project reads and writes: one declaration each, no torch.

A family says how its ``config.json`` differs from the common Llama-style reading in ``hf_arch``: the fields
it requires to have a supported value, whether query/key/value projections carry biases, which ModelConfig
exports as it, and the fields it writes on export. Adding a family: a ``Family`` here (and, where its tensors
are named differently, a weight table in engine/models/hf_weights.py); docs/EXTENDING.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.schema.config import ModelConfig

Requirement = tuple[str, tuple[Any, ...], Any]
"""(config.json field, the values supported, its value when absent)."""

COMMON: tuple[Requirement, ...] = (
    ("hidden_act", ("silu",), "silu"),
    ("mlp_bias", (False,), False),
    ("pretraining_tp", (1,), 1),
    ("attention_dropout", (0, 0.0), 0.0),
)
"""Requirements of every family: SwiGLU MLP without biases, no attention dropout."""


@dataclass(frozen=True)
class Family:
    model_type: str
    """config.json's ``model_type``."""
    architecture: str
    """The one ``architectures`` entry supported (the transformers class)."""
    requires: tuple[Requirement, ...] = ()
    """Family-specific fields that must hold a supported value (beyond ``COMMON``)."""
    qkv_bias: bool = False
    """Query/key/value projections always carry biases (else config.json's ``attention_bias`` decides)."""
    exports: Callable[[ModelConfig], bool] | None = None
    """Which ModelConfig is written as this family on export (None: read only)."""
    export_fields: dict[str, Any] = field(default_factory=dict)
    """config.json fields this family writes on export, beyond the common ones."""


def _no_qkv_bias(model: ModelConfig) -> bool:
    return not model.add_qkv_bias


def _qkv_bias(model: ModelConfig) -> bool:
    return model.add_qkv_bias


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            exports=_no_qkv_bias,
            export_fields={"attention_bias": False, "mlp_bias": False},
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            requires=(("use_sliding_window", (False, None), False), ("sliding_window", (None,), None)),
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            requires=(("use_sliding_window", (False, None), False),),
            qkv_bias=True,
            exports=_qkv_bias,
            export_fields={"use_sliding_window": False, "sliding_window": None},
        ),
    )
}
"""model_type -> its declaration."""


def exported_family(model: ModelConfig) -> Family:
    """The family a ModelConfig is written as (the first whose ``exports`` accepts it)."""
    return next(f for f in FAMILIES.values() if f.exports is not None and f.exports(model))
