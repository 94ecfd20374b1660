"""The planner's Mixture-of-Experts arithmetic: parameters of a MoE layer (total, per rank, active per token),
its FLOPs and the all-to-all volume of its token dispatch. Pure arithmetic, no torch.

What a MoE layer holds in megatron-core's MoE layer (local spec): the router (``num_experts x hidden``, plus
a bias with add_bias_linear), the routed experts (each a SwiGLU/GELU MLP of width moe_ffn_hidden_size, split
over expert tensor parallelism etp, ``num_experts / ep`` of them on each rank) and the shared expert (an MLP of
width moe_shared_expert_intermediate_size split over tp, plus a ``1 x hidden`` gate). Active parameters are
those a token passes through: the router, top-k experts and the shared expert (as published counts take
them: Mixtral-8x7B's 12.9B, Qwen3-30B-A3B's 3.3B). Dispatch volume: with the all-to-all dispatcher every token
goes to top-k experts and comes back, forward and backward (four exchanges a layer and micro batch), the
share ``(ep - 1) / ep`` of it to other ranks when the router spreads tokens evenly; the all-gather dispatcher
gathers every token of the expert-parallel group and reduce-scatters the outputs.
"""

from __future__ import annotations

from typing import Any

from pipeline.schema.moe import expert_ffn, is_moe, moe_layers


def _mlp(m: Any, width: int, tp: int) -> int:
    """One MLP of ``width`` on one of ``tp`` ranks: fc1 (doubled for swiglu) and fc2 split, fc2 bias replicated."""
    h, bias = m.hidden_size, int(m.add_bias_linear)
    fc1 = width * (2 if m.activation == "swiglu" else 1)
    return (h + bias) * fc1 // tp + width * h // tp + bias * h


def expert_params(m: Any, etp: int = 1) -> int:
    """One routed expert on one of ``etp`` expert-tensor-parallel ranks."""
    return _mlp(m, expert_ffn(m), etp)


def moe_mlp_params(m: Any, tp: int = 1, ep: int = 1, etp: int = 1, active: bool = False) -> tuple[int, int]:
    """(router and shared expert, routed experts) parameters of one MoE layer's MLP on one rank; ``active``:
    what one token uses (top-k experts, counted unsplit)."""
    h = m.hidden_size
    router = m.num_experts * (h + int(m.add_bias_linear))
    shared = 0
    if m.moe_shared_expert_intermediate_size:
        shared = _mlp(m, m.moe_shared_expert_intermediate_size, tp) + (h if m.moe_shared_expert_gate else 0)
    experts = m.moe_router_topk * expert_params(m) if active else m.num_experts // ep * expert_params(m, etp)
    return router + shared, experts


def mlp_flops_ratio(m: Any, dense_ratio: float) -> float:
    """The mean over layers of the MLP term of Megatron-LM's FLOPs formula, in units of ``12 B s h^2`` per
    layer: ``dense_ratio`` (f/h x gated) for a dense layer; for a MoE layer top-k experts and the shared
    expert ((k f_e + f_s)/h x gated), the router (E / 2h) and the shared gate (1 / 2h)."""
    kinds = moe_layers(m)
    if not any(kinds):
        return dense_ratio
    h = m.hidden_size
    gated = 1.5 if m.activation == "swiglu" else 1.0
    width = m.moe_router_topk * expert_ffn(m) + (m.moe_shared_expert_intermediate_size or 0)
    sparse = width / h * gated + m.num_experts / (2 * h) + (1 / (2 * h) if m.moe_shared_expert_gate else 0)
    return sum(sparse if k else dense_ratio for k in kinds) / len(kinds)


def moe_activation_extra(m: Any, micro_batch: int, tp: int, recompute: str) -> float:
    """Activation bytes a MoE layer keeps for one micro batch beyond a dense layer's (Korthikanti et al.'s
    ``19 s b h`` MLP term scaled from a 4h MLP to the widths a token passes through, k f_e + f_s, plus the
    top-k copies of each token the dispatcher permutes, 2k s b h), averaged over the layers: 0 for a dense
    model and with full recompute (a layer keeps only its input)."""
    kinds = moe_layers(m)
    if not any(kinds) or recompute == "full":
        return 0.0
    sbh = m.seq_length * micro_batch * m.hidden_size
    width = m.moe_router_topk * expert_ffn(m) + (m.moe_shared_expert_intermediate_size or 0)
    extra = sbh * (19 * (width / (4 * m.hidden_size) - 1) + 2 * m.moe_router_topk) / tp
    return extra * sum(kinds) / len(kinds)


def rank_layers(num_layers: int, pp: int, vpp: int | None, pp_rank: int) -> list[int]:
    """Global layers (from 0) of pipeline rank ``pp_rank``: chunk c holds megatron's layer offset
    ``c x L / vpp + pp_rank x L / (vpp x pp)`` onwards."""
    v = vpp or 1
    per = num_layers // (pp * v)
    return [c * (num_layers // v) + pp_rank * per + i for c in range(v) for i in range(per)]


def dispatch_bytes(m: Any, par: Any, pp_rank: int, micro_batches: int) -> int:
    """Bytes one rank of pipeline rank ``pp_rank`` sends to other ranks in token dispatch per optimizer step
    (forward and backward, recompute included): 0 without experts or with ep 1."""
    if not is_moe(m) or par.ep == 1:
        return 0
    kinds = moe_layers(m)
    layers = sum(kinds[i] for i in rank_layers(m.num_layers, par.pp, par.vpp, pp_rank))
    tokens = par.micro_batch_size * m.seq_length
    width = 4 if par.precision == "fp32" else 2
    exchanges = (
        6 if par.recompute == "full" else 4
    )  # dispatch + combine, forward and backward (+ forward again)
    if par.moe_token_dispatcher == "allgather":
        per = tokens * (par.ep - 1)  # every other rank's tokens gathered, outputs reduce-scattered
    else:
        per = tokens * m.moe_router_topk * (par.ep - 1) / par.ep
    return round(layers * micro_batches * exchanges * per * m.hidden_size * width)
