"""Pretraining: next-token loss on the indexed text datasets written by data_prep."""

from __future__ import annotations

from typing import Any

from engine.context import StageContext
from pipeline.schema.config import PipelineConfig, TrainStage


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    from engine.run import data_dir, train_stage
    from engine.train.steps import make_step

    def sources(tokenizer: Any, st: TrainStage, seq_length: int, chunks: list, ckpt: Any) -> tuple[Any, Any]:
        from engine.data.datasets import valid_source
        from engine.data.sources import pretrain_train_source

        d = data_dir(ctx)
        samples = st.iters * st.parallel.global_batch_size
        train = pretrain_train_source(d, tokenizer, seq_length, samples, st.seed)  # text_train or the blend
        return train, valid_source(d / "text_valid", tokenizer, seq_length, st.seed)

    return train_stage(cfg, ctx, step=make_step("pretrain"), sources=sources)
