"""Hugging Face <-> megatron tensor names, one table per weight layout of a family (plain data, no torch).

A row is (megatron name of the local layer spec, the Hugging Face names it is made of, the transform of
engine/models/hf_weights.py). ``{L}`` is the global layer number (from 0), ``{E}`` the global expert index
(megatron's MoE layer: local expert i of expert-parallel rank r is expert r x experts / ep + i). A family's
``weights`` (pipeline/schema/hf_families.py) names its table. Tables of MoE families with dense layers
(Qwen's mlp_only_layers) hold both the dense and the MoE rows: a layer has the tensors of one of them.
"""

from __future__ import annotations

import re
from functools import cache

from pipeline.schema.config import ModelConfig
from pipeline.schema.hf_arch import export_family
from pipeline.schema.hf_families import FAMILIES

L = "{L}"
E = "{E}"
Row = tuple[str, tuple[str, ...], str]

_HF = "model.layers.{L}."
_MC = "decoder.layers.{L}."

EMBEDDING: Row = ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")
OUTPUT: tuple[Row, ...] = (
    ("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
    ("output_layer.weight", ("lm_head.weight",), "vocab"),
)
ATTENTION: tuple[Row, ...] = (
    (_MC + "input_layernorm.weight", (_HF + "input_layernorm.weight",), "copy"),
    (
        _MC + "self_attention.linear_qkv.weight",
        tuple(f"{_HF}self_attn.{p}_proj.weight" for p in "qkv"),
        "qkv",
    ),
    (_MC + "self_attention.linear_qkv.bias", tuple(f"{_HF}self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    (_MC + "self_attention.linear_proj.weight", (_HF + "self_attn.o_proj.weight",), "row"),
    (_MC + "pre_mlp_layernorm.weight", (_HF + "post_attention_layernorm.weight",), "copy"),
)
QK_NORM: tuple[Row, ...] = (
    (_MC + "self_attention.q_layernorm.weight", (_HF + "self_attn.q_norm.weight",), "copy"),
    (_MC + "self_attention.k_layernorm.weight", (_HF + "self_attn.k_norm.weight",), "copy"),
)
DENSE_MLP: tuple[Row, ...] = (
    (_MC + "mlp.linear_fc1.weight", (_HF + "mlp.gate_proj.weight", _HF + "mlp.up_proj.weight"), "gate_up"),
    (_MC + "mlp.linear_fc2.weight", (_HF + "mlp.down_proj.weight",), "row"),
)


def experts(block: str, gate: str, up: str, down: str) -> tuple[Row, ...]:
    """A MoE layer's router and routed experts: ``<block>.gate`` and ``<block>.experts.{E}.<gate|up|down>``."""
    expert = f"{_HF}{block}.experts.{E}."
    local = f"{_MC}mlp.experts.local_experts.{E}."
    return (
        (_MC + "mlp.router.weight", (f"{_HF}{block}.gate.weight",), "copy"),
        (local + "linear_fc1.weight", (f"{expert}{gate}.weight", f"{expert}{up}.weight"), "expert_gate_up"),
        (local + "linear_fc2.weight", (f"{expert}{down}.weight",), "expert_row"),
    )


SHARED_EXPERT: tuple[Row, ...] = (
    (
        _MC + "mlp.shared_experts.linear_fc1.weight",
        (_HF + "mlp.shared_expert.gate_proj.weight", _HF + "mlp.shared_expert.up_proj.weight"),
        "shared_gate_up",
    ),
    (_MC + "mlp.shared_experts.linear_fc2.weight", (_HF + "mlp.shared_expert.down_proj.weight",), "row"),
    (_MC + "mlp.shared_experts.gate_weight", (_HF + "mlp.shared_expert_gate.weight",), "copy"),
)

QWEN_EXPERTS = experts("mlp", "gate_proj", "up_proj", "down_proj")

TABLES: dict[str, tuple[Row, ...]] = {
    "llama": (EMBEDDING, *ATTENTION, *DENSE_MLP, *OUTPUT),
    "qwen3": (EMBEDDING, *ATTENTION, *QK_NORM, *DENSE_MLP, *OUTPUT),
    "qwen3_moe": (EMBEDDING, *ATTENTION, *QK_NORM, *DENSE_MLP, *QWEN_EXPERTS, *OUTPUT),
    "mixtral": (EMBEDDING, *ATTENTION, *experts("block_sparse_moe", "w1", "w3", "w2"), *OUTPUT),
    "qwen2_moe": (EMBEDDING, *ATTENTION, *DENSE_MLP, *QWEN_EXPERTS, *SHARED_EXPERT, *OUTPUT),
}
"""weight table name (Family.weights) -> its rows, in the order tensors are streamed (per layer, in order)."""

TABLE = TABLES["llama"]
"""The Llama table (Llama, Mistral, Qwen2)."""


def table_for(model: ModelConfig) -> tuple[Row, ...]:
    """The table of the family ``model`` is written as (hf_arch.export_family: HFConfigError when none)."""
    return TABLES[export_family(model).weights]


def table_of(model_type: str) -> tuple[Row, ...]:
    """The table of the family named by a config.json's ``model_type``."""
    return TABLES[FAMILIES[model_type].weights]


@cache
def _patterns(table: tuple[Row, ...]) -> list[tuple[re.Pattern[str], tuple[str, ...], str]]:
    out = []
    for mcore, hf_names, kind in table:
        rx = re.escape(mcore).replace(re.escape(L), r"(?P<L>\d+)").replace(re.escape(E), r"(?P<E>\d+)")
        out.append((re.compile(f"^{rx}$"), hf_names, kind))
    return out


def fill(name: str, layer: int | None, expert: int | None = None) -> str:
    """``name`` with ``{L}`` and ``{E}`` replaced."""
    if layer is not None:
        name = name.replace(L, str(layer))
    if expert is not None:
        name = name.replace(E, str(expert))
    return name


def match(mcore_name: str, table: tuple[Row, ...] = TABLE) -> tuple[tuple[str, ...], str, int | None]:
    """(Hugging Face names with the layer and expert filled in, transform, global layer) for a global
    (TP=1/PP=1/EP=1) megatron name."""
    for pat, hf_names, kind in _patterns(table):
        m = pat.match(mcore_name)
        if m:
            g = m.groupdict()
            layer = int(g["L"]) if g.get("L") else None
            expert = int(g["E"]) if g.get("E") else None
            return tuple(fill(h, layer, expert) for h in hf_names), kind, layer
    raise KeyError(f"{mcore_name}: no Hugging Face mapping for this megatron parameter")
