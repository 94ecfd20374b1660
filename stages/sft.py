"""Supervised fine-tuning: loss on the assistant's tokens of the chat examples, rendered with the run's chat
template (engine.data.chat: users' data.sft_paths, else the generated task's examples)."""

from __future__ import annotations

from typing import Any

from engine.context import StageContext
from pipeline.schema.config import PipelineConfig, TrainStage


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    from engine.run import data_dir, train_stage
    from engine.train.steps import make_step

    def sources(tokenizer: Any, st: TrainStage, seq_length: int, chunks: list, ckpt: Any) -> tuple[Any, Any]:
        from engine.data.chat import train_sft
        from engine.data.datasets import valid_source
        from engine.data.truncation import stage_limit

        d = data_dir(ctx)
        limit = stage_limit("sft", st.max_truncated_fraction)
        train = train_sft(d, tokenizer, seq_length, st.seed, st.pack_examples, limit)
        return train, valid_source(d / "text_valid", tokenizer, seq_length, st.seed)  # watch forgetting

    return train_stage(cfg, ctx, step=make_step("sft"), sources=sources)
