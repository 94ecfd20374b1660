"""Hugging Face model families this project reads and writes: one declaration each, no torch.

A family says how its ``config.json`` differs from the common Llama-style reading in ``hf_arch``: the fields
it requires to have a supported value, whether query/key/value projections carry biases, whether queries and
keys are normalised per head (Qwen3), how it names its experts (Mixture of Experts), which ModelConfig exports
as it, the fields it writes on export and the weight table its tensors follow. Adding a family: a ``Family``
here (and, where its tensors are named differently, a weight table in engine/models/hf_tables.py);
docs/EXTENDING.md.
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

FOREIGN: dict[str, tuple[tuple[Any, ...], str]] = {
    "n_group": ((None, 1), "a group-limited (DeepSeek-style) router"),
    "topk_group": ((None, 1), "a group-limited (DeepSeek-style) router"),
    "topk_method": ((None, "greedy"), "a router other than plain top-k"),
    "scoring_func": ((None, "softmax"), "router scores other than softmax"),
    "routed_scaling_factor": ((None, 1, 1.0), "scaled routed-expert outputs"),
    "n_shared_experts": ((None, 0), "shared experts, which this family does not have"),
    "first_k_dense_replace": ((None, 0), "dense first layers named the DeepSeek way"),
    "moe_layer_freq": ((None, 1), "MoE layers every N layers named the DeepSeek way"),
    "router_jitter_noise": (
        (None, 0, 0.0),
        "router input jitter (training noise megatron applies differently)",
    ),
    "shared_expert_intermediate_size": ((None, 0), "a shared expert, which this family does not have"),
}
"""Router and MoE features of other families that no family here implements: present with any other value,
config.json is refused naming the field (transformers would silently ignore them for these families)."""


@dataclass(frozen=True)
class Experts:
    """How a Mixture-of-Experts family's config.json describes its experts."""

    count: tuple[str, ...]
    """Fields holding the number of routed experts (the first present; transformers 5 writes
    ``num_local_experts`` where published Qwen checkpoints say ``num_experts``)."""
    width: str
    """The field of one expert's MLP width."""
    norm_topk: bool | None = None
    """The top-k probabilities are renormalised always (True), or as ``norm_topk_prob`` says (None)."""
    sparse_step: bool = False
    """``decoder_sparse_step`` and ``mlp_only_layers`` choose the MoE layers (Qwen), else every layer."""
    shared: bool = False
    """Every MoE layer also has a shared expert (``shared_expert_intermediate_size``) with a sigmoid gate."""


@dataclass(frozen=True)
class Family:
    model_type: str
    """config.json's ``model_type``."""
    architecture: str
    """The one ``architectures`` entry supported (the transformers class)."""
    requires: tuple[Requirement, ...] = ()
    """Family-specific fields that must hold a supported value (beyond ``COMMON``)."""
    qkv_bias: bool | str = False
    """Query/key/value projections always carry biases (True), never (False, and ``attention_bias``, which
    would bias o_proj too, must be false), or as the named boolean field says (its default True)."""
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys (``self_attn.q_norm`` / ``k_norm``: model.qk_layernorm)."""
    experts: Experts | None = None
    """A Mixture-of-Experts family (None: dense)."""
    weights: str = "llama"
    """The weight table of its tensor names (engine/models/hf_tables.py)."""
    exports: Callable[[ModelConfig], bool] | None = None
    """Which ModelConfig is written as this family on export (None: read only)."""
    export_fields: dict[str, Any] = field(default_factory=dict)
    """config.json fields this family writes on export, beyond the common ones."""


def _dense(model: ModelConfig, qkv_bias: bool, qk_norm: bool) -> bool:
    return not model.num_experts and model.add_qkv_bias == qkv_bias and model.qk_layernorm == qk_norm


def _moe(model: ModelConfig, qk_norm: bool, shared: bool) -> bool:
    return (
        bool(model.num_experts)
        and model.qk_layernorm == qk_norm
        and (model.moe_shared_expert_intermediate_size is not None) == shared
        and model.moe_shared_expert_gate == shared
        and model.moe_router_score_function == "softmax"
    )


def _mixtral(model: ModelConfig) -> bool:
    every = model.moe_layer_freq == 1 and all(model.moe_layer_pattern or [1])
    return _moe(model, False, False) and not model.add_qkv_bias and model.moe_router_norm_topk and every


NO_SLIDING = (("use_sliding_window", (False, None), False),)
NO_BIAS_FIELDS = {"attention_bias": False, "mlp_bias": False}

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            exports=lambda m: _dense(m, False, False),
            export_fields=NO_BIAS_FIELDS,
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            requires=(("use_sliding_window", (False, None), False), ("sliding_window", (None,), None)),
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            requires=NO_SLIDING,
            qkv_bias=True,
            exports=lambda m: _dense(m, True, False),
            export_fields={"use_sliding_window": False, "sliding_window": None},
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            requires=NO_SLIDING,
            qk_norm=True,
            weights="qwen3",
            exports=lambda m: _dense(m, False, True),
            export_fields={"use_sliding_window": False, "sliding_window": None, "attention_bias": False},
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            requires=NO_SLIDING,
            qk_norm=True,
            experts=Experts(("num_experts", "num_local_experts"), "moe_intermediate_size", sparse_step=True),
            weights="qwen3_moe",
            exports=lambda m: _moe(m, True, False) and not m.add_qkv_bias,
            export_fields={"use_sliding_window": False, "sliding_window": None, "attention_bias": False},
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            requires=(("sliding_window", (None,), None),),
            experts=Experts(("num_local_experts",), "intermediate_size", norm_topk=True),
            weights="mixtral",
            exports=_mixtral,
            export_fields={"sliding_window": None, "router_jitter_noise": 0.0},
        ),
        Family(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            requires=NO_SLIDING,
            qkv_bias="qkv_bias",
            experts=Experts(("num_experts",), "moe_intermediate_size", sparse_step=True, shared=True),
            weights="qwen2_moe",
            exports=lambda m: _moe(m, False, True),
            export_fields={"use_sliding_window": False, "sliding_window": None},
        ),
    )
}
"""model_type -> its declaration."""


def exported_family(model: ModelConfig) -> Family | None:
    """The family a ModelConfig is written as (the first whose ``exports`` accepts it; None: none does)."""
    return next((f for f in FAMILIES.values() if f.exports is not None and f.exports(model)), None)
