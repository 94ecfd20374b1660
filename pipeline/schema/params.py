"""The planner's parameter counts: what megatron-core's GPTModel (local layer spec) holds for a ``ModelConfig``,
in all, per GPU of a layout (tp, pp, vpp, ep, etp) and per token (active, MoE), and its LoRA adapters. Pure
arithmetic, no torch; the tests check the counts against GPTModels built on the meta device and against
published counts. Mixture-of-Experts layers: pipeline.schema.moe_sizes.
"""

from __future__ import annotations

from pipeline.schema.config import ModelConfig, PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.schema.moe import is_moe, moe_layers
from pipeline.schema.moe_sizes import moe_mlp_params, rank_layers


def vocab_of(model: ModelConfig, vocab_size: int | None = None) -> int:
    """The vocabulary size to count with: ``vocab_size`` if given, else ``model.vocab_size``."""
    vocab = vocab_size if vocab_size is not None else model.vocab_size
    if vocab is None:
        raise ConfigError("model.vocab_size=None: the planner needs a vocabulary size; set model.vocab_size")
    return vocab


def config_vocab(cfg: PipelineConfig) -> int:
    """The run's unpadded vocabulary: model.vocab_size, else the size of the tokenizer data prep trains."""
    if cfg.model.vocab_size is None and cfg.data.tokenizer_path is None:
        return cfg.data.vocab_size
    return vocab_of(cfg.model)


def padded_vocab(model: ModelConfig, vocab: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of make_vocab_size_divisible_by x tp."""
    multiple = model.make_vocab_size_divisible_by * tp
    return -(-vocab // multiple) * multiple


def _kv_channels(m: ModelConfig) -> int:
    return m.kv_channels or m.hidden_size // m.num_attention_heads


def _ffn(m: ModelConfig) -> int:
    return m.ffn_hidden_size or 4 * m.hidden_size


def _norm_params(m: ModelConfig) -> int:
    """One LayerNorm (weight and bias) or RMSNorm (weight)."""
    return m.hidden_size * (2 if m.normalization == "LayerNorm" else 1)


def _attention_params(m: ModelConfig, tp: int = 1) -> int:
    """Attention of one layer on one tensor-parallel rank, with the layer's two norms (and the per-head
    query/key norms of qk_layernorm)."""
    h, q = m.hidden_size, m.num_attention_heads * _kv_channels(m)
    kv = (m.num_query_groups or m.num_attention_heads) * _kv_channels(m)
    bias = int(m.add_bias_linear)
    qkv = (h + int(m.add_bias_linear or m.add_qkv_bias)) * (q + 2 * kv) // tp
    proj = q * h // tp + bias * h
    qk_norm = 2 * _kv_channels(m) * (2 if m.normalization == "LayerNorm" else 1) if m.qk_layernorm else 0
    return qkv + proj + 2 * _norm_params(m) + qk_norm


def layer_params(m: ModelConfig, tp: int = 1) -> int:
    """Parameters of one dense transformer layer on one tensor-parallel rank.

    Column-parallel weights and biases (qkv, fc1) and row-parallel weights (proj, fc2) are split over tp;
    row-parallel biases and the norms are replicated.
    """
    h, bias = m.hidden_size, int(m.add_bias_linear)
    fc1 = _ffn(m) * (2 if m.activation == "swiglu" else 1)
    mlp = (h + bias) * fc1 // tp + _ffn(m) * h // tp + bias * h
    return _attention_params(m, tp) + mlp


def layer_param_split(
    m: ModelConfig, layer: int, tp: int = 1, ep: int = 1, etp: int = 1, active: bool = False
) -> tuple[int, int]:
    """(parameters outside the routed experts, routed-expert parameters) of global layer ``layer`` on one
    rank; ``active``: what one token passes through (top-k experts)."""
    if not moe_layers(m)[layer]:
        return layer_params(m, tp), 0
    rest, experts = moe_mlp_params(m, tp, ep, etp, active)
    return _attention_params(m, tp) + rest, experts


def _lora(rank: int, fan_in: int, fan_out: int, column: bool, tp: int) -> int:
    return rank * fan_in + fan_out * rank // tp if column else rank * fan_in // tp + fan_out * rank


def lora_layer_params(m: ModelConfig, rank: int, targets: list[str], tp: int = 1, layer: int = 0) -> int:
    """LoRA adapter parameters of global layer ``layer`` on one tensor-parallel rank (engine/models/lora.py):
    a column-parallel linear (qkv, fc1) has A (r x in) replicated and B (out x r) split; a row-parallel one
    (proj, fc2) A split and B replicated. In a MoE layer fc1/fc2 are the shared expert's (split over tp):
    the routed experts are never adapted (engine/models/lora.py, ROUTED_EXPERTS)."""
    h, q = m.hidden_size, m.num_attention_heads * _kv_channels(m)
    kv = (m.num_query_groups or m.num_attention_heads) * _kv_channels(m)
    gated = 2 if m.activation == "swiglu" else 1
    mlps = [(_ffn(m), tp)]  # (width, split) of each adapted MLP
    if moe_layers(m)[layer]:
        shared = m.moe_shared_expert_intermediate_size
        mlps = [(shared, tp)] if shared else []
    n = 0
    for kind in targets:
        if kind == "linear_qkv":
            n += _lora(rank, h, q + 2 * kv, True, tp)
        elif kind == "linear_proj":
            n += _lora(rank, q, h, False, tp)
        elif kind == "linear_fc1":
            n += sum(_lora(rank, h, w * gated, True, t) for w, t in mlps)
        elif kind == "linear_fc2":
            n += sum(_lora(rank, w, h, False, t) for w, t in mlps)
    return n


def embedding_params(m: ModelConfig, vocab: int, tp: int = 1) -> int:
    """Word embeddings (split over tp) and, for learned absolute positions, the replicated position table."""
    positions = (
        (m.max_position_embeddings or m.seq_length) if m.position_embedding == "learned_absolute" else 0
    )
    return vocab * m.hidden_size // tp + positions * m.hidden_size


def param_count(model: ModelConfig, vocab_size: int | None = None, *, pad_for_tp: int | None = None) -> int:
    """Total parameters of megatron's GPTModel for ``model``, counted once (tied embeddings once).

    ``vocab_size`` overrides ``model.vocab_size``. The vocabulary is not padded (the published count)
    unless ``pad_for_tp`` gives the tensor-parallel size to pad for, as megatron does.
    """
    vocab = vocab_of(model, vocab_size)
    if pad_for_tp is not None:
        vocab = padded_vocab(model, vocab, pad_for_tp)
    output = 0 if model.tie_embeddings else vocab * model.hidden_size
    layers = sum(sum(layer_param_split(model, i)) for i in range(model.num_layers))
    return layers + embedding_params(model, vocab) + _norm_params(model) + output


def active_param_count(model: ModelConfig, vocab_size: int | None = None) -> int:
    """Parameters one token passes through (MoE: top-k routed experts instead of all; dense: param_count),
    counted as published counts are (embeddings and output layer included, vocabulary unpadded)."""
    if not is_moe(model):
        return param_count(model, vocab_size)
    vocab = vocab_of(model, vocab_size)
    output = 0 if model.tie_embeddings else vocab * model.hidden_size
    layers = sum(sum(layer_param_split(model, i, active=True)) for i in range(model.num_layers))
    return layers + embedding_params(model, vocab) + _norm_params(model) + output


def rank_param_split(
    m: ModelConfig,
    vocab: int,
    tp: int,
    pp: int,
    pp_rank: int,
    ep: int = 1,
    etp: int = 1,
    vpp: int | None = None,
) -> tuple[int, int]:
    """(parameters outside the routed experts, routed-expert parameters) held by one GPU of pipeline rank
    ``pp_rank``: its layers, plus the embeddings on the first rank and the final norm and output layer on
    the last (a tied output layer is a second copy when pp > 1). ``vocab`` is the padded vocabulary."""
    dense = experts = 0
    for layer in rank_layers(m.num_layers, pp, vpp, pp_rank):
        d, e = layer_param_split(m, layer, tp, ep, etp)
        dense, experts = dense + d, experts + e
    if pp_rank == 0:
        dense += embedding_params(m, vocab, tp)
    if pp_rank == pp - 1:
        shared = m.tie_embeddings and pp == 1
        dense += _norm_params(m) + (0 if shared else vocab * m.hidden_size // tp)
    return dense, experts


def rank_params(m: ModelConfig, vocab: int, tp: int, pp: int, pp_rank: int, ep: int = 1, etp: int = 1) -> int:
    """Parameters held by one GPU of pipeline rank ``pp_rank`` (rank_param_split, both parts)."""
    return sum(rank_param_split(m, vocab, tp, pp, pp_rank, ep, etp))
