"""The callbacks a training stage runs: TensorBoard, W&B (optional), alarms; rank 0 only."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from engine.context import MetricsWriter, StageContext
from engine.train.callback import Callback, Callbacks, StageInfo
from pipeline.schema.config import PipelineConfig, TrainStage

log = logging.getLogger(__name__)


def stage_callbacks(
    cfg: PipelineConfig, ctx: StageContext, st: TrainStage, metrics: MetricsWriter, rank: int, world: int
) -> Callbacks:
    info = StageInfo(ctx.stage, ctx.out_dir, ctx.run_dir, st.iters, rank, world, dataclasses.asdict(cfg))
    if rank != 0:
        return Callbacks([], info)
    mon = st.monitor
    cbs: list[Callback] = []
    if mon.tensorboard:
        from engine.callbacks.tensorboard import TensorBoard

        cbs.append(TensorBoard(ctx.out_dir / "tensorboard"))
    if mon.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            log.error(
                "%s.monitor.wandb=true but wandb is not installed (pip install '.[wandb]'); off", ctx.stage
            )
        else:
            from engine.callbacks.wandb import WandB

            cbs.append(WandB(ctx.out_dir, mon.wandb_project, ctx.run_dir.name, ctx.stage, info.config))
    from engine.callbacks.alarms import Alarms

    cbs.append(Alarms(mon, metrics.write))
    return Callbacks(cbs, info)


def peak_tflops(cfg: PipelineConfig) -> float:
    """Peak TFLOP/s of one rank's device: cluster.peak_tflops, else the planner's GPU peak or the CPU figure."""
    if cfg.cluster.peak_tflops:
        return cfg.cluster.peak_tflops
    import torch

    from engine.train.meter import CPU_PEAK_TFLOPS

    return cfg.planner.gpu_peak_tflops if torch.cuda.is_available() else CPU_PEAK_TFLOPS


def flops_per_step(cfg: PipelineConfig, st: TrainStage, seq_length: int, vocab: int, sequences: int) -> Any:
    """Model FLOPs of one optimizer step of the stage (the planner's formula at the stage's sequence length)."""
    from pipeline.schema.estimates import padded_vocab, step_flops

    m = dataclasses.replace(cfg.model, seq_length=seq_length)
    model_flops, _ = step_flops(
        m, padded_vocab(m, vocab, st.parallel.tp), st.parallel.global_batch_size * sequences
    )
    return model_flops
