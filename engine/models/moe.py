"""Mixture of Experts on megatron-core's MoE layer: the TransformerConfig settings from the schema, the layer
specs (dense and MoE layers, the project's core attention and linears in both), and the routing statistics
of each training step.

Everything MoE comes from ``model.num_experts`` and the ``model.moe_*`` keys (pipeline.schema.moe checks
their relations): megatron's router (softmax or sigmoid top-k, aux/seq/global load-balancing loss, z-loss,
capacity factor with token dropping), token dispatcher (``parallel.moe_token_dispatcher``), experts
(``SequentialMLP`` on CPU; grouped GEMM where Transformer Engine provides it) and shared expert (with its
gate). The losses enter the gradient inside megatron (``MoEAuxLossAutoScaler`` in the router's backward,
scaled for ``calculate_per_token_loss`` by the schedule); ``RoutingStats`` reads them and the tokens each
expert got, for the metrics line.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pipeline.schema.config import ModelConfig
from pipeline.schema.moe import expert_ffn, is_moe, moe_layers
from pipeline.schema.sections import ParallelConfig

LOSS_NAMES = {
    "load_balancing_loss": "moe_aux_loss",
    "seq_load_balancing_loss": "moe_aux_loss",
    "global_load_balancing_loss": "moe_aux_loss",
    "z_loss": "moe_z_loss",
}
"""megatron's aux-loss tracker names -> our metric (the load-balancing loss of any type is ``moe_aux_loss``)."""


def transformer_kwargs(model: ModelConfig, par: ParallelConfig, grouped_gemm: bool) -> dict[str, Any]:
    """The TransformerConfig keys of the MoE layer (and qk_layernorm); only qk_layernorm for a dense model.
    ``grouped_gemm``: experts as one grouped GEMM (Transformer Engine's TEGroupedMLP: GPUs with TE)."""
    if not is_moe(model):
        return {"qk_layernorm": model.qk_layernorm}
    softmax = model.moe_router_score_function == "softmax"
    balancing = model.moe_router_load_balancing_type
    return {
        "qk_layernorm": model.qk_layernorm,
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.moe_router_topk,
        "moe_router_score_function": model.moe_router_score_function,
        "moe_router_pre_softmax": softmax and not model.moe_router_norm_topk,
        "moe_router_dtype": None if model.moe_router_dtype == "model" else model.moe_router_dtype,
        "moe_router_load_balancing_type": balancing,
        "moe_aux_loss_coeff": 0.0 if balancing == "none" else model.moe_aux_loss_coeff,
        "moe_z_loss_coeff": model.moe_z_loss_coeff or None,
        "moe_ffn_hidden_size": expert_ffn(model),
        "moe_shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": model.moe_shared_expert_gate,
        "moe_layer_freq": [int(x) for x in moe_layers(model)],
        "moe_expert_capacity_factor": model.moe_expert_capacity_factor,
        "moe_token_drop_policy": "probs",
        "moe_token_dispatcher_type": par.moe_token_dispatcher,
        "moe_grouped_gemm": grouped_gemm,
        "expert_model_parallel_size": par.ep,
        "expert_tensor_parallel_size": par.etp or par.tp,
    }


def layer_specs(model: ModelConfig, config: Any, te: bool) -> tuple[Any, Any]:
    """(dense layer spec, MoE layer spec or None): megatron's local specs (or TE's where ``te``)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    moe = model.num_experts if is_moe(model) else None
    if te:
        dense = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm)
        sparse = moe and specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=moe, moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=model.qk_layernorm
        )
        return dense, sparse
    kw = {"normalization": model.normalization, "qk_layernorm": model.qk_layernorm}
    dense = specs.get_gpt_layer_local_spec(**kw)
    sparse = moe and specs.get_gpt_layer_local_spec(num_experts=moe, moe_grouped_gemm=False, **kw)
    return dense, sparse


def block_spec(model: ModelConfig, config: Any, dense: Any, sparse: Any, vp_stage: int | None) -> Any:
    """The decoder's spec: one layer spec when every layer is alike (megatron builds the block from it, as
    for a dense model), else this pipeline chunk's layers, each dense or MoE as moe_layers says."""
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    kinds = moe_layers(model)
    if sparse is None or not any(kinds):
        return dense
    if all(kinds):
        return sparse
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    local = [sparse if kinds[i] else dense for i in range(offset, offset + count)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=LayerNormImpl)


def experts_apart(module: Any) -> int:
    """Mark every routed expert's parameter as megatron marks them under expert parallelism (``allreduce``
    False: DDP reduces them over the expert-data-parallel group, the optimizer keeps them in its own
    chained part), at ep=1 too; returns how many. Then every EP layout has the same optimizer structure
    (dense + expert) and a checkpoint saved at one EP loads at another. At ep=1 the expert-data-parallel
    group is the data-parallel group: the same reduction."""
    marked = 0
    for name, param in module.named_parameters():
        if ".mlp.experts." in f".{name}":
            param.allreduce = False  # megatron's own attribute for this (tensor_parallel.layers)
            marked += 1
    return marked


# ---------------------------------------------------------------------------- routing statistics


def _routers(chunks: list[Any]) -> list[Any]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]


class RoutingStats:
    """Tokens per expert (and dropped tokens) of every MoE layer of this rank's chunks over the training
    forwards since the last ``collect``, and megatron's load-balancing / z-loss tracker.

    A forward hook on each router counts its routing map (after capacity dropping): only in training mode
    with gradients on (not in evaluation, reference scoring or generation). ``collect`` is collective
    (every rank calls it after each optimizer step): it sums the counts over the ranks that see different
    tokens and gathers the pipeline stages' layers, reads and clears megatron's tracker.
    """

    def __init__(self, chunks: list[Any], model: ModelConfig, sequence_parallel: bool = False) -> None:
        self.names = tracked_names(model)
        self.sequence_parallel = sequence_parallel
        self.num_experts = int(model.num_experts or 0)
        self.topk = model.moe_router_topk
        self.layers = [i for i, moe in enumerate(moe_layers(model)) if moe]
        self.num_layers = model.num_layers
        self.counts = torch.zeros(model.num_layers, self.num_experts + 1, dtype=torch.float64)
        """Per global layer: tokens routed to each expert, and (last column) tokens seen by its router."""
        self._hooks = [r.register_forward_hook(self._count) for r in _routers(chunks)]

    def _count(self, router: Any, args: Any, output: Any) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return
        _, routing_map = output
        row = self.counts[int(router.layer_number) - 1]
        row[:-1] += routing_map.sum(dim=0).to(torch.float64).cpu()
        row[-1] += float(routing_map.shape[0])

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def collect(self, num_micro_batches: int) -> dict[str, float]:
        """The step's routing metrics (module docstring of engine.models.moe); resets the counts."""
        counts = _reduce_counts(self.counts, self.sequence_parallel)
        self.counts.zero_()
        out = _tracked_losses(self.names, self.num_layers, num_micro_batches, len(self.layers))
        dropped, assigned = 0.0, 0.0
        for layer in self.layers:
            tokens = counts[layer, :-1]
            seen = float(counts[layer, -1])
            if seen == 0:
                continue
            share = tokens / seen  # of the layer's tokens, the fraction each expert got (top-k: sums to k)
            p = tokens / max(float(tokens.sum()), 1.0)
            entropy = -float(sum(float(x) * math.log(float(x)) for x in p if x > 0))
            out[f"moe_layer{layer}_tokens_min"] = float(share.min())
            out[f"moe_layer{layer}_tokens_max"] = float(share.max())
            out[f"moe_layer{layer}_tokens_entropy"] = entropy / math.log(self.num_experts)
            dropped += seen * self.topk - float(tokens.sum())
            assigned += seen * self.topk
        out["moe_dropped_frac"] = dropped / assigned if assigned else 0.0
        return out


def routing_stats(chunks: list[Any], model: ModelConfig, par: ParallelConfig) -> RoutingStats | None:
    """The routing statistics of a MoE model's chunks (None for a dense model)."""
    return RoutingStats(chunks, model, par.sequence_parallel) if is_moe(model) else None


def _reduce_counts(counts: torch.Tensor, tp_distinct: bool) -> torch.Tensor:
    """Counts summed over the data- and context-parallel ranks (different tokens) and the pipeline stages
    (different layers); tensor-parallel peers route the same tokens (unless ``tp_distinct``: sequence
    parallel) and are counted once."""
    import torch.distributed as dist

    from engine.runtime import distributed as D

    if D.world_size() == 1:
        return counts.clone()
    t = counts.to(D.device(), copy=True)
    if D.tp_rank() != 0 and not tp_distinct:
        t = torch.zeros_like(t)
    dist.all_reduce(t)
    return t.cpu()


_TRACKED = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}
"""moe_router_load_balancing_type -> the name megatron's router tracks its loss under."""


def tracked_names(model: ModelConfig) -> list[str]:
    """The names megatron's routers record in its aux-loss tracker for this model (in training)."""
    names = []
    balancing = model.moe_router_load_balancing_type
    if balancing in _TRACKED and model.moe_aux_loss_coeff > 0:
        names.append(_TRACKED[balancing])
    if model.moe_z_loss_coeff > 0:
        names.append("z_loss")
    return names


def _tracked_losses(
    names: list[str], num_layers: int, micro_batches: int, moe_layers: int
) -> dict[str, float]:
    """megatron's tracked losses (unweighted: without their coefficients), mean over the MoE layers and the
    micro batches, reduced over the ranks like megatron's own loop (a micro batch's loss over its tensor-
    and context-parallel ranks, the mean over data-parallel ranks; the global loss is already global);
    the tracker is cleared. Every rank calls it (a dense pipeline stage contributes zeros)."""
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils

    from engine.runtime import distributed as D

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    rows = []
    for name in names:
        values = tracker[name]["values"].detach().double().cpu() if name in tracker else None
        if values is None or (name == "z_loss" and D.tp_rank() != 0):  # z-loss: the same on tp peers
            values = torch.zeros(num_layers, dtype=torch.float64)
        rows.append(values if name == "global_load_balancing_loss" else values / D.dp_size())
    moe_utils.clear_aux_losses_tracker()
    if not rows:
        return {}
    t = torch.stack(rows)  # a new tensor: reduced in place below
    if D.world_size() > 1:
        t = t.to(D.device())
        dist.all_reduce(t)
    sums = t.sum(dim=1).cpu()
    return {LOSS_NAMES[n]: float(v) / micro_batches / moe_layers for n, v in zip(names, sums)}
