"""RLHF of the SFT model with ``rlhf.algorithm``: offline DPO, or online GRPO, Dr. GRPO or PPO with generation in
the loop (each declared in pipeline/schema/rl.py, implemented by its engine.rl module: engine.rl.registry).

Every algorithm runs on the engine's one loop through a training unit (engine.train.units); this stage only
builds the inputs the algorithm's declaration says it reads (``RLInputs``): ``prompts`` (the task's prompt
stream, each prompt's answer and the task checker), ``reward`` (the reward_model stage's model when
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
    prompts, answers = task_prompts(d) if "prompts" in reads else ([], [])
    rm = _reward_model(cfg, ctx, env) if reads_reward_model(cfg.rlhf.algorithm, cfg.rlhf.reward) else None
    check = tasks.is_correct if "prompts" in reads else None
    return RLInputs(d, prompts, answers, check, rm)


def task_prompts(d: Path) -> tuple[list[str], list[str]]:
    """Online RL's prompt stream and each prompt's right answer: data_prep's ``rl_train.jsonl`` ({prompt,
    answer}) when it exists; else the prompts of ``sft_train.jsonl`` with the task checker's answer
    (stages.tasks.parse_prompt; the SFT response only for a prompt the task cannot parse)."""
    from engine.data.datasets import read_jsonl
    from stages import tasks

    rl_file = d / "rl_train.jsonl"
    if rl_file.is_file():
        recs = read_jsonl(rl_file, ("prompt", "answer"))
        return [r["prompt"] for r in recs], [r["answer"] for r in recs]
    recs = read_jsonl(d / "sft_train.jsonl", ("prompt", "response"))
    answers = []
    for r in recs:
        try:
            answers.append(tasks.parse_prompt(r["prompt"]).answer)
        except ValueError:
            answers.append(r["response"])
    return [r["prompt"] for r in recs], answers


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
