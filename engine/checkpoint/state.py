"""What a checkpoint holds: the sharded state dicts of the models and optimizers, and the common state
(iteration, scheduler, the trainer's ``state`` dict, the torch thread count; equal on every rank)."""

from __future__ import annotations

import json
from typing import Any

import torch

from engine.checkpoint.errors import CheckpointError
from engine.checkpoint.layout import FORMAT_VERSION

COMMON_KEY = "checkpoint"
"""The key of the common state in dist_checkpointing's common file."""
_DISTOPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def model_key(index: int, count: int) -> str:
    return "model" if count == 1 else f"model{index}"


def sharded_state_dict(
    model_chunks: list,
    optimizer: Any,
    *,
    is_loading: bool,
    models: dict[str, tuple[list, Any, Any]] | None = None,
    part: str = "state",
) -> dict[str, Any]:
    """The sharded state of the main model (``part``: state, what a checkpoint of it holds: everything, or
    the adapters only for a LoRA model, whose base weights come from its init_from; or base, the weights
    without adapters) and of each named trained model (``models``, their state)."""
    sharded = _model_part(model_chunks, optimizer, is_loading, "", part)
    for name, (chunks, opt, _) in (models or {}).items():
        if not name or "." in name or name in ("model", "optimizer", COMMON_KEY):
            raise CheckpointError(f"model name {name!r}: a plain name without dots, not model/optimizer")
        sharded.update(_model_part(chunks, opt, is_loading, name, "state"))
    return sharded


def _model_part(
    model_chunks: list, optimizer: Any, is_loading: bool, name: str, part: str = "state"
) -> dict[str, Any]:
    """One model's part: ``[<name>.]model[i]`` (tensor keys prefixed ``<name>.``) and its optimizer."""
    from megatron.core.utils import unwrap_model

    from engine.models.lora import has_lora, is_adapter_key

    chunks = unwrap_model(list(model_chunks))
    prefix = f"{name}." if name else ""
    sharded: dict[str, Any] = {
        prefix + model_key(i, len(chunks)): c.sharded_state_dict(prefix=prefix)
        if prefix
        else c.sharded_state_dict()
        for i, c in enumerate(chunks)
    }
    if has_lora(chunks):
        keep = (lambda k: is_adapter_key(k)) if part == "state" else (lambda k: not is_adapter_key(k))
        sharded = {m: {k: v for k, v in sd.items() if keep(k)} for m, sd in sharded.items()}
    if optimizer is not None:
        metadata = _DISTOPT_METADATA if _is_distributed_optimizer(optimizer) else None
        sharded[prefix + "optimizer"] = optimizer.sharded_state_dict(
            sharded, is_loading=is_loading, metadata=metadata
        )
    return sharded


def _is_distributed_optimizer(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in inner)


def plain_state(state: dict) -> dict:
    """``state`` as given, after checking it holds plain values (they must load with weights_only)."""
    for key, value in state.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"state[{key!r}]: {e}; state holds plain values (numbers, strings, lists, dicts) equal on "
                "every rank (RNG states are saved per rank by checkpoint.save itself)"
            ) from None
    return dict(state)


def common_state(iteration: int, scheduler: Any, state: dict) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "iteration": iteration,
        "state": plain_state(state),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "torch_threads": torch.get_num_threads(),
    }
