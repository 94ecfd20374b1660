"""A Hugging Face ``config.json`` <-> this project's ModelConfig (no torch: the planner and validation use it).

Supported: decoder-only Llama-style models of the families in ``pipeline.schema.hf_families`` (Llama,
Mistral without a sliding window, Qwen2): RMSNorm, SwiGLU, RoPE (plain or Llama-3 scaled), grouped-query attention,
tied or untied embeddings, query/key/value biases (Qwen2). Anything else fails naming the field.

``model_config(hf_dir)`` reads the directory's config.json; ``to_hf_config(model)`` writes one back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.schema.config import ModelConfig
from pipeline.schema.hf_families import COMMON, FAMILIES, exported_family

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
)
"""ModelConfig keys a Hugging Face config.json decides (the others: seq_length, dropout, ... stay the user's)."""


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


def arch_values(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The ModelConfig architecture keys (ARCH_KEYS) a config.json decides; HFConfigError names a bad field."""
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
    for field, allowed, default in COMMON + family.requires:
        _require(hf, where, field, allowed, default)
    for field in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
    ):
        if not isinstance(hf.get(field), int):
            raise HFConfigError(f"{where}: {field}={hf.get(field)!r}: missing or not an integer")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
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
        "add_qkv_bias": family.qkv_bias or bool(hf.get("attention_bias", False)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **_rope(hf, where),
    }


def model_config(hf_dir: Path, **overrides: Any) -> ModelConfig:
    """A ModelConfig for the model in ``hf_dir`` (architecture from config.json; ``overrides`` for the rest)."""
    hf = read_config(hf_dir)
    values = arch_values(hf, str(Path(hf_dir) / "config.json"))
    base = {"name": Path(hf_dir).name, "make_vocab_size_divisible_by": 1}
    if "max_position_embeddings" in hf:
        base["seq_length"] = min(int(hf["max_position_embeddings"]), 4096)
    return ModelConfig(**{**base, **overrides, **values})


def to_hf_config(model: ModelConfig, vocab_size: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config.json for ``model``, written as the family that exports it (Llama, or Qwen2 when it has
    query/key/value biases and no other bias)."""
    if model.normalization != "RMSNorm" or model.activation != "swiglu" or model.position_embedding != "rope":
        raise HFConfigError(
            f"model {model.name!r}: normalization={model.normalization}, activation={model.activation}, "
            f"position_embedding={model.position_embedding}: Hugging Face export needs RMSNorm, swiglu, rope"
        )
    if model.add_bias_linear:
        raise HFConfigError(f"model.add_bias_linear={model.add_bias_linear}: Llama/Qwen2 export needs false")
    family = exported_family(model)
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
    return {**cfg, **family.export_fields, **(extra or {})}
