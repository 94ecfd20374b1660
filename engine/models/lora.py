"""LoRA on megatron-core's tensor-parallel linears (``<stage>.peft.method=lora``).

``apply_lora(model, peft, seed, tp_rank, tp_size)`` turns the targeted linears of one GPTModel chunk
(``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, as named by ``peft.target_modules``) into
LoRA linears: ``y = W x + (alpha / r) * B A dropout(x)``, with two parameters on the linear itself,
``<linear>.lora_a`` (A: r x in) and ``<linear>.lora_b`` (B: out x r), and freezes every other parameter
(``requires_grad=False``: megatron's DDP and optimizer then only see the adapters). A MoE model's routed
experts and router are not adapted (frozen with the rest). The layouts agree:

- column-parallel base (W split on its output dim): A is replicated, B split on the output dim like W;
  ``h = A x`` passes megatron's copy-to-TP region, so the gradient of A (and of x) is summed over the TP
  ranks in backward;
- row-parallel base (W split on its input dim): A is split on the input dim like W, B replicated; the
  partial products ``A_r x_r`` are all-reduced over TP, as the base's are.

So TP=2 computes the same function as TP=1. The initial A is drawn by ``(seed, global parameter name)`` like
engine/models/init_weights.py (uniform in +-1/sqrt(in), PEFT's default) and B is zero, so every layout starts
from the same adapters and the adapted model starts equal to its base. In checkpoints the adapters carry
megatron's sharding (B of a swiglu ``linear_fc1`` split into its gate and up halves like the weight), so
they reshard across layouts. A LoRA stage's checkpoints hold the adapters and their optimizer state only
(engine/checkpoint/state.py); ``merge_checkpoint`` folds them into base weights (eval, export, a next
stage's init_from) and ``merge`` folds the live adapters into the live weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.init_weights import global_name, param_seed

ADAPTER_SUFFIXES = (".lora_a", ".lora_b")
COLUMN = ("linear_qkv", "linear_fc1")
"""Column-parallel linear kinds (output split over TP)."""
ROW = ("linear_proj", "linear_fc2")
"""Row-parallel linear kinds (input split over TP)."""
PEFT_STATE_KEY = "peft"
"""Key of a LoRA stage's record in the checkpoint's common state: the settings and the base it adapts."""


def unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers (as engine.models.gpt.unwrap)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def is_adapter_key(name: str) -> bool:
    """A parameter / checkpoint key of a LoRA adapter."""
    return name.endswith(ADAPTER_SUFFIXES)


def kind_of(name: str) -> str | None:
    """``decoder.layers.3.self_attention.linear_qkv`` -> ``linear_qkv`` (None: not a LoRA-able linear)."""
    last = name.rsplit(".", 1)[-1]
    return last if last in COLUMN + ROW else None


class _LoraMixin:
    """The adapter part shared by the column- and row-parallel LoRA linears."""

    lora_a: torch.nn.Parameter
    lora_b: torch.nn.Parameter
    lora_scale: float
    lora_dropout: float
    lora_gated: bool
    lora_parallel: str  # "column" | "row"
    # provided by the megatron linear (a torch Module) the mixin is combined with
    weight: torch.nn.Parameter
    training: bool
    tp_group: Any
    state_dict: Callable[..., dict[str, Any]]

    def _lora_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_dropout and self.training:
            x = F.dropout(x, self.lora_dropout, True)
        return x

    def _lora_axes(self) -> dict[str, int]:
        return {"lora_b": 0} if self.lora_parallel == "column" else {"lora_a": 1}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        base_axes = {"weight": 0, "bias": 0} if self.lora_parallel == "column" else {"weight": 1}
        out = make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            {**base_axes, **self._lora_axes()},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )
        if self.lora_gated:  # swiglu fc1: B's rows are [gate_r; up_r] like the weight's
            key = f"{prefix}lora_b"
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets)
        return out


def _classes() -> dict[str, type[Any]]:
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    from engine.models.linear import ColumnParallelLinear, RowParallelLinear  # the local spec's linears

    class LoraColumnParallelLinear(_LoraMixin, ColumnParallelLinear):  # type: ignore[misc]
        """ColumnParallelLinear + LoRA: A replicated, B split on the output dim."""

        def forward(self, input_: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> Any:
            out, bias = super().forward(input_, weight, runtime_gather_output)
            h = F.linear(self._lora_input(input_), self.lora_a)
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)  # backward: sum over TP
            return out + F.linear(h, self.lora_b) * self.lora_scale, bias

    class LoraRowParallelLinear(_LoraMixin, RowParallelLinear):  # type: ignore[misc]
        """RowParallelLinear + LoRA: A split on the input dim, B replicated."""

        def forward(self, input_: torch.Tensor) -> Any:
            out, bias = super().forward(input_)
            h = F.linear(self._lora_input(input_), self.lora_a)
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)  # sum of partial products
            return out + F.linear(h, self.lora_b) * self.lora_scale, bias

    return {
        "column": LoraColumnParallelLinear,
        "row": LoraRowParallelLinear,
        "column_base": ColumnParallelLinear,
        "row_base": RowParallelLinear,
    }


ROUTED_EXPERTS = ".mlp.experts."
"""Linears of a MoE layer's routed experts: never adapted (their gradients reduce over the expert data-parallel
group, which megatron marks on the expert weights only; the shared expert and dense MLPs are adapted)."""


def targets(model: Any, target_modules: list[str]) -> Iterator[tuple[str, Any]]:
    """(local name, module) of the linears of ``model`` that ``target_modules`` names (routed experts excepted)."""
    for name, module in model.named_modules():
        kind = kind_of(name)
        if kind is not None and kind in target_modules and ROUTED_EXPERTS not in name:
            yield name, module


@torch.no_grad()
def apply_lora(model: Any, peft: Any, seed: int, tp_rank: int, tp_size: int) -> int:
    """Add adapters to one GPTModel chunk (before DDP wrapping) and freeze the rest; returns adapted linears."""
    classes = _classes()
    config = model.config
    if config.sequence_parallel:
        raise ValueError(
            "peft.method=lora: sequence_parallel is not supported with LoRA; set parallel.sequence_parallel=false"
        )
    count = 0
    for name, linear in targets(model, list(peft.target_modules)):
        kind = kind_of(name)
        parallel = "column" if kind in COLUMN else "row"
        if type(linear) is not classes[f"{parallel}_base"]:
            raise ValueError(
                f"peft.method=lora: {name} is a {type(linear).__name__}; LoRA supports megatron's local layer "
                "spec (ColumnParallelLinear / RowParallelLinear), not Transformer Engine's"
            )
        out_local, in_local = linear.weight.shape
        in_full = in_local * tp_size if parallel == "row" else in_local
        dev, dtype = linear.weight.device, linear.weight.dtype
        gname = global_name(model, f"{name}.lora_a")
        full_a = torch.empty(peft.rank, in_full, dtype=torch.float32, device=dev)
        gen = torch.Generator(device=dev).manual_seed(param_seed(seed, gname))
        bound = 1.0 / math.sqrt(in_full)
        full_a.uniform_(-bound, bound, generator=gen)
        a = full_a.chunk(tp_size, dim=1)[tp_rank] if parallel == "row" else full_a
        b_rows = out_local
        linear.__class__ = classes[parallel]
        linear.lora_a = torch.nn.Parameter(a.to(dtype).contiguous())
        linear.lora_b = torch.nn.Parameter(torch.zeros(b_rows, peft.rank, dtype=dtype, device=dev))
        if parallel == "column":
            _tp_attrs(linear.lora_b, 0, tp_size)
        else:
            _tp_attrs(linear.lora_a, 1, tp_size)
        linear.lora_scale = float(peft.alpha) / peft.rank
        linear.lora_dropout = float(peft.dropout)
        linear.lora_gated = kind == "linear_fc1" and bool(config.gated_linear_unit)
        linear.lora_parallel = parallel
        count += 1
    for pname, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(pname))
    return count


def _tp_attrs(param: torch.Tensor, dim: int, tp_size: int) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, True, dim, 1)  # split (as megatron marks it at any tp)


def has_lora(chunks: list[Any]) -> bool:
    """Whether any chunk (wrapped or not) carries adapters."""
    return any(is_adapter_key(n) for c in chunks for n, _ in c.named_parameters())


def trainable_parameters(chunks: list[Any]) -> int:
    """Parameters this rank trains (adapters under LoRA)."""
    return sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)


@torch.no_grad()
def merge(model: Any) -> int:
    """Fold the live adapters of one unwrapped chunk into its weights (W += scale B A, each rank its shard)
    and turn the linears back into plain ones; returns how many were merged."""
    classes = _classes()
    merged = 0
    for _, linear in list(model.named_modules()):
        if not isinstance(linear, _LoraMixin):
            continue
        delta = (linear.lora_b.float() @ linear.lora_a.float()) * linear.lora_scale
        linear.weight.add_(delta.to(linear.weight.dtype))
        parallel = linear.lora_parallel
        del linear.lora_a, linear.lora_b
        linear.__class__ = classes[f"{parallel}_base"]
        merged += 1
    return merged


# ---------------------------------------------------------------------------- LoRA checkpoints as weights


def record(peft: Any, base: Path | str | None) -> dict[str, Any]:
    """What a LoRA checkpoint records about itself: the settings and the base weights it adapts."""
    return {**dataclasses.asdict(peft), "base": str(base) if base is not None else None}


def checkpoint_record(path: Path) -> dict[str, Any] | None:
    """The ``peft`` record of a committed checkpoint (None: a full checkpoint)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(path))
    state = (common.get("checkpoint") or {}).get("state") or {}
    rec = state.get(PEFT_STATE_KEY)
    return rec if isinstance(rec, dict) and rec.get("method") == "lora" else None


def adapter_tensors(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full adapter tensors of a LoRA checkpoint (``saved``: its tensors, checkpoint.load_tensors) by
    global parameter name (``decoder.layers.<global layer>.<linear>.lora_a`` / ``.lora_b``); megatron saves
    the layers stacked (``decoder.layers.<linear>.lora_a`` with a leading layer axis), unstacked here."""
    out: dict[str, torch.Tensor] = {}
    for key, t in saved.items():
        if not is_adapter_key(key) or key.startswith("optimizer"):
            continue
        if key.startswith("decoder.layers.") and t.dim() == 3:
            rest = key[len("decoder.layers.") :]
            out |= {f"decoder.layers.{i}.{rest}": t[i] for i in range(t.shape[0])}
        else:
            out[key] = t
    return out


def full_deltas(saved: dict[str, torch.Tensor], rec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``{global weight name: scale * B @ A}`` (full, unsharded tensors) of a LoRA checkpoint's tensors."""
    tensors = adapter_tensors(saved)
    scale = float(rec["alpha"]) / int(rec["rank"])
    out = {}
    for key, a in tensors.items():
        if key.endswith(".lora_a"):
            prefix = key[: -len(".lora_a")]
            out[f"{prefix}.weight"] = (tensors[f"{prefix}.lora_b"].float() @ a.float()) * scale
    return out


@torch.no_grad()
def merge_checkpoint(
    path: Path,
    saved: dict[str, torch.Tensor],
    chunks: list[Any],
    rec: dict[str, Any],
    tp_rank: int,
    tp_size: int,
) -> int:
    """Add the adapters of LoRA checkpoint ``path`` (its tensors ``saved``) to the (base) weights of
    ``chunks``, each rank its shard."""
    deltas = full_deltas(saved, rec)
    merged = 0
    for chunk in chunks:
        model = unwrap(chunk)
        gated = bool(model.config.gated_linear_unit)
        for name, linear in targets(model, list(rec["target_modules"])):
            delta = deltas.get(global_name(model, f"{name}.weight"))
            if delta is None:
                raise ValueError(f"{path}: no adapter for {global_name(model, name)}")
            kind = kind_of(name)
            if kind in ROW:
                local = delta.chunk(tp_size, dim=1)[tp_rank]
            elif kind == "linear_fc1" and gated:
                gate, up = delta.chunk(2, dim=0)
                local = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
            else:
                local = delta.chunk(tp_size, dim=0)[tp_rank]
            linear.weight.add_(local.to(linear.weight.device, linear.weight.dtype))
            merged += 1
    return merged
