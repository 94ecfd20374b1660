"""A Hugging Face ``config.json`` <-> this project's ModelConfig (no torch: the planner and validation use it).

Supported: decoder-only Llama-style models of the families in ``pipeline.schema.hf_families`` (Llama,
Mistral without a sliding window, Qwen2, Qwen3; Mixture of Experts: Qwen3-MoE, Mixtral, Qwen2-MoE): RMSNorm,
SwiGLU, RoPE (plain or Llama-3 scaled), grouped-query attention, tied or untied embeddings, query/key/value
biases (Qwen2), per-head query/key norms (Qwen3), softmax top-k routers with or without renormalised top-k
probabilities, a gated shared expert (Qwen2-MoE), dense layers between MoE layers (Qwen's mlp_only_layers /
decoder_sparse_step). Anything else fails naming the field.

``model_config(hf_dir)`` reads the directory's config.json; ``to_hf_config(model)`` writes one back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.schema.config import ModelConfig
from pipeline.schema.hf_families import COMMON, FAMILIES, FOREIGN, Family, exported_family
from pipeline.schema.moe import expert_ffn, moe_layers

PREFIX = "hf:"
"""``<stage>.init_from=hf:/path/to/model`` names a Hugging Face model directory."""

ARCH_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "vocab_size",
    "max_position_embeddings",
    "normalization",
    "norm_epsilon",
    "activation",
    "position_embedding",
    "rotary_base",
    "rotary_scaling",
    "rotary_scaling_factor",
    "rotary_low_freq_factor",
    "rotary_high_freq_factor",
    "rotary_original_max_positions",
    "add_bias_linear",
    "add_qkv_bias",
    "tie_embeddings",
    "qk_layernorm",
    "num_experts",
)
"""ModelConfig keys a Hugging Face config.json decides (the others: seq_length, dropout, ... stay the user's)."""

MOE_KEYS = (
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_norm_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_layer_freq",
    "moe_layer_pattern",
)
"""The MoE keys a MoE family's config.json decides besides ARCH_KEYS (a dense config.json leaves them alone;
the load-balancing loss, its coefficient and the router dtype stay the user's)."""


class HFConfigError(ValueError):
    """config.json describes a model this converter does not support; the message names the field."""


def parse_ref(value: str | None) -> Path | None:
    """The directory of an ``hf:<dir>`` reference (None for anything else)."""
    if isinstance(value, str) and value.startswith(PREFIX):
        return Path(value[len(PREFIX) :]).expanduser()
    return None


def is_hf_dir(path: Path) -> bool:
    """A directory holding a Hugging Face model (config.json and safetensors weights)."""
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def read_config(hf_dir: Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise HFConfigError(f"{path}: no such file (a Hugging Face model directory holds config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path}: not valid JSON: {e}") from None


def _rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """RoPE settings from either transformers 5 (``rope_parameters``) or 4.x (``rope_theta`` + ``rope_scaling``)."""
    params = dict(hf.get("rope_parameters") or {})
    key = "rope_parameters"
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        key = "rope_scaling"
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise HFConfigError(f"{where}: rope_theta={theta}: only whole-number RoPE bases are supported")
    out: dict[str, Any] = {"position_embedding": "rope", "rotary_base": int(theta), "rotary_scaling": False}
    if kind == "default":
        return out
    if kind != "llama3":
        raise HFConfigError(f"{where}: {key}.rope_type={kind!r}: unsupported (supported: default, llama3)")
    out |= {
        "rotary_scaling": True,
        "rotary_scaling_factor": float(params["factor"]),
        "rotary_low_freq_factor": float(params.get("low_freq_factor", 1.0)),
        "rotary_high_freq_factor": float(params.get("high_freq_factor", 4.0)),
        "rotary_original_max_positions": int(params.get("original_max_position_embeddings", 8192)),
    }
    return out


def _require(hf: dict[str, Any], where: str, field: str, allowed: tuple[Any, ...], default: Any) -> None:
    value = hf.get(field, default)
    if value not in allowed:
        raise HFConfigError(f"{where}: {field}={value!r}: unsupported (supported: {list(allowed)})")


def family_of(hf: dict[str, Any], where: str = "config.json") -> Family:
    """The family of a config.json (its ``model_type`` and ``architectures``); HFConfigError otherwise."""
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise HFConfigError(
            f"{where}: model_type={model_type!r}: unsupported (supported: {sorted(FAMILIES)})"
        )
    archs = hf.get("architectures") or [family.architecture]
    if archs != [family.architecture]:
        raise HFConfigError(
            f"{where}: architectures={archs}: unsupported (supported: [{family.architecture!r}])"
        )
    return family


def _int(hf: dict[str, Any], where: str, field: str, minimum: int = 1) -> int:
    value = hf.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise HFConfigError(f"{where}: {field}={value!r}: missing or not an integer >= {minimum}")
    return value


def _check_features(hf: dict[str, Any], family: Family, where: str) -> None:
    """The family's requirements, no foreign router feature, full attention in every layer."""
    for field, allowed, default in COMMON + family.requires:
        _require(hf, where, field, allowed, default)
    shared = family.experts is not None and family.experts.shared
    for field, (allowed, what) in FOREIGN.items():
        if field == "shared_expert_intermediate_size" and shared:
            continue
        if hf.get(field) not in allowed:
            raise HFConfigError(
                f"{where}: {field}={hf.get(field)!r}: {what}: unsupported for model_type={family.model_type!r} "
                f"(supported: {list(allowed)})"
            )
    if not isinstance(family.qkv_bias, str):
        _require(hf, where, "attention_bias", (False, None), False)  # it would bias o_proj too
    kinds = hf.get("layer_types")
    if kinds is not None and any(k != "full_attention" for k in kinds):
        raise HFConfigError(f"{where}: layer_types={kinds!r}: only full_attention layers are supported")


def _moe_pattern(hf: dict[str, Any], layers: int, where: str) -> list[int]:
    """Qwen's MoE layers: layer i is MoE unless listed in mlp_only_layers, when (i + 1) % step == 0."""
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or not 1 <= step <= layers:
        raise HFConfigError(f"{where}: decoder_sparse_step={step!r}: must be an integer in [1, {layers}]")
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
        raise HFConfigError(f"{where}: mlp_only_layers={dense!r}: must list layer numbers in [0, {layers})")
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def moe_values(hf: dict[str, Any], family: Family, where: str = "config.json") -> dict[str, Any]:
    """The ModelConfig MoE keys (num_experts and MOE_KEYS) of a MoE family's config.json."""
    ex = family.experts
    if ex is None:
        return {"num_experts": None}
    field = next((f for f in ex.count if f in hf), ex.count[0])
    experts = _int(hf, where, field)
    topk = _int(hf, where, "num_experts_per_tok")
    if topk > experts:
        raise HFConfigError(f"{where}: num_experts_per_tok={topk}: must be <= {field}={experts}")
    norm = ex.norm_topk
    if norm is None:
        norm = hf.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise HFConfigError(f"{where}: norm_topk_prob={norm!r}: must be true or false")
    elif hf.get("norm_topk_prob", norm) != norm:
        raise HFConfigError(
            f"{where}: norm_topk_prob={hf['norm_topk_prob']!r}: {family.model_type} needs {norm}"
        )
    if topk == 1 and norm:
        raise HFConfigError(f"{where}: num_experts_per_tok=1 with norm_topk_prob=true: unsupported")
    layers = hf["num_hidden_layers"]
    pattern = _moe_pattern(hf, layers, where) if ex.sparse_step else [1] * layers
    if not any(pattern):
        raise HFConfigError(
            f"{where}: mlp_only_layers={hf.get('mlp_only_layers')!r}: with decoder_sparse_step="
            f"{hf.get('decoder_sparse_step', 1)} no MoE layer is left"
        )
    shared = _int(hf, where, "shared_expert_intermediate_size") if ex.shared else None
    return {
        "num_experts": experts,
        "moe_router_topk": topk,
        "moe_router_score_function": "softmax",
        "moe_router_norm_topk": norm,
        "moe_ffn_hidden_size": _int(hf, where, ex.width),
        "moe_shared_expert_intermediate_size": shared,
        "moe_shared_expert_gate": ex.shared,
        "moe_layer_freq": 1,
        "moe_layer_pattern": [] if all(pattern) else pattern,
    }


def arch_values(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The ModelConfig architecture keys (ARCH_KEYS, and MOE_KEYS for a MoE family) a config.json decides;
    HFConfigError names a bad field."""
    family = family_of(hf, where)
    _check_features(hf, family, where)
    for field in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
    ):
        _int(hf, where, field)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    qkv_bias = family.qkv_bias
    if isinstance(qkv_bias, str):
        qkv_bias = hf.get(qkv_bias, True)
        if not isinstance(qkv_bias, bool):
            raise HFConfigError(f"{where}: {family.qkv_bias}={qkv_bias!r}: must be true or false")
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "kv_channels": head_dim,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings"),
        "normalization": "RMSNorm",
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "activation": "swiglu",
        "add_bias_linear": False,
        "add_qkv_bias": qkv_bias,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qk_layernorm": family.qk_norm,
        **_rope(hf, where),
        **moe_values(hf, family, where),
    }


def model_config(hf_dir: Path, **overrides: Any) -> ModelConfig:
    """A ModelConfig for the model in ``hf_dir`` (architecture from config.json; ``overrides`` for the rest)."""
    hf = read_config(hf_dir)
    values = arch_values(hf, str(Path(hf_dir) / "config.json"))
    base = {"name": Path(hf_dir).name, "make_vocab_size_divisible_by": 1}
    if "max_position_embeddings" in hf:
        base["seq_length"] = min(int(hf["max_position_embeddings"]), 4096)
    return ModelConfig(**{**base, **overrides, **values})


UNEXPORTABLE = (
    "Hugging Face export writes a dense model as Llama (no biases), Qwen2 (query/key/value biases) or Qwen3 "
    "(qk_layernorm), a MoE model with a softmax router as Qwen3-MoE (qk_layernorm), Mixtral (every layer MoE, "
    "moe_router_norm_topk, no biases) or Qwen2-MoE (a gated shared expert)"
)


def _moe_fields(model: ModelConfig, family: Family) -> dict[str, Any]:
    """The MoE fields of ``family``'s config.json for ``model`` (nothing for a dense family)."""
    ex = family.experts
    if ex is None:
        return {}
    out: dict[str, Any] = {
        ex.count[0]: model.num_experts,
        "num_experts_per_tok": model.moe_router_topk,
        ex.width: expert_ffn(model),
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
        "output_router_logits": False,
    }
    if ex.norm_topk is None:
        out["norm_topk_prob"] = model.moe_router_norm_topk
    if ex.sparse_step:
        out["decoder_sparse_step"] = 1
        out["mlp_only_layers"] = [i for i, sparse in enumerate(moe_layers(model)) if not sparse]
    if ex.shared:
        out["shared_expert_intermediate_size"] = model.moe_shared_expert_intermediate_size
    if isinstance(family.qkv_bias, str):
        out[family.qkv_bias] = model.add_qkv_bias
    return out


def export_family(model: ModelConfig) -> Family:
    """The family ``model`` is written as; HFConfigError naming the keys when none writes it."""
    if model.normalization != "RMSNorm" or model.activation != "swiglu" or model.position_embedding != "rope":
        raise HFConfigError(
            f"model {model.name!r}: normalization={model.normalization}, activation={model.activation}, "
            f"position_embedding={model.position_embedding}: Hugging Face export needs RMSNorm, swiglu, rope"
        )
    if model.add_bias_linear:
        raise HFConfigError(f"model.add_bias_linear={model.add_bias_linear}: Hugging Face export needs false")
    family = exported_family(model)
    if family is None:
        raise HFConfigError(
            f"model {model.name!r}: qk_layernorm={model.qk_layernorm}, add_qkv_bias={model.add_qkv_bias}, "
            f"num_experts={model.num_experts}, moe_router_score_function={model.moe_router_score_function}, "
            f"moe_shared_expert_intermediate_size={model.moe_shared_expert_intermediate_size}: {UNEXPORTABLE}"
        )
    return family


def to_hf_config(model: ModelConfig, vocab_size: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config.json for ``model``, written as the family that exports it (``export_family``)."""
    family = export_family(model)
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    rope: dict[str, Any] = {"rope_theta": float(model.rotary_base), "rope_type": "default"}
    if model.rotary_scaling:
        rope |= {
            "rope_type": "llama3",
            "factor": float(model.rotary_scaling_factor),
            "low_freq_factor": float(model.rotary_low_freq_factor),
            "high_freq_factor": float(model.rotary_high_freq_factor),
            "original_max_position_embeddings": int(model.rotary_original_max_positions),
        }
    cfg: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size or 4 * model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups or model.num_attention_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_epsilon,
        "vocab_size": vocab_size,
        "max_position_embeddings": model.max_position_embeddings or model.seq_length,
        "tie_word_embeddings": model.tie_embeddings,
        "rope_parameters": rope,
        "rope_theta": float(model.rotary_base),
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }
    return {**cfg, **family.export_fields, **_moe_fields(model, family), **(extra or {})}
