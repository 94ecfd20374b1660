"""RLHF of the SFT model: offline DPO, or online GRPO or PPO with generation in the loop (``rlhf.algorithm``).

Both run on the engine's one loop through a training unit (engine.train.units):

- ``dpo``: the frozen reference (a frozen copy of the starting weights, ``init_from``) scores every
  preference pair the run will use, once, before training; the log-probs are cached in
  ``out_dir/reference_logps.npy`` so a resumed job reuses them, and the frozen copy is freed. The step
  then needs only the policy.
- ``grpo``: per step, prompts from the task's prompt stream, ``group_size`` samples each from the policy
  (engine.models.generate), rewards from ``rlhf.reward`` (engine.rl.rewards), group-normalised
  advantages, a clipped policy loss with a KL penalty to the frozen reference (engine.rl.algorithms).
- ``ppo``: the same rollouts and rewards, plus a trained critic (the SFT model with a value head, its own
  optimizer and checkpoint part): GAE advantages, clipped policy and value losses (engine.rl.algorithms).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.context import StageContext
from pipeline.records.files import atomic_write
from pipeline.schema.config import PipelineConfig, TrainStage

REFERENCE_FILE = "reference_logps.npy"


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    from engine.run import train_stage

    algorithm = cfg.rlhf.algorithm
    if algorithm == "dpo":
        from engine.train.steps import make_step

        return train_stage(cfg, ctx, step=make_step("dpo", beta=cfg.rlhf.beta), unit=_dpo_unit)
    from engine.rl import algorithms as rl
    from engine.run import data_dir
    from stages import tasks

    def unit(env: Any) -> tuple[Any, None]:
        prompts, answers = task_prompts(data_dir(ctx))
        rm = _reward_model(cfg, ctx, env) if cfg.rlhf.reward in ("model", "both") else None
        return rl.online_unit(env, prompts, answers, check=tasks.is_correct, reward_model=rm)

    return train_stage(cfg, ctx, step=rl.make_online_step(cfg.rlhf), unit=unit)


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
    from engine.rl.reward_model import RewardModel

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


def _dpo_unit(env: Any) -> tuple[Any, None]:
    from engine.run import data_dir
    from engine.train.trainer import WithReference
    from engine.train.units import TrainUnit

    prefs = _preferences(data_dir(env.ctx), env.tokenizer, env.seq_length, env.stage.seed)
    ref = _reference(env.ctx.out_dir / REFERENCE_FILE, prefs, env)
    return TrainUnit(WithReference(prefs, ref, 0)), None


def _preferences(d: Path, tokenizer: Any, seq_length: int, seed: int) -> Any:
    from engine.data.chat import train_preferences

    return train_preferences(d, tokenizer, seq_length, seed)


def _reference(path: Path, prefs: Any, env: Any) -> np.ndarray:
    """Reference log-probs [iters * G, 2]: from the cache, or computed by a frozen copy of the init_from weights."""
    from engine.runtime import distributed as D
    from engine.train.trainer import reference_logps

    st: TrainStage = env.stage
    rows = st.iters * st.parallel.global_batch_size
    if D.any_rank(not path.is_file()):
        reference = env.frozen_model()
        ref = reference_logps(
            reference, prefs, first_step=0, steps=st.iters, stage=st, seq_length=env.seq_length
        )
        del reference
        if D.is_rank0():
            _save_atomic(path, ref)
        D.barrier()
        return ref
    ref = np.load(path)
    if ref.shape != (rows, 2):
        raise ValueError(
            f"{path}: shape {ref.shape}, expected ({rows}, 2) for rlhf.iters x global_batch_size"
        )
    return ref


def _save_atomic(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda f: np.save(f, array), binary=True)
