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
    accumulation, expert communication, CPU offloading or deferred embedding wgrad. A ``skip_bias_add``
    linear hands its bias back apart; megatron's MLP and bias-dropout-add add a returned bias themselves,
    except the fused bias-activation kernels (``bias_activation_fusion``), which take it separately.
    """
    config = linear.config
    return (
        linear.tp_group.size() == 1
        and not (
            linear.sequence_parallel or linear.gradient_accumulation_fusion or linear.explicit_expert_comm
        )
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
        if _fold(self):  # attention proj, MLP fc2: bias in the GEMM, not in bias-dropout-add
            return F.linear(input_, self.weight, self.bias), None
        return super().forward(input_)

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and _plain(kwargs):
            return F.linear(input, weight, kwargs.get("bias"))
        return super()._forward_impl(input, weight, *args, **kwargs)


def use_in(spec: Any) -> None:
    """Put these linears into megatron's local layer spec (attention qkv/proj, MLP fc1/fc2), in place."""
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    for holder, name, cls in (
        (attn, "linear_qkv", ColumnParallelLinear),
        (attn, "linear_proj", RowParallelLinear),
        (mlp, "linear_fc1", ColumnParallelLinear),
        (mlp, "linear_fc2", RowParallelLinear),
    ):
        if getattr(holder, name, None) is cls.__base__:
            setattr(holder, name, cls)


def use_for_output(gpt: Any) -> None:
    """Give the output layer of megatron's ``GPTModel`` this module's fast path, in place (no spec builds it).

    The layer keeps its object, parameters and keys; only its class becomes the subclass above, which adds
    no state. A layer of another type (a later megatron, Transformer Engine's) is left alone.
    """
    layer = getattr(gpt, "output_layer", None)
    if type(layer) is tensor_parallel.ColumnParallelLinear:
        layer.__class__ = ColumnParallelLinear
