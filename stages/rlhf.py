"""RLHF of the SFT model with ``rlhf.algorithm``: offline DPO, or online GRPO, Dr. GRPO, DAPO, GSPO or PPO with
generation in the loop (each declared in pipeline/schema/rl.py, implemented by its engine.rl module:
engine.rl.registry).

Every algorithm runs on the engine's one loop through a training unit (engine.train.units); this stage only
builds the inputs the algorithm's declaration says it reads (``RLInputs``): ``prompts`` (the task's prompt
stream rendered with the run's chat template, each prompt's answer and the task checker), ``reward`` (the reward_model stage's model when
``rlhf.reward`` is model or both); ``preferences`` are read by the algorithm from data_prep's output.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.context import StageContext
from pipeline.schema.config import PipelineConfig

if TYPE_CHECKING:
    from engine.rl.registry import RLInputs


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    from engine.rl import registry
    from engine.run import train_stage

    algorithm = registry.get(cfg.rlhf.algorithm)

    def unit(env: Any) -> tuple[Any, Any]:
        return algorithm.unit(env, rl_inputs(cfg, ctx, env))

    return train_stage(cfg, ctx, step=algorithm.step(cfg.rlhf), unit=unit)


def rl_inputs(cfg: PipelineConfig, ctx: StageContext, env: Any) -> RLInputs:
    """The inputs ``rlhf.algorithm`` declares it reads (pipeline/schema/rl.py), in the order jobs built them."""
    from engine.rl.registry import RLInputs
    from engine.run import data_dir
    from pipeline.schema.rl import algorithm, reads_reward_model
    from stages import tasks

    reads = algorithm(cfg.rlhf.algorithm).reads
    d = data_dir(ctx)
    prompts, answers = task_prompts(d, env.tokenizer) if "prompts" in reads else ([], [])
    rm = _reward_model(cfg, ctx, env) if reads_reward_model(cfg.rlhf.algorithm, cfg.rlhf.reward) else None
    check = tasks.is_correct if "prompts" in reads else None
    return RLInputs(d, prompts, answers, check, rm, stop_tokens(d) if "prompts" in reads else ())


def stop_tokens(d: Path) -> tuple[int, ...]:
    """data_prep's ``stop_token_ids`` (the eos, and a Hugging Face model's end-of-turn tokens)."""
    from engine.data.datasets import read_manifest

    return tuple(read_manifest(d, verify=False).get("stop_token_ids") or ())


def task_prompts(d: Path, tokenizer: Any) -> tuple[list[str], list[str]]:
    """Online RL's prompt stream, each prompt rendered with the run's chat template up to its generation prompt
    (engine.data.chat.task_prompts: data_prep's ``rl_chat.jsonl``, or ``rl_train.jsonl`` with the project
    template), and each prompt's right answer (the task checker's)."""
    from engine.data.chat import task_prompts as rendered

    recs = rendered(d, "rl", tokenizer)
    return [r["prompt"] for r in recs], [r["answer"] for r in recs]


def _reward_model(cfg: PipelineConfig, ctx: StageContext, env: Any) -> Any:
    """The reward_model stage's final checkpoint, frozen, in this stage's layout (``rlhf.reward=model|both``)."""
    from engine.rl.frozen_reward import RewardModel

    if "reward_model" not in ctx.inputs:
        raise ValueError(f"rlhf.reward={cfg.rlhf.reward}: needs the reward_model stage's outputs")
    tok = env.tokenizer
    return RewardModel(
        ctx.inputs["reward_model"] / "checkpoints",
        cfg.model,
        env.stage.parallel,
        tok.vocab_size,
        pad_id=tok.pad,
        eod_id=tok.eod,
        seq_length=env.seq_length,
        batch_size=env.stage.parallel.micro_batch_size,
    )
