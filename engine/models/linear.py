"""The local layer spec's linears: megatron's Column/RowParallelLinear with a plain ``F.linear`` fast path.

megatron runs every linear through its own autograd function (``LinearWithGradAccumulationAndAsyncCommunication``:
``matmul`` then a separate ``+ bias``, Python forward and backward). Where that function has nothing to do
besides the product - no tensor-parallel all-reduce of the input gradient, no sequence parallel, no fused
gradient accumulation into ``main_grad``, no deferred embedding wgrad - ``F.linear`` computes the same thing
(forward ``x W^T + b``, gradients ``g W``, ``g^T x``, ``sum g``) with the bias folded into the GEMM (``addmm``)
and autograd's C++ backward. On one tensor-parallel rank ``forward`` itself is ``F.linear(x, W, b), None``
(no identity region-copy autograd function before the qkv and fc1 GEMMs); a ``skip_bias_add`` linear (MLP
fc1, attention proj, MLP fc2) then adds its bias inside the GEMM too and returns None as its bias, and
megatron's MLP and bias-dropout-add skip their own ``+ bias`` (what it saves: docs/benchmarks.md).

The GPT model's output layer (logits; built by megatron's GPTModel itself, no spec reaches it) gets the same
path (``use_for_output``): with tied embeddings ``F.linear(x, embedding weight)``, autograd's C++ backward, no
region copy.

Parameters, checkpoint keys, tensor-parallel attributes and every other path are megatron's: the subclasses
override ``_forward_impl`` (the hook megatron itself uses to pick its frozen-weight variant) and, for the
bias folding, ``forward``. Equal to megatron's linears within fp32 rounding (the bias is added inside the
GEMM): tests/engine/models/test_attention.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel


def _plain(kwargs: dict[str, Any]) -> bool:
    """Whether megatron's linear function would compute just ``x W^T + b`` for these arguments."""
    return not (
        kwargs.get("gradient_accumulation_fusion")
        or kwargs.get("allreduce_dgrad")
        or kwargs.get("sequence_parallel")
        or kwargs.get("grad_output_buffer") is not None
    )


def _fold(linear: Any) -> bool:
    """Whether ``forward`` can be ``F.linear(x, W, b), None`` for this linear (bias inside the GEMM).

    Only on one tensor-parallel rank (megatron's region copies and reductions are identities there; a
    row-parallel bias is added after the all-reduce) and without sequence parallel, fused gradient
    accumulation, CPU offloading or deferred embedding wgrad. A ``skip_bias_add``
    linear hands its bias back apart; megatron's MLP and bias-dropout-add add a returned bias themselves,
    except the fused bias-activation kernels (``bias_activation_fusion``), which take it separately.
    A routed expert's fc2 (row parallel) keeps its bias apart: megatron's expert MLP scales it by the
    token's routing probability (``RowParallelLinear.forward``).
    """
    config = linear.config
    return (
        linear.tp_group.size() == 1
        and not (linear.sequence_parallel or linear.gradient_accumulation_fusion)
        and not (linear.skip_bias_add and linear.bias is not None and config.bias_activation_fusion)
        and not config.defer_embedding_wgrad_compute
        and config._cpu_offloading_context is None
    )


class ColumnParallelLinear(tensor_parallel.ColumnParallelLinear):
    """megatron's ColumnParallelLinear; ``F.linear`` where its linear function is a plain product (tp=1)."""

    def forward(self, input_: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> Any:
        if weight is None and _fold(self):  # qkv, MLP fc1: no region copy, bias in the GEMM (not before GELU)
            return F.linear(input_, self.weight, self.bias), None
        return super().forward(input_, weight, runtime_gather_output)

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and _plain(kwargs):
            return F.linear(input, weight, kwargs.get("bias"))
        return super()._forward_impl(input, weight, *args, **kwargs)


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """megatron's RowParallelLinear; ``F.linear`` where its linear function is a plain product."""

    def forward(self, input_: torch.Tensor) -> Any:
        if _fold(self) and self.is_expert and self.skip_bias_add:  # the expert MLP adds bias x probability
            return F.linear(input_, self.weight), self.bias
        if _fold(self):  # attention proj, MLP fc2: bias in the GEMM, not in bias-dropout-add
            return F.linear(input_, self.weight, self.bias), None
        return super().forward(input_)

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and _plain(kwargs):
            return F.linear(input, weight, kwargs.get("bias"))
        return super()._forward_impl(input, weight, *args, **kwargs)


def use_in(spec: Any) -> None:
    """Put these linears into megatron's local layer spec (attention qkv/proj, MLP fc1/fc2; a MoE layer's
    experts and shared expert), in place."""
    attn = spec.submodules.self_attention.submodules
    slots = [(attn, "linear_qkv", ColumnParallelLinear), (attn, "linear_proj", RowParallelLinear)]
    for mlp in _mlps(spec.submodules.mlp.submodules):
        slots += [(mlp, "linear_fc1", ColumnParallelLinear), (mlp, "linear_fc2", RowParallelLinear)]
    for holder, name, cls in slots:
        if getattr(holder, name, None) is cls.__base__:
            setattr(holder, name, cls)


def _mlps(sub: Any) -> list[Any]:
    """The MLPSubmodules of a layer's MLP spec: the dense MLP's, or a MoE layer's experts and shared expert."""
    if hasattr(sub, "linear_fc1"):
        return [sub]
    parts = (getattr(sub, "experts", None), getattr(sub, "shared_experts", None))
    return [p.submodules for p in parts if p is not None and getattr(p, "submodules", None) is not None]


def use_for_output(gpt: Any) -> None:
    """Give the output layer of megatron's ``GPTModel`` this module's fast path, in place (no spec builds it).

    The layer keeps its object, parameters and keys; only its class becomes the subclass above, which adds
    no state. A layer of another type (a later megatron, Transformer Engine's) is left alone.
    """
    layer = getattr(gpt, "output_layer", None)
    if type(layer) is tensor_parallel.ColumnParallelLinear:
        layer.__class__ = ColumnParallelLinear
