"""The policy's optimizer and LR schedule: megatron's AdamW (``build_optimizer``) with torch's fused CPU kernel
where it applies (``fuse_cpu_adam``), and the warmup + cosine schedule (``build_scheduler``)."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.schema.config import TrainStage
from pipeline.schema.sections import ParallelConfig


def build_optimizer(chunks: list[Any], stage: TrainStage, par: ParallelConfig) -> tuple[Any, Any]:
    """megatron AdamW (+ loss scaling for fp16) and a linear-warmup, cosine-to-min_lr schedule (units: steps)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=stage.lr,
        min_lr=stage.min_lr,
        weight_decay=stage.weight_decay,
        adam_beta1=stage.adam_beta1,
        adam_beta2=stage.adam_beta2,
        clip_grad=stage.clip_grad,
        bf16=par.precision == "bf16",
        fp16=par.precision == "fp16",
        params_dtype=torch.float32,
        use_distributed_optimizer=par.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, chunks)
    # The schedules multiply the loss by the loss scale only through config.grad_scale_func (Megatron-LM's
    # training loop sets it; megatron-core does not): without it fp16 gradients come out divided by the
    # loss scale (2^32 at first) and the model does not learn.
    from megatron.core.utils import get_model_config

    get_model_config(chunks[0]).grad_scale_func = optimizer.scale_loss
    fuse_cpu_adam(optimizer)
    return optimizer, build_scheduler(optimizer, stage)


def build_scheduler(optimizer: Any, stage: TrainStage) -> Any:
    """Linear warmup over ``warmup_iters``, then cosine from ``lr`` to ``min_lr`` at ``iters``; constant weight decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=stage.lr,
        min_lr=stage.min_lr,
        lr_warmup_steps=stage.warmup_iters,
        lr_decay_steps=stage.iters,
        lr_decay_style="cosine",
        start_wd=stage.weight_decay,
        end_wd=stage.weight_decay,
        wd_incr_steps=stage.iters,
        wd_incr_style="constant",
    )


def fuse_cpu_adam(optimizer: Any) -> int:
    """Switch megatron's torch AdamW fallback (no TE, no apex) to torch's fused kernel where its params are on CPU.

    Without TE or apex megatron builds ``torch.optim.AdamW`` with torch's default for CPU parameters, a Python
    loop over parameters of about ten tensor ops each; ``fused=True`` runs one C++ kernel per parameter with
    the same update (equal within fp32 rounding). Measured with the 4.4x shape's 5.8M parameters, 2 threads:
    9.4 ms -> 2.6 ms per step. GPU parameters keep torch's default. The flag lives in the param groups, which a
    checkpoint's ``load_state_dict`` replaces, so a load post-hook sets it again. Returns the number of
    torch optimizers switched.
    """
    switched = 0
    for inner in _torch_optimizers(optimizer):
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or any(
            p.device.type != "cpu" for g in inner.param_groups for p in g["params"]
        ):
            continue
        _set_fused(inner)
        inner.register_load_state_dict_post_hook(_set_fused)
        switched += 1
    return switched


def _torch_optimizers(optimizer: Any) -> list[Any]:
    chained = getattr(optimizer, "chained_optimizers", None)
    return [getattr(o, "optimizer", None) for o in (chained if chained is not None else [optimizer])]


def _set_fused(inner: Any) -> None:
    for group in inner.param_groups:
        if not group.get("differentiable"):
            group["foreach"], group["fused"] = False, True
