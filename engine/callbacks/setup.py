"""The callbacks a training stage runs: the sinks named by ``<stage>.monitor.sinks`` (rank 0 only), then alarms.

A sink is one module with a factory ``sink(monitor, info) -> Callback`` registered in ``SINKS`` under its name;
the schema's ``SINK_NAMES`` lists the same names, so an unknown sink fails at config validation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from engine.callbacks import mlflow, prometheus, tensorboard, wandb
from engine.callbacks.alarms import Alarms
from engine.context import MetricsWriter, StageContext
from engine.train.callback import Callback, Callbacks, StageInfo
from pipeline.schema.config import PipelineConfig, TrainStage
from pipeline.schema.stage_sections import MonitorConfig

SinkFactory = Callable[[MonitorConfig, StageInfo], Callback]
"""Builds a sink from the stage's monitor section and what the stage is (its name, dirs, resolved config)."""

SINKS: dict[str, SinkFactory] = {
    "tensorboard": tensorboard.sink,
    "wandb": wandb.sink,
    "mlflow": mlflow.sink,
    "prometheus": prometheus.sink,
}
"""Sink name -> factory; the keys equal pipeline.schema.stage_sections.SINK_NAMES (tests/engine/train/test_observe.py checks)."""


def stage_callbacks(
    cfg: PipelineConfig, ctx: StageContext, st: TrainStage, metrics: MetricsWriter, rank: int, world: int
) -> Callbacks:
    info = StageInfo(
        ctx.stage, ctx.out_dir, ctx.run_dir, st.iters, rank, world, dataclasses.asdict(cfg), ctx.attempt
    )
    if rank != 0:
        return Callbacks([], info)
    out = Callbacks([SINKS[name](st.monitor, info) for name in st.monitor.sinks], info)

    def alarm(rec: dict[str, Any]) -> None:  # into metrics.jsonl, then to the sinks (a counter of alarms)
        metrics.write(rec)
        out.emit("on_alarm", int(rec.get("step") or 0), rec)

    out.callbacks.append(Alarms(st.monitor, alarm))
    return out


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
