"""Rewards for online RL: a callable ``reward(prompts, responses) -> np.ndarray`` (float32, one per response).

``prompts`` and ``responses`` are token-id lists of equal count: the prompt as the model saw it (the run's
chat template up to its generation prompt) and the sampled response (the closing eod not included). Each data-parallel
rank calls the reward with its own share of the rollouts; the ranks of one model-parallel group (TP x PP)
call it with the same ones and must get the same values (deterministic, no per-rank state).

Sources (``rlhf.reward``; ``make_reward``):
- ``verifier``: the task checker (the stage passes ``stages.tasks.is_correct`` and each prompt's right
  answer; the engine never imports the task): 1.0 for the right answer, else 0.0.
- ``model``: the trained reward model, frozen (``engine.rl.frozen_reward.RewardModel``, the reward_model
  stage's final checkpoint): its scalar score.
- ``both``: verifier + model (``SumReward``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np


class Reward(Protocol):
    def __call__(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> np.ndarray: ...


class VerifierReward:
    """1.0 when ``check(decoded response, expected answer)`` holds, else 0.0 (a response holding a special
    token is never right). ``answers``: each prompt's token ids -> its right answer."""

    def __init__(
        self, tokenizer: Any, answers: Mapping[tuple[int, ...], str], check: Callable[[str, str], bool]
    ) -> None:
        self.tokenizer = tokenizer
        self.answers = dict(answers)
        self.check = check

    def expected(self, prompt: Sequence[int]) -> str:
        key = tuple(int(t) for t in prompt)
        if key not in self.answers:
            raise KeyError(f"reward: no right answer known for prompt {self.tokenizer.decode(key)!r}")
        return self.answers[key]

    def __call__(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> np.ndarray:
        if len(prompts) != len(responses):
            raise ValueError(f"reward: {len(prompts)} prompts but {len(responses)} responses")
        special = set(self.tokenizer.special_ids.values())
        out = np.zeros(len(prompts), dtype=np.float32)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if any(int(t) in special for t in r):
                continue
            out[i] = float(self.check(self.tokenizer.decode(r), self.expected(p)))
        return out


class SumReward:
    """The sum of several rewards (``both``: the verifier's 0/1 plus the reward model's score)."""

    def __init__(self, *parts: Reward) -> None:
        self.parts = parts

    def __call__(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> np.ndarray:
        total = np.zeros(len(prompts), dtype=np.float32)
        for part in self.parts:
            total += np.asarray(part(prompts, responses), dtype=np.float32)
        return total


REWARDS = ("verifier", "model", "both")
"""Reward sources (``rlhf.reward``)."""


def make_reward(
    name: str,
    *,
    tokenizer: Any,
    answers: Mapping[tuple[int, ...], str],
    check: Callable[[str, str], bool],
    model: Reward | None = None,
) -> Reward:
    """The reward of ``rlhf.reward=name``: ``answers`` and ``check`` feed the verifier; ``model`` is the frozen
    reward model (``model`` and ``both``)."""
    if name == "verifier":
        return VerifierReward(tokenizer, answers, check)
    if name in ("model", "both"):
        if model is None:
            raise ValueError(f"rlhf.reward={name}: needs the trained reward model (the reward_model stage)")
        return model if name == "model" else SumReward(VerifierReward(tokenizer, answers, check), model)
    raise ValueError(f"rlhf.reward={name!r}: must be one of {list(REWARDS)}")
