"""Supervised fine-tuning: loss on response tokens of the templated (prompt, response) examples."""

from __future__ import annotations

from typing import Any

from engine.context import StageContext
from pipeline.schema.config import PipelineConfig, TrainStage


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    from engine.run import data_dir, train_stage
    from engine.train.steps import make_step

    def sources(tokenizer: Any, st: TrainStage, seq_length: int, chunks: list, ckpt: Any) -> tuple[Any, Any]:
        from engine.data.datasets import read_manifest, sft_source, valid_source

        d = data_dir(ctx)
        chat_file = read_manifest(d, verify=False).get("sft_file")  # users' chat data (data.sft_paths)
        if chat_file:
            from engine.data.chat import chat_sft_source

            train = chat_sft_source(d / chat_file, tokenizer, seq_length, st.seed)
        else:
            train = sft_source(d / "sft_train.jsonl", tokenizer, seq_length, st.seed, pack=st.pack_examples)
        return train, valid_source(d / "text_valid", tokenizer, seq_length, st.seed)  # watch forgetting

    return train_stage(cfg, ctx, step=make_step("sft"), sources=sources)
