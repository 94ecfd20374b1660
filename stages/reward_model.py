"""Reward model (opt-in, between sft and rlhf): Bradley–Terry on preference pairs with a scalar head.

Starts from the SFT model (``reward_model.init_from: auto``; the head, which SFT has not, starts as drawn by its
global name), trains on the same pairs DPO uses (users' ``data.pref_paths`` when given, else the generated
``pref_train.jsonl``; rendered with the run's chat template, engine.data.chat) with
``engine.train.steps.RewardStep``, and validates on the held-out ``eval_pref.jsonl`` as the run renders it
(``valid`` lines: loss and accuracy). Metrics per step: loss, accuracy, margin (r(chosen) - r(rejected)).
The final checkpoint is what ``engine.rl.frozen_reward.RewardModel`` loads for RL and eval scores.
"""

from __future__ import annotations

from typing import Any

from engine.context import StageContext
from pipeline.schema.config import PipelineConfig, TrainStage


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    from engine.models.reward import HEAD
    from engine.run import data_dir, train_stage
    from engine.train.steps import make_step

    def init_weights(ckpt: Any, chunks: list) -> bool:
        if ckpt.init_from is None:
            return False
        _load_backbone(
            ckpt, chunks, (HEAD,)
        )  # the SFT weights without a head: the head keeps its drawn values
        return True

    def sources(tokenizer: Any, st: TrainStage, seq_length: int, chunks: list, ckpt: Any) -> tuple[Any, Any]:
        from engine.data.chat import held_out_preferences, train_preferences
        from engine.data.truncation import stage_limit

        d = data_dir(ctx)
        limit = stage_limit("reward_model", st.max_truncated_fraction)
        train = train_preferences(d, tokenizer, seq_length, st.seed, limit)
        return train, held_out_preferences(d, tokenizer, seq_length, st.seed, limit)

    return train_stage(cfg, ctx, step=make_step("reward"), sources=sources, init_weights=init_weights)


def _load_backbone(ckpt: Any, chunks: list, fresh: tuple[str, ...]) -> None:
    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.layout import MARKER
    from engine.checkpoint.load import load_weights
    from pipeline.schema.hf_arch import is_hf_dir

    if is_hf_dir(ckpt.init_from):  # a Hugging Face model: its loader fills the GPT's own weights only
        ckpt.load_init_weights(chunks)
    else:
        root = ckpt.init_from
        path = root if (root / MARKER).is_file() else find_latest(root)
        if path is None:
            raise ValueError(f"reward_model.init_from={root}: no complete checkpoint there")
        load_weights(path, chunks, fresh=fresh)
